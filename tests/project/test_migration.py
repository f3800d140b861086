"""The replacements of docs/migration.md, one test per entry.

Each test runs the lines the entry documents, on a tiny GPT, and checks the values
(and gradients where the patch computes them) against the stock Megatron model's
materialised logits, or against Megatron's own MTP loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.packed_seq_params import PackedSeqParams

import hookspec
import torch_impl
from hookspec import OutputContext
from tests.support.mtp_support import LogitWatch
from tests.support.plan_driver import cpu_stand_ins, run_plan
from torch_impl import detached_head
from torch_impl.mtp import default_mtp_loss
from torch_impl.processors import cross_entropy_loss, selected_logprobs
from torch_impl.testing.tiny import (
    TinyGPTShape,
    build_tiny_gpt,
    cpu_layer_spec,
    tiny_batch,
    tiny_config,
)
from torch_impl.testing.tiny_moe import build_tiny_moe_gpt

pytestmark = pytest.mark.usefixtures("megatron_single")

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _reference(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> dict[str, Any]:
    """Selected-token logprobs and entropy from full logits ``[b, s, V]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return {
        "logprobs": logp.gather(-1, labels[..., None])[..., 0],
        "entropy": -(logp.exp() * logp).sum(-1),
    }


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        # Two fp32 paths (fused tiles and materialised logits) round differently: the
        # tolerance is relative to each gradient's own scale, so a small entry of a
        # bias gradient summed over tokens is held to the same relative error.
        atol = TOL["rtol"] * float(grad.abs().max())
        torch.testing.assert_close(
            got[name], grad, rtol=TOL["rtol"], atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_verl_model_forward_fused() -> None:
    """veRL ``model_forward_fused.py``: per-token logprobs and entropy at a
    temperature, from the hidden states, on every release; on the patch's own input
    convention (``fused_forward_model``: a right-padded batch packed into one THD row
    with next-token labels, the results unpacked to ``[b, s]``)."""
    batch = _padded_batch()
    args, kw = _packed_inputs(batch)
    temperature = 0.7
    model = build_tiny_gpt()

    # --- the documented replacement (on the packed row veRL builds)
    model = torch_impl.enable_output_processor(model)
    out = model(
        *args, **kw, output_processor=selected_logprobs(temperature=temperature, entropy=True)
    )
    log_probs, entropy = out["logprobs"], out["entropy"]
    # ---

    mask = batch["attention_mask"]
    per_sequence = _per_sequence_reference(build_tiny_gpt, batch, temperature)
    torch.testing.assert_close(_unpack(log_probs.detach(), mask), per_sequence["logprobs"], **TOL)
    torch.testing.assert_close(_unpack(entropy.detach(), mask), per_sequence["entropy"], **TOL)
    stock = build_tiny_gpt()  # the same packed row through the stock model's logits
    want = _reference(
        stock(*args, packed_seq_params=kw["packed_seq_params"]), kw["labels"], temperature
    )
    (log_probs.sum() + 0.5 * entropy.sum()).backward()
    (want["logprobs"].sum() + 0.5 * want["entropy"].sum()).backward()
    _assert_grads_close(_grads(model), _grads(stock))


def _mtp_gpt(**overrides: Any) -> Any:
    depths = 2
    config = tiny_config(TinyGPTShape(), mtp_num_layers=depths, **overrides)
    spec = get_gpt_mtp_block_spec(config, cpu_layer_spec(), use_transformer_engine=False)
    return build_tiny_gpt(mtp_block_spec=spec, mtp_num_layers=depths, **overrides).eval()


def test_verl_mtp_patch() -> None:
    """veRL ``mtp_patch.py``: the main head returns logprobs while the MTP layers
    train on Megatron's MTP loss through a detached output head.

    Independent computation: Megatron's stock model with its own MTP loss gives
    every gradient but the output layer's; the same model with
    ``mtp_loss_scaling_factor=0`` gives the output layer's gradient without the
    MTP part, which is what a detached head leaves."""
    batch = tiny_batch()
    input_ids, position_ids, attention_mask, labels = (
        batch["input_ids"],
        batch["position_ids"],
        batch["attention_mask"],
        batch["labels"],
    )
    loss_mask = torch.ones(labels.shape)
    cotangent = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    model = _mtp_gpt()

    # --- the documented replacement
    model = torch_impl.enable_output_processor(model)
    out = model(
        input_ids,
        position_ids,
        attention_mask,
        labels=labels,
        loss_mask=loss_mask,
        output_processor=selected_logprobs(entropy=True),  # main head: logprobs, entropy
        mtp_processor=detached_head(cross_entropy_loss()),  # MTP: trains the MTP layers only
    )
    # ---
    (out["logprobs"] * cotangent).sum().backward()

    stock, no_mtp_grad = _mtp_gpt(), _mtp_gpt(mtp_loss_scaling_factor=0.0)
    for reference in (stock, no_mtp_grad):
        nll = reference(input_ids, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        (-nll * cotangent).sum().backward()
    torch.testing.assert_close(out["logprobs"], -nll.detach(), **TOL)
    want = _grads(stock)
    want["output_layer.weight"] = no_mtp_grad.output_layer.weight.grad
    assert any(name.startswith("mtp.") for name in want)
    assert not torch.allclose(stock.output_layer.weight.grad, want["output_layer.weight"])
    _assert_grads_close(_grads(model), want)


# ---- veRL model_forward_1f1b_overlap.py, on the patch's own input convention ----
#
# The patch takes a right-padded batch ``input_ids [b, s]`` with ``attention_mask
# [b, s]`` and next-token ``labels [b, s]``, packs the valid tokens into one THD row
# (``preprocess_packed_seqs``) with ``packed_seq_params``, and unpacks the
# per-token results to ``[b, s]``.

LENGTHS = (8, 5)


def _padded_batch() -> dict[str, torch.Tensor]:
    """veRL's input: right-padded ids, the attention mask, next-token labels."""
    g = torch.Generator().manual_seed(5)
    b, s = len(LENGTHS), max(LENGTHS)
    tokens = torch.randint(0, 64, (b, s + 1), generator=g)
    mask = torch.arange(s)[None, :] < torch.tensor(LENGTHS)[:, None]
    return {
        "input_ids": tokens[:, :-1] * mask,
        "labels": tokens[:, 1:] * mask,
        "attention_mask": mask,
    }


def _pack(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The valid tokens of each row, concatenated: ``[1, T]``."""
    return x[mask][None]


def _unpack(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[1, T]`` back to ``[b, s]``, zero at padding."""
    out = torch.zeros(mask.shape, dtype=x.dtype)
    out[mask] = x[0]
    return out


def _packed_inputs(batch: dict[str, torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    mask = batch["attention_mask"]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(LENGTHS),
        max_seqlen_kv=max(LENGTHS),
    )
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return (_pack(batch["input_ids"], mask), positions, None), {
        "labels": _pack(batch["labels"], mask),
        "loss_mask": torch.ones(1, sum(LENGTHS)),
        "packed_seq_params": packed,
    }


def _per_sequence_reference(
    build: Any, batch: dict[str, torch.Tensor], temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """Independent: the stock model on each sequence alone, its materialised logits."""
    stock = build()
    out = {
        "logprobs": torch.zeros(batch["labels"].shape),
        "entropy": torch.zeros(batch["labels"].shape),
    }
    with torch.no_grad():
        for row, n in enumerate(LENGTHS):
            logits = stock(batch["input_ids"][row : row + 1, :n], torch.arange(n)[None], None)
            ref = _reference(logits, batch["labels"][row : row + 1, :n], temperature)
            for key in out:
                out[key][row, :n] = ref[key][0]
    return out


@pytest.fixture
def stand_ins() -> Iterator[None]:
    with cpu_stand_ins():
        yield


PLAN_MODELS = {
    # tied: the patch passes output_layer.weight, None here; the context resolves the tied weight
    "dense-last": lambda: build_tiny_gpt(
        share_embeddings_and_output_weights=True
    ),  # Megatron's plan: no norm
    "moe-last": lambda: build_tiny_moe_gpt([0, 1]),  # its MoE combine step applies it
}


@pytest.mark.usefixtures("stand_ins")
@pytest.mark.parametrize("name", list(PLAN_MODELS))
def test_verl_model_forward_1f1b_overlap(name: str) -> None:
    """veRL ``model_forward_1f1b_overlap.py``: logprobs and entropy through the whole
    combined-1F1B plan (run node by node on the CPU), on veRL's packed input.

    The adapted plan applies the decoder's final norm exactly once on both kinds of
    chunk: its mapping equals, bitwise, the enabled model's ``forward`` on the same
    packed input, and the per-sequence logprobs of the stock model. The patch's
    ``forward_impl`` normalises whenever there is no MTP, so on the MoE-last chunk,
    whose combine step already normalised, it normalises twice: that changes every
    logprob (checked here by normalising once more)."""
    build = PLAN_MODELS[name]
    batch = _padded_batch()
    args, kw = _packed_inputs(batch)
    received: list[dict[str, torch.Tensor]] = []

    def loss_func(output: dict[str, torch.Tensor]) -> Any:
        received.append(output)
        return -output["logprobs"].sum() - 0.01 * output["entropy"].sum()

    # --- the documented replacement (inside forward_step, when return_schedule_plan)
    model = torch_impl.enable_output_processor(build())
    proc = selected_logprobs(entropy=True)
    plan = torch_impl.build_schedule_plan(model, *args, **kw, output_processor=proc)
    # the schedule runs the plan and calls plan_loss_func(plan, loss_func) with its output
    run_plan(plan, torch_impl.plan_loss_func(plan, loss_func))
    # ---
    (output,) = received
    assert set(output) == {"logprobs", "entropy"}
    forward = torch_impl.enable_output_processor(build())(*args, **kw, output_processor=proc)
    for key in ("logprobs", "entropy"):
        assert torch.equal(output[key], forward[key]), key
    want = _per_sequence_reference(build, batch)
    mask = batch["attention_mask"]
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(_unpack(output[key].detach(), mask), want[key], **TOL)
    inner = torch_impl.unwrap_model(model)
    head = (
        inner.shared_embedding_or_output_weight()
        if inner.share_embeddings_and_output_weights
        else None
    )
    head = inner.output_layer.weight if head is None else head
    assert (
        head.grad is not None and head.grad.abs().sum() > 0
    )  # the plan's backward trained the head

    # what the patch does on a MoE-last chunk: the final norm once more
    norm = torch_impl.unwrap_model(model).decoder.final_layernorm

    @hookspec.processor
    def normalised_again(ctx: OutputContext) -> Any:
        return proc(ctx.replace(hidden_states=norm(ctx.hidden_states)))

    twice = torch_impl.enable_output_processor(build())(
        *args, **kw, output_processor=normalised_again
    )
    assert (twice["logprobs"] - forward["logprobs"]).abs().max() > 1e-3


@pytest.mark.usefixtures("stand_ins")
def test_verl_1f1b_overlap_mtp_rolls_within_each_packed_sequence() -> None:
    """With MTP layers the patch rolls the MTP labels without ``packed_seq_params``,
    although its input is always packed: the last label of each sequence would
    become the first token of the next. Megatron's plan refuses MTP with packed
    sequences before that (its MTP layer node asserts, 0.16.1 and 0.19.2), so the
    replacement for a packed MTP micro-batch is the enabled model's ``forward``,
    where Megatron's ``roll_tensor`` rolls each sequence on its own."""
    batch = _padded_batch()
    args, kw = _packed_inputs(batch)
    seen: list[torch.Tensor] = []

    @hookspec.processor
    def record(ctx: OutputContext) -> Any:
        seen.append(ctx.labels.clone())
        return default_mtp_loss(ctx)

    model = torch_impl.enable_output_processor(build_tiny_moe_gpt([0, 1], mtp_num_layers=1).eval())
    proc = selected_logprobs(entropy=True)
    plan = torch_impl.build_schedule_plan(
        model, *args, **kw, output_processor=proc, mtp_processor=record
    )
    with pytest.raises(AssertionError, match="sequence packing is not yet supported"):
        run_plan(plan, torch_impl.plan_loss_func(plan, lambda out: -out["logprobs"].sum()))
    seen.clear()
    out = model(*args, **kw, output_processor=proc, mtp_processor=record)
    (-out["logprobs"].sum()).backward()
    (labels,) = seen
    flat = kw["labels"][0]
    want = torch.zeros_like(flat)
    start = 0
    for n in LENGTHS:
        want[start : start + n - 1] = flat[start + 1 : start + n]
        start += n
    assert torch.equal(labels[0], want)
    across = torch.roll(flat, -1)  # the patch's roll: across the boundary after LENGTHS[0]
    assert int(labels[0, LENGTHS[0] - 1]) == 0 and int(across[LENGTHS[0] - 1]) == int(
        flat[LENGTHS[0]]
    )
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in model.named_parameters()
        if "mtp" in n
    )


def test_verl_fused_kernels_stay_on_with_mtp() -> None:
    """veRL turns its fused kernels off when MTP is on (its Megatron engine's
    ``_maybe_enable_fused_kernels``). Here the fused main head and the fused MTP
    loss run together: no tensor of more than one token chunk of logits (4 tokens)
    anywhere in forward or backward, the values those of the stock MTP model's
    logits and every gradient that of the stock model (Megatron's own MTP loss)."""
    batch = tiny_batch(seq=8, vocab_size=72)  # V = 72: no other activation is [.., 72]
    input_ids, position_ids, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    loss_mask = torch.ones(labels.shape)

    def build() -> Any:
        shape = TinyGPTShape(vocab_size=72)
        config = tiny_config(shape, mtp_num_layers=1)
        spec = get_gpt_mtp_block_spec(config, cpu_layer_spec(), use_transformer_engine=False)
        return build_tiny_gpt(shape, mtp_block_spec=spec, mtp_num_layers=1).eval()

    model = torch_impl.enable_output_processor(build())
    with LogitWatch(vocab=72, hidden=32) as watch:
        out = model(
            input_ids,
            position_ids,
            None,
            labels=labels,
            loss_mask=loss_mask,
            output_processor=selected_logprobs(entropy=True, tile_cols=16, tile_rows=4),
            mtp_processor=cross_entropy_loss(tile_cols=16, tile_rows=4),
        )
        (-out["logprobs"].sum()).backward()
    assert watch.rows <= 4
    stock = build()
    nll = stock(input_ids, position_ids, None, labels=labels, loss_mask=loss_mask)
    torch.testing.assert_close(out["logprobs"], -nll.detach(), **TOL)
    nll.sum().backward()
    _assert_grads_close(_grads(model), _grads(stock))


# ---- NeMo RL patch_gpt_model_forward_for_linear_ce_fusion, on its convention ----
#
# NeMo RL's callers pass the unshifted ``input_ids`` as ``labels``; the patch rolls
# them by -1 (``target.roll(shifts=-1, dims=-1)``) and drops the last position
# (``logprobs[:, :-1]``): ``[b, s - 1]``, position t the logprob of token t + 1.


def _nemo_rl_logprobs(
    model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    # --- the documented replacement
    labels = torch.roll(input_ids, shifts=-1, dims=-1)  # NeMo RL's labels are the input ids
    out = model(input_ids, position_ids, None, labels=labels, output_processor=selected_logprobs())
    return out["logprobs"][:, :-1]  # [b, s - 1], as the patch returns
    # ---


def _nemo_rl_reference(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """From the stock model's logits ``[b, s, V]``: position t scores token t + 1."""
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    return logp.gather(-1, input_ids[:, 1:, None])[..., 0]


def test_nemo_rl_linear_ce_fusion() -> None:
    """NeMo RL ``patch_gpt_model_forward_for_linear_ce_fusion`` on its own input
    convention (labels = the unshifted input ids), tied embeddings, without a
    class-level patch: another GPTModel in the process stays stock."""
    forward_before = GPTModel.forward
    batch = tiny_batch()
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    model = torch_impl.enable_output_processor(
        build_tiny_gpt(share_embeddings_and_output_weights=True)
    )
    logprobs = _nemo_rl_logprobs(model, input_ids, position_ids)
    stock = build_tiny_gpt(share_embeddings_and_output_weights=True)
    assert GPTModel.forward is forward_before and type(stock).forward is forward_before
    want = _nemo_rl_reference(stock(input_ids, position_ids, None), input_ids)
    assert tuple(logprobs.shape) == (2, 7)
    torch.testing.assert_close(logprobs, want, **TOL)
    logprobs.sum().backward()
    want.sum().backward()
    _assert_grads_close(_grads(model), _grads(stock))
    assert "embedding.word_embeddings.weight" in _grads(model)


def test_nemo_rl_hybrid_linear_ce_fusion() -> None:
    """NeMo RL patches ``HybridModel`` the same way
    (``patch_hybrid_model_forward_for_linear_ce_fusion``). The same replacement runs
    on an enabled HybridModel (``torch_impl.hybrid``), whose class stays stock."""
    pytest.importorskip(
        "megatron.core.models.hybrid",
        reason="HybridModel arrives with Megatron Core 0.19 (this one is older)",
    )
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from torch_impl.testing.tiny_hybrid import build_tiny_hybrid

    forward_before = HybridModel.forward
    batch = tiny_batch()
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    model = torch_impl.enable_output_processor(
        build_tiny_hybrid("*-*-", share_embeddings_and_output_weights=True)
    )
    logprobs = _nemo_rl_logprobs(model, input_ids, position_ids)
    stock = build_tiny_hybrid("*-*-", share_embeddings_and_output_weights=True)
    assert HybridModel.forward is forward_before and type(stock).forward is forward_before
    want = _nemo_rl_reference(stock(input_ids, position_ids, None), input_ids)
    torch.testing.assert_close(logprobs, want, **TOL)
    logprobs.sum().backward()
    want.sum().backward()
    _assert_grads_close(_grads(model), _grads(stock))
