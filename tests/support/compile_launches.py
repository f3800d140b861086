"""Compile recorded Triton launches ahead of time for NVIDIA GPUs, without a GPU.

    python -m tests.support.compile_launches LAUNCHES.json ARCH[,ARCH...]   # prints one JSON list

Run it where ``TRITON_INTERPRET`` is unset (the kernels must be ``JITFunction``s).
Each launch of ``tests/support/launch_scenarios.py`` (kernel ``module:qualname``, arguments as
the launcher sees them, constexprs) is rebuilt with stand-in tensors that carry the
recorded dtype and 16-byte alignment, bound by Triton's own launcher binder (the
signature, the constexprs and the ``tt.divisibility`` attributes a real launch
compiles), then compiled through Triton's NVIDIA backend and ``ptxas`` (both in the
triton wheel) for each compute capability. A kernel wrapped by ``triton.autotune`` or
``triton.heuristics`` is unwrapped to its ``JITFunction``: the recorded constexprs
are the config the wrapper chose.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import triton
import triton.language as tl


@triton.jit
def small_dot_kernel(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A self-test kernel (tests/processors/test_triton_compile.py): runs under the interpreter;
    compiled, ``tl.dot`` needs at least 16 in each dimension."""
    i = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + i[:, None] * BLOCK + i[None, :], mask=i[:, None] < n)
    tl.store(out_ptr + i[:, None] * BLOCK + i[None, :], tl.dot(a, a), mask=i[:, None] < n)


SHARED_LIMIT = {80: 166912, 90: 232448}
"""Bytes of shared memory one block may use: A100 (sm_80) and H100/H200 (sm_90)."""

BASE = 1 << 20  # the caching allocator's blocks are 512-byte aligned


class Arg:
    """A CUDA tensor as the launcher reads it: a dtype and an address."""

    def __init__(self, dtype: Any, aligned16: bool) -> None:
        self.dtype = dtype
        self._ptr = BASE if aligned16 else BASE + 8

    def data_ptr(self) -> int:
        return self._ptr


def _value(desc: Any) -> Any:
    import torch

    if isinstance(desc, dict):
        if "tensor" in desc:
            return Arg(getattr(torch, desc["tensor"]), desc["aligned16"])
        if "int" in desc:
            return desc["int"]
        if "float" in desc:
            return desc["float"]
        raise ValueError(f"cannot rebuild launch argument {desc}")
    return desc


def kernel_of(name: str) -> Any:
    """The ``JITFunction`` named ``module:qualname`` (wrappers unwrapped)."""
    from triton.runtime.jit import JITFunction

    module, _, qual = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def compile_one(launch: dict[str, Any], arch: int) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = kernel_of(launch["kernel"])
    args = [_value(a) for a in launch["args"]]
    kwargs = {k: _value(v) for k, v in launch["constexprs"].items()}
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    k = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    ptx = k.asm["ptx"]
    return {
        "kernel": launch["kernel"],
        "scenario": launch.get("scenario", ""),
        "arch": arch,
        "shared": k.metadata.shared,
        "shared_ok": k.metadata.shared <= SHARED_LIMIT[arch],
        "barrier": "bar.sync" in ptx or "barrier.sync" in ptx,
        "bf16_stores": bool(signature.get("out_ptr") == "*bf16"),
        "hardware_bf16": "cvt.rn.bf16" in ptx,
        "constexprs": {fn.arg_names[p[0]]: v for p, v in constexprs.items()},
        "divisible": sorted(
            fn.arg_names[p[0]] for p, a in attrs.items() if ["tt.divisibility", 16] in a
        ),
        "signature": {k: str(v) for k, v in signature.items()},
    }


def _job(item: tuple[dict[str, Any], int]) -> dict[str, Any]:
    launch, arch = item
    try:
        return compile_one(launch, arch)
    except Exception as exc:  # reported per launch, the others still compile
        text = f"{type(exc).__name__}: {exc}"
        return {
            "kernel": launch["kernel"],
            "scenario": launch.get("scenario", ""),
            "arch": arch,
            "error": text[-2000:],
        }


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_launches: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    launches = json.loads(open(argv[0]).read())
    archs = [int(a) for a in argv[1].split(",")]
    items = [(launch, arch) for launch in launches for arch in archs]
    workers = max(1, min(len(items), int(os.environ.get("COMPILE_WORKERS", "2"))))
    with ProcessPoolExecutor(workers) as pool:
        rows = list(pool.map(_job, items))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
