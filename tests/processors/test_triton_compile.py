"""Every Triton kernel launch the GPU command makes compiles for the GPUs users train
on, in the specialisation that launches, without a GPU.

The interpreter checks less than the compiler (block shapes, ``tl.dot`` sizes,
loop-carried types). Here the launches are not written by hand: each call of the GPU
benchmark and of the GPU tests runs on a fake CUDA device at its real size
(``tests/support/launch_scenarios.py``), and every launch of any ``@triton.jit`` kernel is
recorded with the arguments the launcher specialises on: pointer dtypes and 16-byte
alignment, integers (1, multiples of 16, width), constexprs and ``num_warps``. Each
distinct specialisation is then compiled through Triton's NVIDIA backend and
``ptxas`` (``tests/support/compile_launches.py``) for Hopper (sm_90) and Ampere (sm_80), and
its shared memory checked against the part's per-block limit. A new kernel, flag or
launch shape is picked up by the recording, with no change here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed here (py311's CPU torch wheel has none)", allow_module_level=True
    )
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip(
        "records launches under TRITON_INTERPRET=1 (a GPU runs them for real)",
        allow_module_level=True,
    )

from tests.support.compile_launches import small_dot_kernel
from tests.support.launch_scenarios import SCENARIOS, STOPPED_BY_A_HOST_READ, record_all, unique

pytestmark = pytest.mark.filterwarnings(
    "ignore:Accessing the data pointer of FakeTensor:UserWarning"
)

ROOT = Path(__file__).resolve().parents[2]
ARCHS = (90, 80)
SEEN_BOTH_WAYS = ("PER_TOKEN_T", "WITH_ENTROPY", "WITH_B")
"""Flags a kernel launches both ways in the GPU command (where the kernel has them)."""


def _compile(
    launches: list[dict[str, Any]], tmp: Path, archs: tuple[int, ...] = ARCHS
) -> list[dict[str, Any]]:
    path = tmp / "launches.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")  # compile for real, not from a cache
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "tests.support.compile_launches",
        str(path),
        ",".join(map(str, archs)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def recorded() -> list[Any]:
    return record_all()


@pytest.fixture(scope="module")
def compiled(recorded: list[Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    launches = [dict(dataclasses.asdict(launch), count=n) for launch, n in unique(recorded)]
    return _compile(launches, tmp_path_factory.mktemp("compile"))


def _project_kernels() -> dict[str, Any]:
    """Every ``@triton.jit`` kernel defined in ``torch_impl`` (``module:qualname``)."""
    import torch_impl

    found = {}
    for info in pkgutil.walk_packages(torch_impl.__path__, "torch_impl."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            fn = obj
            while fn is not None and not hasattr(fn, "arg_names") and hasattr(fn, "fn"):
                fn = fn.fn  # autotune / heuristics wrappers
            inner = getattr(fn, "fn", None)
            if inner is not None and hasattr(fn, "arg_names") and inner.__module__ == info.name:
                found[f"{info.name}:{inner.__qualname__}"] = inner
    # a kernel reads tl.program_id, itself or through another kernel it calls (inlined
    # there: launched through the caller); the helpers it inlines do not
    source = {name: inspect.getsource(fn).split(":", 1)[1] for name, fn in found.items()}

    def calls(name: str, other: str) -> bool:
        return name != other and f"{found[other].__name__}(" in source[name]

    kernels = {name for name in found if "tl.program_id" in source[name]}
    kernels |= {name for name in found if any(calls(name, k) for k in kernels)}
    return {
        name: found[name] for name in kernels if not any(calls(other, name) for other in kernels)
    }


@pytest.mark.slow
def test_every_launched_specialisation_compiles_for_sm90_and_sm80(
    compiled: list[dict[str, Any]],
) -> None:
    errors = [r for r in compiled if "error" in r]
    assert not errors, errors[:3]
    assert {r["arch"] for r in compiled} == set(ARCHS)
    too_big = [r for r in compiled if not r["shared_ok"]]
    assert not too_big, too_big
    kernels = _project_kernels()
    for r in compiled:
        # a kernel that orders its stores behind tl.debug_barrier keeps the barrier compiled
        source = inspect.getsource(kernels[r["kernel"]]) if r["kernel"] in kernels else ""
        if "debug_barrier" in source and r["constexprs"].get("IN_PLACE", True):
            assert r["barrier"], r
        # compiled, bf16 is rounded by the hardware's conversion (the bit-level rounding
        # is the interpreter's path only)
        if r["bf16_stores"]:
            assert r["hardware_bf16"], r
    assert any(r["bf16_stores"] for r in compiled)


@pytest.mark.slow
def test_every_kernel_and_every_gpu_call_is_recorded(recorded: list[Any]) -> None:
    """Each kernel of the project is launched by the GPU command's calls; each of the
    benchmark's Triton methods and each GPU-test call launches something."""
    from benchmarks.gpu_logprobs import SIZES, methods_at
    from benchmarks.gpu_methods import METHODS

    launched = {launch.kernel for launch in recorded}
    assert set(_project_kernels()) <= launched, sorted(set(_project_kernels()) - launched)
    # each Triton method at each shape and dtype the benchmark runs it at: the logits'
    # distribution (flat, peaked) launches the same
    bench = {
        f"bench:{m}:{s['tokens']}x{s['hidden']}x{s['vocab']} {s['dtype']}"
        for s in SIZES
        for m in methods_at(s, list(METHODS))
        if METHODS[m].backend == "triton"
    }
    assert {s for s in SCENARIOS if s.startswith("bench:")} == bench
    silent = {s for s in SCENARIOS if s.startswith(("bench:", "gpu-test:"))} - {
        x.scenario for x in recorded
    }
    assert not silent, sorted(silent)
    # a host read would end a call on fake tensors (tests/processors/test_host_reads.py finds none)
    assert not STOPPED_BY_A_HOST_READ


