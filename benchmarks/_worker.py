"""One measurement in a fresh process: ``python -m benchmarks._worker '<json>'``.

Builds the inputs, resets the process's peak resident set (``/proc/self/clear_refs``),
runs one forward + backward of the method, and prints one JSON line: wall time,
peak extra memory (peak RSS minus RSS before the run; CUDA: peak allocated minus
allocated before) and a checksum of the results.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def inputs(spec: dict[str, Any]) -> dict[str, Any]:
    n, hid, vocab = spec["tokens"], spec["hidden"], spec["vocab"]
    dtype, device = DTYPES[spec["dtype"]], spec.get("device", "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hid, generator=g, device=device, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hid, generator=g, device=device, dtype=dtype)
    w = (w * hid**-0.5).detach().requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g, device=device)
    c_lp = torch.randn(n, generator=g, device=device)
    c_ent = torch.randn(n, generator=g, device=device)
    batch = {
        "old": -torch.rand(n, generator=g, device=device) * 12.0,
        "adv": torch.randn(n, generator=g, device=device),
        "mask": (torch.rand(n, generator=g, device=device) > 0.1).float(),
    }
    return {"h": h, "w": w, "y": y, "c_lp": c_lp, "c_ent": c_ent, "batch": batch}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.methods import LOGPROB_METHODS, POLICY_METHODS

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    device = spec.get("device", "cpu")
    x = inputs(spec)
    method = spec["method"]
    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        exact = _reset_peak()
        base = status_kib("VmRSS") * 1024
        if not exact:
            base = max(base, status_kib("VmHWM") * 1024)
    t0 = time.perf_counter()
    if method in POLICY_METHODS:
        loss = POLICY_METHODS[method](x["h"], x["w"], x["y"], x["batch"])
        loss.backward()
        check = float(loss.detach())
    elif method.startswith("floor"):
        LOGPROB_METHODS[method](x["h"], x["w"], x["y"])
        check = 0.0
    else:
        lp, ent = LOGPROB_METHODS[method](x["h"], x["w"], x["y"])
        loss = (lp.float() * x["c_lp"]).sum()
        if ent is not None:
            loss = loss + (ent.float() * x["c_ent"]).sum()
        loss.backward()
        check = float(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = status_kib("VmHWM") * 1024 - base
    return {
        "time_s": elapsed,
        "peak_extra_mib": peak / 2**20,
        "check": check,
        "grad_norm_h": float(x["h"].grad.float().norm()) if x["h"].grad is not None else None,
    }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
