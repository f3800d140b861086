"""The hook under Megatron's own schedules, on the CPU, over several micro-batches.

``get_forward_backward_func()`` picks the schedule: no pipelining (one process),
1F1B (pp=2, two gloo processes) and interleaved (pp=2 with two model chunks per
rank, virtual pp=2). Each runs under ``torch_impl.testing.schedules.cpu_schedule``
(torch-level shims only; no Megatron symbol is touched) and is checked against one
process without pipelines, the micro-batches run one after the other and each
loss scaled the way the schedule scales it (``loss * cp / num_microbatches``):

- the stock output layer plus Megatron's loss (``cases.stock_loss`` through the
  hook) against the stock model without the hook: every micro-batch's loss and
  every parameter's gradient bitwise (``torch.equal``), float32;
- the GRPO ``policy_loss`` processor, model in float64, against the GRPO loss
  written here from the stock model's materialised float64 logits: losses and
  every gradient to ``rtol=1e-10``.

With tied embeddings under 1F1B, each stage in Megatron's DDP and
``finalize_model_grads`` run by the schedule, both copies of the tied weight end with
its whole gradient (float64).

On the last stage the model returns the processor's mapping, which Megatron hands
to the ``loss_func`` unchanged (checked); other stages return the hidden states.
The recipe of ``docs/examples/schedule_recipe.py`` runs here too, and
``docs/schedules.md`` quotes it verbatim.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_impl
from tests.support import hook_cases as cases
from tests.support.distributed import run_distributed
from torch_impl.processors import PolicyBatch, PolicyLossConfig, policy_loss
from torch_impl.testing.schedules import (
    INTERLEAVED_GLOO,
    CPUDeviceMode,
    cpu_schedule,
    is_cuda_device,
)
from torch_impl.testing.tiny import TinyGPTShape, build_tiny_gpt, megatron_parallel, tiny_batch

ROOT = Path(__file__).resolve().parents[2]
NUM_MICROBATCHES = 4
CLIP = 0.2  # PolicyLossConfig.grpo's default clip range, both sides
KL_COEF = 0.1
TEMPERATURE = 0.8
NO_GPU = not torch.cuda.is_available()
NO_CUDA_ERROR: tuple[type[Exception], str] = (
    (AssertionError, "Torch not compiled with CUDA enabled")
    if torch.version.cuda is None
    else (RuntimeError, "Found no NVIDIA driver")
)
"""What a CUDA request raises on a CPU machine: a CPU build of torch asserts, a CUDA
build finds no driver."""


# ---- the shim ----------------------------------------------------------------------------


def test_cpu_device_mode_maps_cuda_requests_to_the_cpu() -> None:
    t = torch.ones(2)
    with CPUDeviceMode():
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.empty(3, device="cuda:0").device.type == "cpu"
        assert torch.empty(3, device=torch.device("cuda")).device.type == "cpu"
        assert torch.full((2,), 1.0, device=0).device.type == "cpu"
        assert t.cuda() is t
        moved = t.to("cuda", torch.float64)
        assert moved.device.type == "cpu" and moved.dtype == torch.float64
        assert t.new_zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1, device="cpu").device.type == "cpu"
    assert [is_cuda_device(d) for d in ("cuda", "cuda:1", 3, torch.device("cuda"))] == [True] * 4
    assert [is_cuda_device(d) for d in ("cpu", None, True, torch.device("cpu"), "meta")] == [
        False
    ] * 5


def test_cpu_schedule_patches_torch_only_while_entered() -> None:
    names = ("current_device", "synchronize", "current_stream")
    originals = [getattr(torch.cuda, n) for n in names]
    with cpu_schedule():
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize()  # a no-op
        stream = torch.cuda.current_stream()
        stream.wait_event(object())  # no-ops
        stream.wait_stream(stream)
        with pytest.raises(AttributeError):
            stream.record_event  # noqa: B018  (only the waits are stood in for)
        assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert [getattr(torch.cuda, n) for n in names] == originals
    with pytest.raises(KeyError), cpu_schedule():
        raise KeyError("undone on the way out")
    assert [getattr(torch.cuda, n) for n in names] == originals
    if NO_GPU:  # outside, a CUDA request is refused again
        with pytest.raises(NO_CUDA_ERROR[0], match=NO_CUDA_ERROR[1]):
            torch.zeros(1, device="cuda")


def test_cpu_schedule_from_two_threads_with_interleaved_exits_undoes_every_patch() -> None:
    """Thread A enters, thread B enters, A exits, B exits: ``torch.cuda`` used to
    stay patched (B restored A's stand-ins). Now the patches hold while either is
    inside, each thread has its own mode, and the last exit undoes them."""
    import threading

    names = ("current_device", "synchronize", "current_stream")
    originals = [getattr(torch.cuda, n) for n in names]
    a_in, b_in, a_out, b_out = (threading.Event() for _ in range(4))
    seen: dict[str, Any] = {}

    def thread_a() -> None:
        with cpu_schedule():
            a_in.set()
            b_in.wait(10)
            seen["a inside"] = torch.empty(1, device="cuda").device.type
        a_out.set()

    def thread_b() -> None:
        a_in.wait(10)
        with cpu_schedule():
            b_in.set()
            a_out.wait(10)
            seen["b after a left"] = (
                torch.cuda.current_device(),
                torch.empty(1, device="cuda").device.type,
            )
        b_out.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert b_out.is_set(), "a thread did not finish"
    assert seen == {"a inside": "cpu", "b after a left": (0, "cpu")}
    assert [getattr(torch.cuda, n) for n in names] == originals, "torch.cuda left patched"
    with cpu_schedule(), cpu_schedule():  # nested in one thread
        assert torch.cuda.current_device() == 0
    assert [getattr(torch.cuda, n) for n in names] == originals


@pytest.mark.skipif(not NO_GPU, reason="shows what fails without a GPU")
@pytest.mark.usefixtures("megatron_single")
def test_a_schedule_needs_the_shim_on_a_cpu() -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_tiny_gpt()
    batch = tiny_batch()

    def step(data_iterator: Any, model: torch.nn.Module) -> Any:
        return model(*cases.model_inputs(batch), labels=batch["labels"]), lambda x: (x.sum(), {})

    # the token counter, torch.zeros([], dtype=torch.int, device="cuda"), in schedules.py
    with pytest.raises(NO_CUDA_ERROR[0], match=NO_CUDA_ERROR[1]):
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=8,
            micro_batch_size=2,
        )


# ---- the cases: micro-batches, contexts and the unpipelined reference ----------------------


def _micro_batches() -> list[dict[str, Any]]:
    batches = [tiny_batch(seed=i) for i in range(NUM_MICROBATCHES)]
    batches[1]["loss_mask"][0, :3] = 0.0  # unequal token counts
    return batches


def _grpo_from_logits(logits: torch.Tensor, labels: torch.Tensor, ctx: PolicyBatch) -> torch.Tensor:
    """GRPO from full logits ``[b, s, V]``: PPO clip on the token ratio, k3 KL to the
    reference, seq-mean-token-mean over the mask (every sequence non-empty)."""
    assert ctx.mask is not None and ctx.ref_logprobs is not None
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, labels[..., None])[..., 0]
    ratio = torch.exp(logp - ctx.old_logprobs)
    adv = ctx.advantages
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    r = ctx.ref_logprobs - logp
    per_token = pg + KL_COEF * (torch.exp(r) - r - 1)
    mask = ctx.mask
    return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()


def _contexts(model: torch.nn.Module, batches: list[dict[str, Any]]) -> list[PolicyBatch]:
    """Old and reference logprobs near the model's own (some ratios beyond the clip
    range), per-sequence advantages of both signs, a mask with holes; float64."""
    contexts = []
    for i, mb in enumerate(batches):
        with torch.no_grad():
            logits = model(*cases.model_inputs(mb))
            logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, mb["labels"][..., None])[
                ..., 0
            ]
        g = torch.Generator().manual_seed(100 + i)
        b, s = logp.shape
        mask = (torch.rand(b, s, generator=g) > 0.3).double()
        mask[:, 0] = 1.0
        contexts.append(
            PolicyBatch(
                old_logprobs=logp + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64),
                advantages=torch.randn(b, 1, generator=g, dtype=torch.float64)
                .expand(b, s)
                .contiguous(),
                mask=mask,
                ref_logprobs=logp + 0.5 * torch.randn(b, s, generator=g, dtype=torch.float64),
                temperature=TEMPERATURE,
            )
        )
    return contexts


def _build(processor: str, shape: TinyGPTShape, **kw: Any) -> torch.nn.Module:
    if processor == "stock":
        return build_tiny_gpt(shape, **kw)
    return build_tiny_gpt(shape, pipeline_dtype=torch.float64, **kw).double()


def _reference(processor: str, num_layers: int, **kw: Any) -> dict[str, Any]:
    """One process, no pipeline: the micro-batches in order, each loss scaled as the
    schedule scales it, gradients accumulated. Returns the state the stages load,
    the losses, the gradients and the contexts."""
    model = _build(processor, TinyGPTShape(num_layers=num_layers), **kw)  # stock: no hook
    batches = _micro_batches()
    contexts = _contexts(model, batches) if processor == "policy" else [None] * len(batches)
    losses = []
    for mb, ctx in zip(batches, contexts, strict=True):
        if processor == "stock":
            loss_bs = model(*cases.model_inputs(mb), labels=mb["labels"])
            loss = (loss_bs * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
        else:
            loss = _grpo_from_logits(model(*cases.model_inputs(mb)), mb["labels"], ctx)
        losses.append(loss.detach().clone())
        ((loss * 1) / len(batches)).backward()  # forward_step_calc_loss: *= cp, /= num_microbatches
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    return {"state": state, "losses": losses, "grads": grads, "contexts": contexts}


# ---- the schedule's side --------------------------------------------------------------------


def _loss_func(processor: str, mb: dict[str, Any], seen: list[str], result: Any) -> Any:
    if processor == "stock":
        assert isinstance(result, torch.Tensor)  # the stock processor's loss [b, s]
        loss = (result * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
        return loss, {"loss": loss.detach().clone()}
    assert isinstance(result, Mapping), type(result)  # the processor's mapping, as returned
    seen.append("mapping")
    # .clone(): the schedule divides the returned loss in place, and a detach() shares storage
    return result["loss"], {
        "loss": result["loss"].detach().clone(),
        "clip": result["clip_fraction"],
    }


def _forward_step(
    processor: str,
    batches: list[dict[str, Any]],
    contexts: list[PolicyBatch | None],
    seen: list[str],
    data_iterator: Iterator[int],
    model: torch.nn.Module,
) -> tuple[Any, Callable[..., Any]]:
    i = next(data_iterator)
    mb, ctx = batches[i], contexts[i]
    if processor == "stock":
        out = model(*cases.model_inputs(mb), labels=mb["labels"], output_processor=cases.stock_loss)
    else:
        out = model(
            *cases.model_inputs(mb),
            labels=mb["labels"],
            output_processor=policy_loss(PolicyLossConfig.grpo(kl_coef=KL_COEF)),
            output_processor_context=ctx,
        )
    if isinstance(out, torch.Tensor) and out.dim() == 3:
        seen.append("hidden")  # a stage before the last: [s, b, h]
    return out, partial(_loss_func, processor, mb, seen)


def _run_schedule(
    processor: str, models: list[torch.nn.Module], ref: dict[str, Any], seen: list[str]
) -> list[dict[str, Any]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = _micro_batches()
    iterators = [iter(range(len(batches))) for _ in models]
    with cpu_schedule():
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, processor, batches, ref["contexts"], seen),
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models,
            num_microbatches=len(batches),
            seq_length=8,
            micro_batch_size=2,
            forward_only=False,
        )


def _global_name(model: torch.nn.Module, name: str) -> str:
    """A stage's parameter name under the unpipelined model's layer numbering."""
    layers = model.decoder.layers  # type: ignore[union-attr]
    return re.sub(
        r"decoder\.layers\.(\d+)\.",
        lambda m: f"decoder.layers.{layers[int(m[1])].layer_number - 1}.",
        name,
    )


def _holds_the_unpipelined_tensors(
    model: torch.nn.Module, state: dict[str, torch.Tensor], global_name: Callable[[str], str]
) -> None:
    """``build_tiny_gpt`` gives each stage (and model chunk) the unpipelined model's tensors
    under their global layer numbers: the stages start as one process does, nothing copied."""
    held = {global_name(k): v for k, v in model.state_dict().items() if "_extra_state" not in k}
    differ = [k for k, v in held.items() if not torch.equal(v, state[k])]
    assert not differ, f"stage tensors other than the pp=1 model's: {differ}"


def _check(
    processor: str, models: list[torch.nn.Module], losses: list[Any], ref: dict[str, Any]
) -> None:
    last_stage = any(getattr(m, "post_process", False) for m in models)
    assert len(losses) == (NUM_MICROBATCHES if last_stage else 0)
    for got, want in zip(losses, ref["losses"] if last_stage else [], strict=True):
        if processor == "stock":
            assert torch.equal(got["loss"], want), (got["loss"], want)
        else:
            assert got["loss"].dtype == torch.float64
            torch.testing.assert_close(got["loss"], want, rtol=1e-10, atol=0.0)
    if processor == "policy" and last_stage:
        assert any(0.0 < float(x["clip"]) < 1.0 for x in losses)  # both sides of the clip
    checked = 0
    for model in models:
        for name, param in model.named_parameters():
            want = ref["grads"][_global_name(model, name)]
            assert param.grad is not None, name
            if processor == "stock":
                assert torch.equal(param.grad, want), name
            else:
                torch.testing.assert_close(
                    param.grad, want, rtol=1e-10, atol=1e-14, msg=lambda m, n=name: f"{n}: {m}"
                )
            checked += 1
    assert checked > 0


def _stage_models(
    processor: str, ref: dict[str, Any], vpp: int | None, num_layers: int, **overrides: Any
) -> list[Any]:
    shape = TinyGPTShape(num_layers=num_layers)
    chunks: list[int | None] = list(range(vpp)) if vpp else [None]
    models = []
    for v in chunks:
        extra = (
            {"virtual_pipeline_model_parallel_size": vpp, **INTERLEAVED_GLOO, **overrides}
            if vpp
            else {}
        )
        model = torch_impl.enable_output_processor(_build(processor, shape, vp_stage=v, **extra))
        _holds_the_unpipelined_tensors(model, ref["state"], lambda k, m=model: _global_name(m, k))
        models.append(model)
    return models


def _run_and_check(refs: dict[str, dict[str, Any]], vpp: int | None, num_layers: int) -> list[str]:
    seen_all = []
    for processor, ref in refs.items():
        models = _stage_models(processor, ref, vpp, num_layers)
        seen: list[str] = []
        losses = _run_schedule(processor, models, ref, seen)
        _check(processor, models, losses, ref)
        seen_all += seen
    return seen_all


def _pipeline_rank(
    rank: int, refs: dict[str, dict[str, Any]], vpp: int | None, num_layers: int
) -> None:
    torch.set_num_threads(
        1
    )  # two ranks on a small CPU: oversubscribed threads stall the collectives
    seen = _run_and_check(refs, vpp, num_layers)
    # the first rank's stages end in hidden states; the mapping reaches loss_func on the last
    chunks = vpp or 1
    if rank == 0:
        assert seen.count("hidden") == 2 * chunks * NUM_MICROBATCHES and "mapping" not in seen
    else:
        assert seen.count("mapping") == NUM_MICROBATCHES
        assert seen.count("hidden") == 2 * (chunks - 1) * NUM_MICROBATCHES
    if vpp:  # why INTERLEAVED_GLOO: batched p2p over gloo swaps activations and gradients
        models = _stage_models("stock", refs["stock"], vpp, num_layers, batch_p2p_comm=True)
        losses = _run_schedule("stock", models, refs["stock"], [])
        if rank == 1:
            got = [x["loss"] for x in losses]
            assert len(got) == NUM_MICROBATCHES and torch.equal(got[0], refs["stock"]["losses"][0])
            assert not all(map(torch.equal, got, refs["stock"]["losses"])), got


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The reference and the schedule on one thread each, as the ranks run: a layer
    norm's weight gradient is a reduction that a CPU splits by thread, so the thread
    count changes its last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _references(num_layers: int) -> dict[str, dict[str, Any]]:
    with _one_thread(), megatron_parallel():
        return {p: _reference(p, num_layers) for p in ("stock", "policy")}


def _tied_reference() -> dict[str, Any]:
    with _one_thread(), megatron_parallel():
        return _reference("policy", 2, share_embeddings_and_output_weights=True)


TIED = "embedding.word_embeddings.weight"


def _tied_rank(rank: int, ref: dict[str, Any]) -> None:
    """Tied embeddings under 1F1B: the last stage holds its own copy of the embedding
    as the output weight; each stage's model in Megatron's DDP, and the schedule's
    ``finalize_model_grads`` sums the two copies' gradients over the embedding group.
    Both copies' ``main_grad`` must equal the unpipelined tied weight's gradient."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    torch.set_num_threads(1)
    with cpu_schedule():  # the constructor syncs the last stage's copy with weight.data.cuda()
        model = torch_impl.enable_output_processor(
            _build("policy", TinyGPTShape(num_layers=2), share_embeddings_and_output_weights=True)
        )

    def global_name(name: str) -> str:
        return TIED if name == "output_layer.weight" else _global_name(model, name)

    _holds_the_unpipelined_tensors(model, ref["state"], global_name)
    with cpu_schedule():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    losses = _run_schedule("policy", [ddp], ref, [])
    if rank == 1:
        for got, want in zip(losses, ref["losses"], strict=True):
            torch.testing.assert_close(got["loss"], want, rtol=1e-10, atol=0.0)
    names = [n for n, _ in model.named_parameters()]
    assert (TIED if rank == 0 else "output_layer.weight") in names
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.main_grad,
            ref["grads"][global_name(name)],
            rtol=1e-10,
            atol=1e-14,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def test_no_pipelining_schedule_equals_one_process() -> None:
    refs = _references(2)
    with _one_thread(), megatron_parallel():
        seen = _run_and_check(refs, None, 2)
    assert seen.count("mapping") == NUM_MICROBATCHES and "hidden" not in seen


