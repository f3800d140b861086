"""The default MTP processor's vocab-parallel part under tensor parallelism 2.

A whole MTP model cannot run tp=2 on a CPU: the MTP layer's projection gathers
its output into a CUDA buffer. The top-1 acceptance that feeds Megatron's
logging runs here on two vocab shards of known logits, against a
single-process argmax (the loss itself is Megatron's vocab-parallel cross
entropy, called as it is).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.support.distributed import rank_context, run_distributed

V, H = 64, 8


def _shard_ctx(rank: int, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Any:
    from megatron.core import parallel_state

    import hookspec
    from hookspec import OutputContext
    from torch_impl.collectives import TorchCollectives

    group = parallel_state.get_tensor_model_parallel_group()
    rows = slice(32 * rank, 32 * (rank + 1))
    return OutputContext(
        hidden_states=hidden,
        labels=labels,
        vocab_weight=weight[rows],
        parallel=hookspec.ParallelLayout(tp_size=2, tp_rank=rank),
        vocab=hookspec.VocabShard(rows.start, rows.stop, V),
        collectives=TorchCollectives(group, sequence_parallel=False),
    )


def _tp2_rank(rank: int, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    from torch_impl.mtp import _top1_accepted

    rows = slice(32 * rank, 32 * (rank + 1))
    # top-1 acceptance over the two shards, with a tie across them: the first index wins
    z = torch.einsum("sbh,vh->sbv", hidden, weight)
    z[0, 0, 5] = z[0, 0, 40] = 100.0
    chosen = labels.clone()
    chosen[0, 0] = 5
    chosen[1, 1] = 40
    want_accepted = z.argmax(-1).transpose(0, 1) == chosen
    accepted = _top1_accepted(_shard_ctx(rank, hidden, weight, chosen), z[..., rows])
    assert torch.equal(accepted, want_accepted)
    assert bool(accepted[0, 0]) and not bool(accepted[1, 1])
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    if hasattr(mtp, "_vocab_parallel_argmax"):  # 0.19: Megatron's own rule for its acceptance count
        group = parallel_state.get_tensor_model_parallel_group()
        preds = mtp._vocab_parallel_argmax(z[..., rows].contiguous(), group, 2)
        assert torch.equal(accepted, preds.transpose(0, 1) == chosen)


def test_top1_acceptance_under_tp2() -> None:
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, 2, H, generator=g)  # [s, b, h]
    weight = torch.randn(V, H, generator=g) * 2.0
    labels = torch.randint(0, V, (2, 5), generator=g)
    run_distributed(_tp2_rank, hidden, weight, labels, tp=2)


# ---- MTPOptions(cp_group_from_packed=True): the micro-batch's CP group ---------

SEQS = [(0, 8), (8, 20)]  # two packed sequences, each split into 2 * cp = 4 chunks


def _cp_share(x: torch.Tensor, rank: int) -> torch.Tensor:
    """This CP rank's tokens under Megatron's load-balanced split: chunks ``rank``
    and ``2 * cp - 1 - rank`` of each sequence."""
    parts = []
    for start, end in SEQS:
        c = (end - start) // 4
        parts += [
            x[start + rank * c : start + (rank + 1) * c],
            x[start + (3 - rank) * c : start + (4 - rank) * c],
        ]
    return torch.cat(parts)


def _roll_each_sequence(x: torch.Tensor) -> torch.Tensor:
    """The whole packed row rolled by -1 within each sequence, its last position 0."""
    out = torch.zeros_like(x)
    for start, end in SEQS:
        out[start : end - 1] = x[start + 1 : end]
    return out


def _cp_rank(rank: int, from_packed: bool) -> None:
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    import hookspec
    from tests.support.mtp_support import build_mtp_gpt
    from torch_impl import enable_output_processor
    from torch_impl.mtp import MTPOptions, default_mtp_loss

    cp_group = dist.new_group(
        [0, 1], backend="gloo"
    )  # the micro-batch's; the model's CP group is of one
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (20,), generator=g)
    labels = torch.randint(0, 64, (20,), generator=g)
    mask = torch.ones(20)
    mask[[2, 9, 15]] = 0.0
    positions = torch.cat([torch.arange(e - s) for s, e in SEQS])
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=12,
        max_seqlen_kv=12,
        cp_group=cp_group,
    )
    seen: list[Any] = []

    @hookspec.processor
    def record(ctx: Any) -> Any:
        seen.append((ctx.labels.clone(), ctx.loss_mask.clone()))
        return default_mtp_loss(ctx)

    model = enable_output_processor(
        build_mtp_gpt(1), mtp=MTPOptions(cp_group_from_packed=from_packed)
    ).eval()
    embedded: list[torch.Tensor] = []
    model.embedding.register_forward_hook(
        lambda m, args, kwargs, out: embedded.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    model(
        _cp_share(ids, rank)[None],
        _cp_share(positions, rank)[None],
        None,
        labels=_cp_share(labels, rank)[None],
        loss_mask=_cp_share(mask, rank)[None],
        packed_seq_params=packed,
        mtp_processor=record,
    )
    ((got_labels, got_mask),) = seen
    want_labels = _cp_share(_roll_each_sequence(labels), rank)[None]
    want_mask = _cp_share(_roll_each_sequence(mask), rank)[None]
    want_ids = _cp_share(_roll_each_sequence(ids), rank)[None]
    mtp_ids = embedded[1]  # [0]: the main embedding; [1]: the MTP layer's, of its rolled ids
    if from_packed:
        assert torch.equal(got_labels, want_labels)
        assert torch.equal(got_mask, want_mask)
        assert torch.equal(mtp_ids, want_ids)
    else:  # upstream: the model's CP group (of one) rolls each rank's share on its own
        assert not torch.equal(got_labels, want_labels)
        assert not torch.equal(mtp_ids, want_ids)


def _two_ranks_tp1(rank: int, port: int, errors: Any) -> None:
    """Two processes, tp = pp = 1 (so Megatron's own CP group is of one rank)."""
    import traceback

    from torch_impl.process_state import rank_store
    from torch_impl.testing.tiny import megatron_parallel

    try:
        with megatron_parallel(rank=rank, world_size=2, store=rank_store(port, 2)):
            for from_packed in (True, False):
                _cp_rank(rank, from_packed)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def test_mtp_rolls_over_the_micro_batch_cp_group() -> None:
    """cp=2, packed sequences split as Megatron splits them: with
    ``cp_group_from_packed`` the MTP labels, loss mask and the MTP layer's input
    ids are those of the whole sequences rolled, then split; by default (upstream)
    the model's CP group is used, here of one rank, and they are not."""
    import torch.multiprocessing as mp

    from torch_impl.process_state import launcher_store

    errors = rank_context().SimpleQueue()
    store = launcher_store(2)
    try:
        mp.start_processes(
            _two_ranks_tp1, args=(store.port, errors), nprocs=2, start_method="forkserver"
        )
    except mp.ProcessRaisedException as exc:
        reports = []
        while not errors.empty():
            rank, tb = errors.get()
            reports.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(reports) or str(exc)) from None
