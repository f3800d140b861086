"""The processors under context parallel 2 (gloo, two processes) against float64 truth.

Each rank holds half of every sequence as Megatron splits it (``torch_impl.testing.cp``:
``2 cp`` chunks, rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r``), for a packed
(THD) row of sequences of awkward lengths padded to multiples of ``2 cp``, and for
plain rows split by Megatron's own ``get_batch_on_this_cp_rank``. The contexts are
built by ``torch_impl.build_output_context`` from a model whose process groups hold
Megatron's context-parallel group, as the hook builds them.

The truth is one process with the whole batch and its full float64 logits
(``tests.support.policy_truth.policy_truth``). Each rank's loss and metrics are its share:
their sum over the ranks is the whole batch's; each rank's hidden-state gradient is the
whole loss's gradient at its tokens; the weight gradients sum to the whole one.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from hookspec import (
    ContractError,
    OutputContext,
    ParallelLayout,
    SingleProcessCollectives,
    VocabShard,
)
from tests.support.distributed import run_distributed
from tests.support.identity_collectives import identity_collectives
from tests.support.policy_truth import policy_truth
from torch_impl.processors import PolicyBatch, PolicyLossConfig, policy_loss
from torch_impl.testing.cp import cp_chunk_index, padded_cu_seqlens, thd_partition_index

IGNORE = -100
CP = 2
H, V = 8, 40
LENGTHS = (5, 1, 11, 8, 3, 6)  # padded to multiples of 2 * CP: 8, 4, 12, 8, 4, 8
ROOT = Path(__file__).resolve().parents[2]

CONFIGS: dict[str, tuple[PolicyLossConfig, dict[str, float]]] = {
    "token-mean-fused": (PolicyLossConfig(kl_coef=0.1, entropy_coef=0.05, clip_low=0.1), {}),
    "token-mean-autograd": (
        PolicyLossConfig(kl_coef=0.1, entropy_coef=0.05, clip_low=0.1, fused=False),
        {},
    ),
    "token-mean-global-tokens": (PolicyLossConfig(clip_low=0.1), {"global_tokens": 53.0}),
    "seq-sum-dual-fused": (
        PolicyLossConfig.ppo(
            clip_low=0.1, clip_high=0.15, dual_clip=1.5, aggregation="seq-mean-token-sum"
        ),
        {},
    ),
    "seq-sum-autograd-global-sequences": (
        PolicyLossConfig(clip_low=0.1, aggregation="seq-mean-token-sum", fused=False),
        {"global_sequences": 9.0},
    ),
    "grpo-fused": (PolicyLossConfig.grpo(clip_low=0.1, entropy_coef=0.02), {}),
    "grpo-autograd": (PolicyLossConfig.grpo(clip_low=0.1, fused=False), {}),
    "gspo-seq-mean-token-mean": (PolicyLossConfig.gspo(clip_low=0.05, clip_high=0.08), {}),
    "gspo-token-mean-kl-entropy": (
        PolicyLossConfig.gspo(
            clip_low=0.05, clip_high=0.08, aggregation="token-mean", kl_coef=0.1, entropy_coef=0.05
        ),
        {},
    ),
    "gspo-seq-sum-global-sequences": (
        PolicyLossConfig.gspo(clip_low=0.05, clip_high=0.08, aggregation="seq-mean-token-sum"),
        {"global_sequences": 7.0},
    ),
}
"""Every aggregation, both ratio levels, both paths of the token ratio, and the
global counts (data parallel beyond the context-parallel group)."""


# ---------------------------------------------------------------- the problems


def _thd_problem(seed: int = 0) -> dict[str, Any]:
    """One packed row: sequences of ``LENGTHS``, each padded to a multiple of
    ``2 CP`` (padding: ignored labels, mask 0); an ignored label inside a
    sequence; a sequence with no counted token; a one-token sequence that only
    rank 0 holds."""
    g = torch.Generator().manual_seed(seed)
    cu, cu_padded = padded_cu_seqlens(LENGTHS, 2 * CP)
    t = int(cu_padded[-1])
    real = torch.zeros(t, dtype=torch.bool)
    for k, n in enumerate(LENGTHS):
        real[int(cu_padded[k]) : int(cu_padded[k]) + n] = True
    labels = torch.randint(0, V, (1, t), generator=g)
    labels[0, ~real] = IGNORE
    labels[0, int(cu_padded[2]) + 4] = IGNORE
    mask = (torch.rand(1, t, generator=g) > 0.2).double() * real
    mask[0, int(cu_padded[4]) : int(cu_padded[5])] = 0.0  # a sequence that counts nowhere
    mask[0, int(cu_padded[1])] = 1.0  # the one-token sequence counts
    return _with_batch(g, torch.randn(t, 1, H, generator=g, dtype=torch.float64), labels, mask) | {
        "cu": cu,
        "cu_padded": cu_padded,
        "sequences": [
            [(0, j) for j in range(int(a), int(z))] for a, z in itertools.pairwise(cu_padded)
        ],
    }


def _bshd_problem(seed: int = 1) -> dict[str, Any]:
    """Two rows of 12 tokens, each row one sequence, split by Megatron's own
    ``get_batch_on_this_cp_rank``."""
    g = torch.Generator().manual_seed(seed)
    b, s = 2, 12
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[1, 3] = IGNORE
    mask = (torch.rand(b, s, generator=g) > 0.25).double()
    mask[0, :6] = 0.0  # row 0 counts on rank 1's chunks only
    return _with_batch(g, torch.randn(s, b, H, generator=g, dtype=torch.float64), labels, mask) | {
        "sequences": None
    }


def _with_batch(
    g: torch.Generator, h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> dict[str, Any]:
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8
    z = torch.einsum("sbh,vh->bsv", h, w)
    lp = z.log_softmax(-1).gather(2, labels.clamp(min=0)[..., None]).squeeze(-1)
    shape = labels.shape
    batch = PolicyBatch(
        old_logprobs=lp + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64),
        advantages=torch.randn(shape, generator=g, dtype=torch.float64),
        mask=mask,
        ref_logprobs=lp + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64),
    )
    return {
        "h": h,
        "w": w,
        "labels": labels,
        "batch": batch,
        "temperature": torch.rand(shape, generator=g, dtype=torch.float64) + 0.5,
        "c_lp": torch.randn(shape, generator=g, dtype=torch.float64),
        "c_ent": torch.randn(shape, generator=g, dtype=torch.float64),
    }


def _logprob_truth(p: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tempered logprobs and entropy with a loss ``sum(c_lp * lp + c_ent * ent)``,
    and Megatron's untempered cross entropy with ``sum(c_lp * ce)``, whole batch."""
    out: dict[str, torch.Tensor] = {}
    for name, t in (("sel", p["temperature"][..., None]), ("ce", 1.0)):
        h = p["h"].clone().requires_grad_()
        w = p["w"].clone().requires_grad_()
        logp = (torch.einsum("sbh,vh->bsv", h, w) / t).log_softmax(-1)
        lp = torch.where(
            p["labels"] == IGNORE, 0.0, logp.gather(2, p["labels"].clamp(min=0)[..., None])[..., 0]
        )
        ent = -(logp.exp() * logp).sum(-1)
        loss = (
            (p["c_lp"] * lp + p["c_ent"] * ent).sum() if name == "sel" else (p["c_lp"] * -lp).sum()
        )
        loss.backward()
        out |= {
            f"{name}_lp": lp.detach(),
            f"{name}_ent": ent.detach(),
            f"{name}_dh": h.grad,
            f"{name}_dw": w.grad,
        }
    return out