@pytest.mark.slow
def test_1f1b_pp2_schedule_equals_one_process() -> None:
    run_distributed(_pipeline_rank, _references(2), None, 2, pp=2)


@pytest.mark.slow
def test_1f1b_pp2_tied_embeddings_through_ddp_and_finalize_model_grads() -> None:
    run_distributed(_tied_rank, _tied_reference(), pp=2)


@pytest.mark.slow
def test_interleaved_vpp2_pp2_schedule_equals_one_process() -> None:
    run_distributed(_pipeline_rank, _references(4), 2, 4, pp=2, vpp=2)


# ---- the recipe ----------------------------------------------------------------------------

RECIPE = ROOT / "docs" / "examples" / "schedule_recipe.py"
DOC = ROOT / "docs" / "schedules.md"


def _recipe_module() -> Any:
    spec = importlib.util.spec_from_file_location("schedule_recipe", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _between(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1 and text.count(end) == 1, (start, end)
    return text.split(start, 1)[1].split(end, 1)[0]


def test_the_docs_quote_the_recipe_verbatim() -> None:
    recipe = _between(RECIPE.read_text(), "# --- recipe start ---\n", "# --- recipe end ---\n")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert recipe.strip() and recipe in blocks
    assert 12 <= len([line for line in recipe.splitlines() if line.strip()]) <= 30


def test_the_recipe_runs_and_equals_the_whole_batch() -> None:
    """The recipe's schedule over 4 equal micro-batches equals one forward of the whole
    batch through the same processor: the mean of the micro-batch losses, and every
    gradient (the aggregation is seq-mean-token-mean, each micro-batch the same count
    of sequences)."""
    example = _recipe_module()
    with megatron_parallel():
        run = example.run_example(num_microbatches=4)
        whole = example.whole_batch(run)
    losses = [m["loss"] for m in run.metrics]
    assert len(losses) == 4 and all(set(m) >= {"loss", "kl", "clip_fraction"} for m in run.metrics)
    torch.testing.assert_close(torch.stack(losses).mean(), whole.loss, rtol=1e-5, atol=1e-7)
    for name, grad in run.grads.items():
        torch.testing.assert_close(
            grad, whole.grads[name], rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert any(g.abs().sum() > 0 for g in whole.grads.values())


def test_unequal_micro_batches_with_the_batch_count() -> None:
    """Micro-batches of 3 and 5 sequences: ``PolicyBatch(global_sequences=8)`` and the
    loss returned times the number of micro-batches (the schedule divides by it) give
    the whole batch's loss and gradients, as docs/schedules.md says."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    example = _recipe_module()
    with megatron_parallel():
        model = torch_impl.enable_output_processor(build_tiny_gpt())
        (whole,) = example.grpo_micro_batches(model, 1, batch=8)
        parts = [{k: v[:3] for k, v in whole.items()}, {k: v[3:] for k, v in whole.items()}]

        def loss_func(result: Mapping[str, torch.Tensor]) -> Any:
            return result["loss"] * len(parts), {"loss": result["loss"].detach().clone()}

        def step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> Any:
            mb = next(data_iterator)
            context = PolicyBatch(
                old_logprobs=mb["old_logprobs"],
                advantages=mb["advantages"],
                mask=mb["mask"],
                ref_logprobs=mb["ref_logprobs"],
                global_sequences=8,
            )
            result = model(
                mb["input_ids"],
                mb["position_ids"],
                None,
                labels=mb["labels"],
                output_processor=example.grpo,
                output_processor_context=context,
            )
            return result, loss_func

        with cpu_schedule():
            metrics = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(parts),
                model=[model],
                num_microbatches=len(parts),
                seq_length=8,
                micro_batch_size=4,
            )
        got = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        loss = example.forward_step_func(iter([whole]), model)[0]["loss"]
        loss.backward()
    want = loss.detach()
    torch.testing.assert_close(metrics[0]["loss"] + metrics[1]["loss"], want, rtol=1e-5, atol=1e-7)
    # the plain average of the two means is not the whole batch's mean
    assert (
        abs(float(metrics[0]["loss"] * 8 / 3 + metrics[1]["loss"] * 8 / 5) / 2 - float(want)) > 1e-3
    )
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(
            got[name], p.grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
