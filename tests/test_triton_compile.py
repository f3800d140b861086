"""The Triton kernels compile for the GPUs users train on, without a GPU, in the
specialisation that runs.

The interpreter checks less than the compiler (block shapes, loop-carried types). Here
each launch the Triton backend makes on CUDA is built by the same host code that makes
it (``_triton_kernels.stats_launch`` / ``grad_launch``, from the chunk shape the
``LOGITS_CHUNK_BYTES`` budget gives at 8192 tokens x V 151936, and a fused-loss tile),
and specialised as Triton's launcher specialises it: its binder reads the arguments
(pointers 16-byte aligned, as fresh CUDA allocations are; integers divisible by 16 or
equal to 1) into the same signature, constexprs and ``tt.divisibility`` attributes a
launch compiles. Then it is compiled ahead of time through Triton's NVIDIA backend and
``ptxas`` (both ship in the triton wheel) for Hopper (sm_90; bf16 also for Ampere,
sm_80), and its shared memory is checked against the smaller of those parts' per-block
limits. A few seconds a kernel on a 2-core CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed here (py311's CPU torch wheel has none)", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    import json, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from torch_impl.processors import _setup, _triton_kernels as tk

    SHARED_LIMIT = 166912  # bytes a block may use on an A100 (sm_80); an H100 allows 232448

    class Arg:
        '''A CUDA tensor as the launcher sees it: dtype, shape, strides, an aligned address.'''
        def __init__(self, dtype, shape, strides=None):
            self.dtype, self.shape = dtype, tuple(shape)
            self._strides = strides or torch.empty(shape, device="meta").stride()
        def stride(self, d):
            return self._strides[d]
        def data_ptr(self):
            return 1 << 20  # the caching allocator's blocks are 512-byte aligned

    def chunk(rows, cols, n):
        z = Arg(torch.float32, (rows, cols))
        vec = {k: Arg(torch.float32, (n,)) for k in ("inv_t", "m", "s", "t", "zy", "a", "b", "g")}
        return z, Arg(torch.int64, (n,)), vec

    def specialise_and_compile(fn, launch, arch):
        grid, args, kwargs = launch
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        src = ASTSource(fn, signature, constexprs, attrs)
        k = triton.compile(src, target=target, options=options.__dict__)
        divisible = sorted(fn.arg_names[p[0]] for p, a in attrs.items() if ["tt.divisibility", 16] in a)
        return k, dict(constexprs={fn.arg_names[p[0]]: v for p, v in constexprs.items()}, divisible=divisible)

    cfg = _setup.kernel_config(torch.device("cuda"))
    n, vocab = 8192, 151936
    budget = _setup.LOGITS_CHUNK_BYTES["cuda"] // 4
    shapes = {
        "linear_logprobs": _setup.cublas_chunks(n, vocab, budget, None, None),
        "fused tile": (budget // vocab, vocab),
    }
    out = []
    for where, (rows, cols) in shapes.items():
        z, labels, v = chunk(rows, cols, n)
        vs = [v[k] for k in ("inv_t", "m", "s", "t", "zy")]
        stats = tk.stats_launch(z, labels, *vs, row0=0, col0=0, cfg=cfg)
        launches = [("stats", tk._chunk_stats_kernel, torch.float32, stats)]
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            # the gradient's output: z itself (fp32) or the first half of each row's bytes
            o = z if dtype == torch.float32 else Arg(dtype, (rows, cols), (2 * cols, 1))
            launches.append(("grad", tk._logit_grad_kernel, dtype,
                             tk.grad_launch(z, o, labels, v["inv_t"], v["m"], (v["a"], v["b"], v["g"]),
                                            row0=0, col0=0, cfg=cfg)))
        for name, fn, dtype, launch in launches:
            for arch in (90, 80) if dtype == torch.bfloat16 or name == "stats" else (90,):
                k, spec = specialise_and_compile(fn, launch, arch)
                out.append(dict(kernel=name, where=where, rows=rows, cols=cols, arch=arch, dtype=str(dtype),
                                shared=k.metadata.shared, ok=k.metadata.shared <= SHARED_LIMIT,
                                barrier="bar.sync" in k.asm["ptx"] or "barrier.sync" in k.asm["ptx"], **spec))
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90_and_sm80_as_launched(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    cmd = [sys.executable, "-c", SCRIPT]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * (2 + 4)  # two chunk shapes x (stats at sm_90/80; grad bf16 x2, fp16, fp32)
    too_big = [r for r in rows if not r["ok"]]
    assert not too_big, too_big
    for r in rows:
        # the launch's specialisation: the pointers 16-byte aligned, the constexprs the launch's own
        assert {"z_ptr", "lab_ptr", "inv_t_ptr"} <= set(r["divisible"]), r
        assert r["constexprs"]["BLOCK_M"] == 4 and r["constexprs"]["BLOCK_N"] == 1024, r
        assert r["constexprs"]["PER_TOKEN_T"] is True, r
    grads = [r for r in rows if r["kernel"] == "grad"]
    assert all("out_ptr" in r["divisible"] and r["constexprs"]["WITH_B"] is True for r in grads)
    # the in-place gradient holds its stores behind a barrier (see _logit_grad_kernel)
    assert all(r["barrier"] for r in grads), grads
    # an 8192-row chunk and a 1766-row fused tile specialise differently: rows % 16
    main = next(r for r in rows if r["where"] == "linear_logprobs")
    fused = next(r for r in rows if r["where"] == "fused tile")
    assert (main["rows"], main["cols"]) == (8192, 32768) and "rows" in main["divisible"]
    assert fused["rows"] == 1766 and "rows" not in fused["divisible"]
