"""The Triton kernels compile for the GPUs users train on, without a GPU.

The interpreter checks less than the compiler (block shapes, dtypes of ``tl.dot``
operands, loop-carried types). Here every kernel specialisation that ``backend="auto"``
launches on CUDA (bf16, fp16, fp32, with the per-token temperature and the entropy: the
other variants drop code from these) is compiled ahead of time through Triton's NVIDIA
backend and ``ptxas`` (both ship in the triton wheel) for Hopper (sm_90; bf16 also for
Ampere, sm_80), and its shared memory is checked against the smaller of those parts'
per-block limits. About 6 s a kernel on a 2-core CPU.
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
    import itertools, json, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from torch_impl.processors import _setup as _plan, _triton_kernels as tk

    SHARED_LIMIT = 166912  # bytes a block may use on an A100 (sm_80); an H100 allows 232448
    PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}

    def signature(fn, types, consts):
        return {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}

    out = []
    cases = [(90, dtype) for dtype in PTR] + [(80, torch.bfloat16)]
    for (arch, dtype), per_token, flag in itertools.product(cases, (True,), (True,)):
        cfg = _plan._kernel_config(torch.device("cuda"), dtype)
        common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PER_TOKEN_T=per_token,
                      DOT_FP32=False, PRECISION="tf32" if cfg.tf32 else "ieee")
        ptr = PTR[dtype]
        fwd = dict(h_ptr=ptr, w_ptr=ptr, lab_ptr="*i64", inv_t_ptr="*fp32", m_ptr="*fp32", s_ptr="*fp32",
                   t_ptr="*fp32", zy_ptr="*fp32", inv_t_scalar="fp32")
        bwd = dict(h_ptr=ptr, w_ptr=ptr, lab_ptr="*i64", inv_t_ptr="*fp32", max_ptr="*fp32", a_ptr="*fp32",
                   b_ptr="*fp32", g_ptr="*fp32", gz_ptr=ptr, inv_t_scalar="fp32")
        for fn, types, consts in ((tk._shard_stats_kernel, fwd, dict(common, WITH_ENTROPY=flag)),
                                  (tk._logit_grads_kernel, bwd, dict(common, WITH_B=flag))):
            src = ASTSource(fn=fn, signature=signature(fn, types, consts), constexprs=consts)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                               options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            out.append(dict(kernel=fn.__name__, arch=arch, dtype=str(dtype), flag=flag, per_token=per_token,
                            shared=k.metadata.shared, ok=k.metadata.shared <= SHARED_LIMIT))
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90_and_sm80(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    cmd = [sys.executable, "-c", SCRIPT]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 4 * 2
    too_big = [r for r in rows if not r["ok"]]
    assert not too_big, too_big
