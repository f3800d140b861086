"""Determinism (issue 12): on a CPU, the same inputs give bitwise the same
logprobs, entropy, losses and gradients, run to run, for every processor and
both paths of the policy loss; also in a fresh process.

fp32 inputs (the dtype where a reduction order shows), tiles that divide
nothing, ignored labels, a per-token temperature.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from hookspec import OutputContext, VocabShard
from torch_impl.processors import (
    PolicyBatch,
    PolicyLossConfig,
    cross_entropy_loss,
    policy_loss,
    selected_logprobs,
)

S, B, H, V = 23, 3, 16, 101
IGNORE = -100


def _inputs(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[1, ::5] = IGNORE
    return {
        "h": torch.randn(S, B, H, generator=g),
        "w": torch.randn(V, H, generator=g) * 0.5,
        "labels": labels,
        "batch": PolicyBatch(
            old_logprobs=-4.6 + 0.3 * torch.randn(B, S, generator=g),
            advantages=torch.randn(B, S, generator=g),
            mask=(torch.rand(B, S, generator=g) > 0.2).float(),
            ref_logprobs=-4.6 + 0.3 * torch.randn(B, S, generator=g),
            temperature=torch.rand(B, S, generator=g) + 0.5,
        ),
        "cotangent": torch.randn(B, S, generator=g),
    }


PROCESSORS: dict[str, Any] = {
    "selected_logprobs": lambda: selected_logprobs(entropy=True, tile_cols=17, tile_rows=11),
    "cross_entropy_loss": lambda: cross_entropy_loss(tile_cols=17, tile_rows=11),
    "policy_loss-fused": lambda: policy_loss(
        PolicyLossConfig.grpo(entropy_coef=0.01, dual_clip=3.0), tile_rows=7
    ),
    "policy_loss-autograd": lambda: policy_loss(
        PolicyLossConfig(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01, fused=False),
        tile_cols=17,
        tile_rows=11,
    ),
    "policy_loss-gspo": lambda: policy_loss(PolicyLossConfig.gspo(kl_coef=0.05), tile_cols=17),
}


def run_once(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every output and the gradients of the hidden states and the weight."""
    d = _inputs(seed)
    h = d["h"].clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    context: Any = d["batch"]
    if name == "cross_entropy_loss":
        context = dataclasses.replace(d["batch"], temperature=None)
    ctx = OutputContext(
        hidden_states=h,
        labels=d["labels"],
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        context=context,
    )
    out = PROCESSORS[name]()(ctx)
    if isinstance(out, dict) and "loss" in out:
        out["loss"].backward()
        results = dict(out)
    elif isinstance(out, dict):
        (out["logprobs"] * d["cotangent"] + out["entropy"]).sum().backward()
        results = dict(out)
    else:
        (out * d["cotangent"]).sum().backward()
        results = {"loss": out}
    results["dh"] = _grad(h.grad)
    results["dw"] = _grad(w.grad)
    return {k: v.detach() for k, v in results.items()}


def _grad(x: torch.Tensor | None) -> torch.Tensor:
    assert x is not None
    return x


def digest(results: dict[str, torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for key in sorted(results):
        sha.update(key.encode())
        sha.update(results[key].contiguous().numpy().tobytes())
    return sha.hexdigest()


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_same_inputs_give_bitwise_the_same_results_run_to_run(name: str) -> None:
    first = run_once(name)
    assert all(bool(torch.isfinite(v).all()) for v in first.values())
    assert float(first["dw"].abs().max()) > 0
    for _ in range(2):
        again = run_once(name)
        assert set(again) == set(first)
        for key in first:
            assert torch.equal(again[key], first[key]), key


def test_a_fresh_process_gives_bitwise_the_same_results() -> None:
    """Same threads, same inputs, another process: the same bytes."""
    root = Path(__file__).resolve().parents[2]
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(root)!r})
        import torch
        torch.set_num_threads({torch.get_num_threads()})
        from tests.contract.test_validation_determinism import PROCESSORS, digest, run_once
        for name in PROCESSORS:
            print(name, digest(run_once(name)))
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        timeout=600,
    )
    lines = [line for line in child.stdout.splitlines() if line.strip()]
    got = dict(line.split() for line in lines)
    want = {name: digest(run_once(name)) for name in PROCESSORS}
    assert got == want