@pytest.mark.slow
def test_the_launches_cover_what_runs(recorded: list[Any]) -> None:
    """What the earlier hand-written compile test missed is launched and so compiled: a
    scalar temperature (``PER_TOKEN_T=False``) and a per-token one, logprobs without the
    entropy (``WITH_ENTROPY=False``, ``WITH_B=False``), and the fused tiles' row offsets
    (an integer argument not divisible by 16 where another launch's is)."""
    by_kernel: dict[str, list[Any]] = {}
    for launch in recorded:
        by_kernel.setdefault(launch.kernel, []).append(launch)
    for kernel, launches in by_kernel.items():
        for flag in SEEN_BOTH_WAYS:
            values = {launch.constexprs.get(flag) for launch in launches} - {None}
            if values:
                assert values == {True, False}, (kernel, flag, values)
        patterns = {
            tuple(isinstance(a, dict) and "int" in a and a["int"] % 16 == 0 for a in launch.args)
            for launch in launches
        }
        assert len(patterns) >= 2, (kernel, patterns)
    # the benchmark's own size: the 8192-row vocabulary-sweep tile, and the row sweep's tiles
    import torch

    from torch_impl.processors._geometry import row_tile

    fused_rows = row_tile(8192, 151936, torch.device("cuda"), rows=None)
    rows = {
        a["int"]
        for x in recorded
        if x.scenario.startswith("bench:")
        for a in x.args
        if isinstance(a, dict) and "int" in a  # an absent optional tensor is None
    }
    assert fused_rows in rows and 8192 in rows, (fused_rows, sorted(rows))


# ----------------------------------------------------------- the recorder and the compiler can fail


@pytest.mark.slow
def test_a_launch_the_interpreter_runs_can_fail_to_compile(tmp_path: Path) -> None:
    import torch

    from tests.support.fake_cuda import record_launches

    a = torch.randn(8, 8)
    out = torch.empty(65)[1:]  # 4 bytes in: not 16-byte aligned
    with record_launches() as got:
        small_dot_kernel[(1,)](a, out, 8, BLOCK=8)
    assert torch.allclose(out.view(8, 8), a @ a, atol=1e-5)  # the interpreter ran it
    (launch,) = got
    assert launch.kernel == "tests.support.compile_launches:small_dot_kernel"
    assert launch.args[:2] == [
        {"tensor": "float32", "aligned16": True},
        {"tensor": "float32", "aligned16": False},
    ]
    assert launch.args[2] == {"int": 8}
    (row,) = _compile([dataclasses.asdict(launch)], tmp_path, archs=(90,))
    assert "error" in row and "16" in row["error"], row