def _truths(p: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    truths = {"logprobs": _logprob_truth(p)}
    for name, (cfg, counts) in CONFIGS.items():
        batch = dataclasses.replace(p["batch"], **counts)
        truths[name] = policy_truth(
            p["h"], p["w"], p["labels"], batch, cfg, sequences=p["sequences"]
        )
    return truths


# ---------------------------------------------------------------- on each rank


class _Model(torch.nn.Module):
    """What ``build_output_context`` reads off a model: its config and process groups."""

    def __init__(self, cp_group: Any, tp_group: Any = None) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(sequence_parallel=False)
        self.pg_collection = types.SimpleNamespace(tp=tp_group, cp=cp_group, pp=None)


def _split(p: dict[str, Any], rank: int, packed: bool) -> tuple[dict[str, Any], Any]:
    """This rank's part of ``p`` (``[b, s]`` fields along ``s``, hidden states
    along dim 0) and its token index ``[s/cp]`` (the same for every row)."""
    if packed:
        index = thd_partition_index(p["cu_padded"], CP, rank)
    else:
        index = cp_chunk_index(p["labels"].shape[1], CP, rank)

    def bs(x: Any) -> Any:
        return x[:, index] if isinstance(x, torch.Tensor) else x

    local = {k: bs(p[k]) for k in ("labels", "temperature", "c_lp", "c_ent")}
    local["h"] = p["h"][index]
    local["batch"] = PolicyBatch(
        **{f.name: bs(getattr(p["batch"], f.name)) for f in dataclasses.fields(PolicyBatch)}
    )
    return local, index


def _megatron_cp_split(tensors: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """``tensors`` (``[b, s, ...]``) through Megatron's own ``get_batch_on_this_cp_rank``
    (0.16: ``(batch, cp_group)``; 0.19: also ``is_hybrid_cp``; without
    ``cu_seqlens``: its per-sequence split)."""
    from megatron.core import utils as mcore_utils

    split = mcore_utils.get_batch_on_this_cp_rank
    kw: dict[str, Any] = {"cp_group": group}
    if "is_hybrid_cp" in inspect.signature(split).parameters:
        kw["is_hybrid_cp"] = False
    return dict(split({k: v.clone() for k, v in tensors.items()}, **kw))


def _megatron_split(p: dict[str, Any], group: Any) -> dict[str, Any]:
    """``p``'s ``[b, s]`` fields and hidden states split by Megatron."""
    batch = p["batch"]
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(PolicyBatch)}
    tensors = {f"batch.{k}": v for k, v in fields.items() if isinstance(v, torch.Tensor)}
    tensors |= {k: p[k] for k in ("labels", "temperature", "c_lp", "c_ent")}
    tensors["h"] = p["h"].transpose(0, 1)  # [b, s, h]: Megatron splits dim 1
    got = _megatron_cp_split(tensors, group)
    local = {k: got[k] for k in ("labels", "temperature", "c_lp", "c_ent")}
    local["h"] = got["h"].transpose(0, 1).contiguous()
    local["batch"] = PolicyBatch(
        **{**fields, **{k: got[f"batch.{k}"] for k in fields if f"batch.{k}" in got}}
    )
    return local


def _context(
    model: _Model, local: dict[str, Any], h: torch.Tensor, w: torch.Tensor, context: Any, psp: Any
) -> OutputContext:
    from torch_impl import build_output_context

    return build_output_context(
        model,
        {
            "hidden_states": h,
            "labels": local["labels"],
            "output_weight": w,
            "packed_seq_params": psp,
            "context": context,
        },
    )


def _sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    y = x.detach().clone()
    torch.distributed.all_reduce(y, group=group)
    return y


TOL = {"rtol": 1e-10, "atol": 1e-12}


def _check_case(
    rank: int, model: _Model, local: dict[str, Any], index: torch.Tensor, p: dict[str, Any],
    truths: dict[str, dict[str, torch.Tensor]], psp: Any, group: Any, shard: slice = slice(None),
    configs: tuple[str, ...] = tuple(CONFIGS),
) -> None:  # fmt: skip
    """``rank``: this rank's place in the CP ``group``; ``shard``: its rows of the
    output weight (tensor parallel: the weight gradient's rows of the truth)."""
    from torch_impl.processors import cross_entropy_loss, selected_logprobs

    # the per-token processors: this rank's tokens of the whole batch's values
    t = truths["logprobs"]
    h = local["h"].clone().requires_grad_()
    w = p["w"][shard].clone().requires_grad_()
    ctx = _context(model, local, h, w, {"temperature": local["temperature"]}, psp)
    assert ctx.parallel.cp_size == CP and ctx.parallel.cp_rank == rank, ctx.parallel
    out = selected_logprobs(entropy=True, tile_cols=7, tile_rows=5)(ctx)
    (local["c_lp"] * out["logprobs"] + local["c_ent"] * out["entropy"]).sum().backward()
    torch.testing.assert_close(out["logprobs"], t["sel_lp"][:, index], **TOL)
    torch.testing.assert_close(out["entropy"], t["sel_ent"][:, index], **TOL)
    torch.testing.assert_close(h.grad, t["sel_dh"][index], **TOL)
    torch.testing.assert_close(_sum(w.grad, group), t["sel_dw"][shard], **TOL)

    h = local["h"].clone().requires_grad_()
    w = p["w"][shard].clone().requires_grad_()
    ce = cross_entropy_loss(tile_cols=7)(_context(model, local, h, w, None, psp))
    (local["c_lp"] * ce).sum().backward()
    torch.testing.assert_close(ce, -t["ce_lp"][:, index], **TOL)
    torch.testing.assert_close(h.grad, t["ce_dh"][index], **TOL)
    torch.testing.assert_close(_sum(w.grad, group), t["ce_dw"][shard], **TOL)

    # the policy loss: shares that sum to the whole loss, gradients of the whole loss
    for name in configs:
        cfg, counts = CONFIGS[name]
        truth = truths[name]
        h = local["h"].clone().requires_grad_()
        w = p["w"][shard].clone().requires_grad_()
        batch = dataclasses.replace(local["batch"], **counts)
        fn = policy_loss(cfg, tile_cols=7, tile_rows=3)
        out = fn(_context(model, local, h, w, batch, psp))
        out["loss"].backward()
        msg = f"{name} (rank {rank})"
        torch.testing.assert_close(_sum(out["loss"], group), truth["loss"], **TOL, msg=msg)
        torch.testing.assert_close(h.grad, truth["dh"][index], **TOL, msg=msg)
        torch.testing.assert_close(_sum(w.grad, group), truth["dw"][shard], **TOL, msg=msg)
        for metric in (
            "pg_loss",
            "entropy",
            "clip_fraction",
            "approx_kl",
            "kl",
            "dual_clip_fraction",
        ):
            if metric in truth:
                got = _sum(out[metric], group)
                torch.testing.assert_close(got, truth[metric], **TOL, msg=f"{metric} {msg}")


def _cp2(
    rank: int, thd: dict[str, Any], thd_truths: dict, bshd: dict[str, Any], bshd_truths: dict
) -> None:
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from torch_impl import TorchCollectives

    group = parallel_state.get_context_parallel_group()
    assert torch.distributed.get_world_size(group) == CP

    # test support pinned: Megatron's split of one sequence is ours, for every length
    for n in (4, 8, 12, 16):
        tokens = _megatron_cp_split({"tokens": torch.arange(n)[None]}, group)["tokens"]
        assert torch.equal(tokens[0], cp_chunk_index(n, CP, rank)), n

    # packed: the micro-batch keeps the global cu_seqlens, as Megatron's THD split does
    model = _Model(group)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=thd["cu"],
        cu_seqlens_kv=thd["cu"],
        cu_seqlens_q_padded=thd["cu_padded"],
        cu_seqlens_kv_padded=thd["cu_padded"],
    )
    local, index = _split(thd, rank, packed=True)
    _check_case(rank, model, local, index, thd, thd_truths, psp, group)

    # not packed: rows split by Megatron's get_batch_on_this_cp_rank
    local = _megatron_split(bshd, group)
    index = cp_chunk_index(bshd["labels"].shape[1], CP, rank)
    assert torch.equal(local["labels"], bshd["labels"][:, index])
    _check_case(rank, model, local, index, bshd, bshd_truths, None, group)

    # the micro-batch's own group (packed_seq_params.cp_group) where it carries one: a
    # model without context parallel, a micro-batch over two ranks
    other = torch.distributed.new_group([0, 1])
    psp_group = dataclasses.replace(psp, cp_group=other)
    local, index = _split(thd, rank, packed=True)
    ctx = _context(_Model(None), local, local["h"], thd["w"], local["batch"], psp_group)
    assert ctx.parallel.cp_size == CP and ctx.parallel.cp_rank == rank
    assert isinstance(ctx.collectives, TorchCollectives) and ctx.collectives.cp_group is other
    cfg, _counts = CONFIGS["gspo-seq-mean-token-mean"]
    out = policy_loss(cfg)(ctx)
    torch.testing.assert_close(
        _sum(out["loss"], group), thd_truths["gspo-seq-mean-token-mean"]["loss"], **TOL
    )

    # why the collective's backward sums over the group: with the identity backward of
    # the tensor-parallel all_reduce_sum, GSPO's loss is right and its gradient is not
    truth = thd_truths["gspo-seq-mean-token-mean"]
    h = local["h"].clone().requires_grad_()
    ctx = _context(model, local, h, thd["w"], local["batch"], psp)
    out = policy_loss(cfg)(ctx.replace(collectives=_IdentityBackwardCpSum(ctx.collectives)))
    out["loss"].backward()
    torch.testing.assert_close(_sum(out["loss"], group), truth["loss"], **TOL)
    wrong = _sum((h.grad - truth["dh"][index]).abs().max(), group)
    assert float(wrong) > 1e-3, float(wrong)


class _IdentityBackwardCpSum:
    """``inner``'s collectives, but a context-parallel sum whose backward is the
    identity (Megatron's ``reduce_from_tensor_model_parallel_region`` over the CP group)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def all_reduce_sum(self, x: torch.Tensor, /) -> torch.Tensor:
        return self.inner.all_reduce_sum(x)

    def all_reduce_max(self, x: torch.Tensor, /) -> torch.Tensor:
        return self.inner.all_reduce_max(x)

    def gather_hidden_states(self, x: torch.Tensor, /) -> torch.Tensor:
        return self.inner.gather_hidden_states(x)

    def all_reduce_sum_context_parallel(self, x: torch.Tensor, /) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x.clone(), group=self.inner.cp_group)


@pytest.mark.slow
def test_cp2_thd_and_rows_against_float64() -> None:
    """cp=2 over gloo, one pair of processes for: Megatron's per-sequence split
    pinned to ours; a packed THD row and plain rows, each through every built-in
    processor and every aggregation and ratio level, values and gradients against
    the unsplit float64 computation; the micro-batch's own CP group; an identity
    backward of the CP sum gives GSPO a wrong gradient."""
    thd, bshd = _thd_problem(), _bshd_problem()
    run_distributed(_cp2, thd, _truths(thd), bshd, _truths(bshd), cp=CP)


def _tp2_cp2(rank: int, thd: dict[str, Any], thd_truths: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    tp_rank = torch.distributed.get_rank(tp_group)
    cp_rank = torch.distributed.get_rank(cp_group)
    half = V // 2
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=thd["cu"],
        cu_seqlens_kv=thd["cu"],
        cu_seqlens_q_padded=thd["cu_padded"],
        cu_seqlens_kv_padded=thd["cu_padded"],
    )
    local, index = _split(thd, cp_rank, packed=True)
    configs = (
        "token-mean-fused",
        "grpo-autograd",
        "gspo-seq-mean-token-mean",
        "gspo-token-mean-kl-entropy",
    )
    _check_case(
        cp_rank, _Model(cp_group, tp_group), local, index, thd, thd_truths, psp, cp_group,
        shard=slice(tp_rank * half, (tp_rank + 1) * half), configs=configs,
    )  # fmt: skip


@pytest.mark.slow
# the processors' maths; Megatron's CP split is pinned by the cp=2 test
@pytest.mark.release_independent
def test_tp2_cp2_thd_against_float64() -> None:
    """tp=2 x cp=2 over four gloo processes: the vocabulary split over tensor
    parallel (its sums and the hidden-state gradient over the TP group) and the
    sequences over context parallel (the per-sequence sums over the CP group), a
    packed row through every built-in processor, GSPO and the sequence means."""
    thd = _thd_problem()
    run_distributed(_tp2_cp2, thd, _truths(thd), tp=2, cp=CP)


# ---------------------------------------------------------------- one process: what is refused


def _one_rank_cp2(
    p: dict[str, Any], batch: PolicyBatch, collectives: Any, psp: Any = None
) -> OutputContext:
    local, _ = _split(p, 0, packed=True)
    return OutputContext(
        hidden_states=local["h"],
        labels=local["labels"],
        vocab_weight=p["w"],
        vocab=VocabShard(0, V, V),
        context=batch,
        packed_seq_params=psp,
        parallel=ParallelLayout(cp_size=CP, cp_rank=0),
        collectives=collectives,
    )


# A user's collectives written before spec 1.2: no context-parallel sum.
_CollectivesOfSpec11 = identity_collectives(
    "_CollectivesOfSpec11",
    all_reduce_max=lambda self, x: x.detach(),
    __repr__=lambda self: "_CollectivesOfSpec11()",
)


@pytest.mark.parametrize(
    "collectives", [_CollectivesOfSpec11(), SingleProcessCollectives()], ids=repr
)
def test_collectives_without_the_cp_sum_are_refused_only_where_it_is_needed(
    collectives: Any,
) -> None:
    """Under cp > 1 a collectives object without the context-parallel sum (spec
    1.1), or the one-rank collectives, still runs a token ratio with the global
    count it needs; GSPO, seq-mean-token-mean and a missing count raise, naming
    the method."""
    from megatron.core.packed_seq_params import PackedSeqParams

    import hookspec

    assert isinstance(collectives, hookspec.Collectives)  # 1.1 objects still are
    p = _thd_problem()
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=p["cu_padded"], cu_seqlens_kv=p["cu_padded"]
    )
    local, _ = _split(p, 0, packed=True)
    ok = dataclasses.replace(local["batch"], global_tokens=40.0)
    out = policy_loss(PolicyLossConfig())(_one_rank_cp2(p, ok, collectives, psp))
    assert bool(torch.isfinite(out["loss"]))
    cases = [
        (PolicyLossConfig.gspo(), local["batch"], "GSPO's sequence ratio"),
        (PolicyLossConfig.grpo(), local["batch"], "seq-mean-token-mean"),
        (PolicyLossConfig(), local["batch"], "token-mean without context.global_tokens"),
    ]
    for cfg, batch, what in cases:
        with pytest.raises(
            ContractError, match=r"^collectives: expected all_reduce_sum_context_parallel"
        ) as err:
            policy_loss(cfg)(_one_rank_cp2(p, batch, collectives, psp))
        assert what in str(err.value) and "parallel.cp_size=2" in str(err.value)


def test_cu_seqlens_not_a_multiple_of_2cp_is_refused() -> None:
    """Megatron cuts each sequence into 2 cp chunks: a boundary that is not a
    multiple of 2 cp has no split, and is refused by value, naming the field."""
    from megatron.core.packed_seq_params import PackedSeqParams

    p = _thd_problem()
    local, _ = _split(p, 0, packed=True)
    batch = dataclasses.replace(local["batch"], global_tokens=40.0)
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        psp = PackedSeqParams(qkv_format="thd", **{name: p["cu"]})  # the unpadded boundaries
        with pytest.raises(
            ContractError,
            match=rf"^packed_seq_params\.{name}: expected multiples of 4 \(2 \* cp_size",
        ):
            policy_loss(PolicyLossConfig())(
                _one_rank_cp2(p, batch, SingleProcessCollectives(), psp)
            )


def test_collectives_of_another_cp_size_are_refused() -> None:
    class _FourRanks(_CollectivesOfSpec11):
        cp_size = 4

        def all_reduce_sum_context_parallel(self, x: torch.Tensor, /) -> torch.Tensor:
            return x

    p = _thd_problem()
    local, _ = _split(p, 0, packed=True)
    with pytest.raises(
        ContractError,
        match=r"^collectives: expected a context-parallel group of parallel\.cp_size=2 ranks "
        r"\(or none\), got .* over 4 context-parallel ranks",
    ):
        policy_loss(PolicyLossConfig.gspo())(_one_rank_cp2(p, local["batch"], _FourRanks()))


# --------------------------------------------------------------- JAX: the same collective, lax.psum


def _jax_cp_sum_body() -> None:
    """On a 2-device mesh axis ``cp``: the sum is ``psum``, and the gradient of a loss
    whose shares each use it is the sum of what every share asks of it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from jax_ref import JaxCollectives, float64
    from jax_ref.sharded import shard_map

    with float64():
        mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
        coll = JaxCollectives("tp", cp_axis_name="cp")
        assert JaxCollectives().all_reduce_sum_context_parallel(3.0) == 3.0  # no cp axis: identity

        def shares(x: jax.Array, c: jax.Array) -> jax.Array:
            total = coll.all_reduce_sum_context_parallel(x)  # [2] whole sums
            return jax.lax.psum(jnp.sum(c * jnp.exp(total)), "cp")  # the shares summed

        f = shard_map(
            shares,
            mesh=mesh,
            in_specs=(PartitionSpec("cp"), PartitionSpec("cp")),
            out_specs=PartitionSpec(),
        )
        x = jnp.array([0.1, -0.2, 0.3, 0.4])  # rank r holds x[2r:2r+2]
        c = jnp.array([1.0, 2.0, -1.0, 0.5])
        got, grad = jax.value_and_grad(f)(x, c)
        s = x[:2] + x[2:]
        want = jnp.sum((c[:2] + c[2:]) * jnp.exp(s))
        want_grad = jnp.tile((c[:2] + c[2:]) * jnp.exp(s), 2)  # every share's ask, on both ranks
        np.testing.assert_allclose(got, want, rtol=1e-14)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-14)


def test_jax_collectives_cp_sum_is_psum_with_summed_gradient() -> None:
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONWARNINGS="ignore"
    )
    code = "import tests.processors.test_policy_cp as t; t._jax_cp_sum_body()"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
