"""What differs between Megatron Core releases, checked on each one of the matrix.

``scripts/matrix.sh`` runs the tests marked ``release_matrix`` (these and a few in
other files) on 0.13.1 to 0.19.2; the full suite runs them on 0.16.1 and 0.19.2.
A test that needs what a release lacks skips with a reason read from the
installed code (an attribute, a signature), never from a version string.
The release table of ``docs/releases.md`` is checked here against
``torch_impl.doctor``'s inspection of the installed release, so a stale row fails
on that release.
"""

from __future__ import annotations

import inspect
import pathlib
import re
from typing import Any

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import multi_token_prediction as megatron_mtp

import hookspec
from hookspec import ContractError, OutputContext
from tests.support.distributed import run_distributed
from tests.support.hook_cases import grads, stock_loss, stock_loss_upstream
from tests.support.mtp_support import build_mtp_gpt
from torch_impl import _compat, enable_output_processor, installed_megatron
from torch_impl._postprocess import as_inner_stage
from torch_impl.doctor import MATRIX_RELEASES, TABLE_HEADER, facts_row
from torch_impl.mtp import default_mtp_loss
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

pytestmark = pytest.mark.release_matrix

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_release_rows() -> dict[str, str]:
    """The rows of the release table (``docs/releases.md``), by release."""
    lines = (ROOT / "docs" / "releases.md").read_text().splitlines()
    start = lines.index(TABLE_HEADER)
    rows: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows[line.split("|")[1].strip()] = line
    return rows


def run(
    model: Any, batch: dict[str, Any], **kw: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], batch["position_ids"], None, **kw)
    out.float().sum().backward()
    return out.detach(), grads(model)


def assert_bitwise(got: tuple[Any, dict[str, Any]], want: tuple[Any, dict[str, Any]]) -> None:
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


# ---------------------------------------------------------------------------
# The release table and the matrix
# ---------------------------------------------------------------------------


def test_readme_row_is_what_the_installed_code_says() -> None:
    release = installed_megatron().release
    if release not in MATRIX_RELEASES:
        pytest.skip(f"megatron-core {release} is not in the release matrix")
    rows = readme_release_rows()
    assert release in rows, f"docs/releases.md's release table has no row for {release}"
    assert rows[release] == facts_row()


def test_readme_table_and_matrix_script_list_the_matrix() -> None:
    assert list(readme_release_rows()) == list(MATRIX_RELEASES)
    script = (ROOT / "scripts" / "matrix.sh").read_text()
    entries = re.findall(r'^  "(\d+\.\d+\.\d+) py3(\d+)"$', script, flags=re.M)
    assert {r: f"3.{minor}" for r, minor in entries} == MATRIX_RELEASES
    assert [r for r, _ in entries] == list(MATRIX_RELEASES)


def test_installed_megatron_is_the_one_imported() -> None:
    """Under the matrix, the release folder on PYTHONPATH shadows the environment's own."""
    import megatron.core

    installed = installed_megatron()
    assert not installed.shadowed
    assert pathlib.Path(megatron.core.__file__).resolve().parent == pathlib.Path(installed.package)


# ---------------------------------------------------------------------------
# MTP
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("megatron_single")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "processor", [stock_loss, stock_loss_upstream], ids=["hookspec", "upstream"]
)
def test_mtp_model_main_processor_is_bitwise_stock(processor: Any, tied: bool) -> None:
    """A processor on a model with MTP layers: the stock MTP losses and gradients
    (computed where the release computes them), bitwise."""
    batch = tiny_batch()
    batch["loss_mask"][0, 5:] = 0.0
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    want = run(build_mtp_gpt(tied=tied, mtp_loss_scaling_factor=0.1).eval(), batch, **kw)
    model = enable_output_processor(build_mtp_gpt(tied=tied, mtp_loss_scaling_factor=0.1)).eval()
    assert_bitwise(run(model, batch, **kw, output_processor=processor), want)
    assert_bitwise(run(model, batch, **kw), want)


@pytest.mark.usefixtures("megatron_single")
def test_mtp_processor_is_bitwise_stock_and_sees_each_depth_rolled() -> None:
    if _compat.mtp_loss_in_block():
        pytest.skip(
            "MultiTokenPredictionBlock.forward takes compute_language_model_loss here: "
            "the block computes the MTP losses, no per-depth processor"
        )
    batch = tiny_batch()
    batch["loss_mask"][0, 5:] = 0.0
    labels, mask = batch["labels"], batch["loss_mask"]
    kw = {"labels": labels, "loss_mask": mask}
    want = run(build_mtp_gpt(mtp_loss_scaling_factor=0.1).eval(), batch, **kw)
    seen: list[OutputContext] = []

    @hookspec.processor
    def record(ctx: OutputContext) -> Any:
        seen.append(ctx)
        return default_mtp_loss(ctx)

    model = enable_output_processor(build_mtp_gpt(mtp_loss_scaling_factor=0.1)).eval()
    assert_bitwise(run(model, batch, **kw, mtp_processor=default_mtp_loss), want)
    assert_bitwise(run(model, batch, **kw, output_processor=stock_loss, mtp_processor=record), want)
    assert [c.mtp_depth for c in seen] == [1, 2]
    for ctx in seen:
        k = ctx.mtp_depth
        want_labels = torch.zeros_like(labels)
        want_labels[:, :-k] = labels[:, k:]
        want_mask = torch.zeros_like(mask)
        want_mask[:, :-k] = mask[:, k:]
        assert torch.equal(ctx.labels, want_labels)
        assert torch.equal(ctx.loss_mask, want_mask)


@pytest.mark.usefixtures("megatron_single")
def test_mtp_processor_is_refused_where_the_block_computes_the_loss() -> None:
    if not _compat.mtp_loss_in_block():
        pytest.skip("MultiTokenPredictionBlock.forward takes no compute_language_model_loss here")
    batch = tiny_batch()
    model = enable_output_processor(build_mtp_gpt(mtp_loss_scaling_factor=0.1)).eval()
    with pytest.raises(ContractError) as info:
        model(
            batch["input_ids"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            mtp_processor=default_mtp_loss,
        )
    assert info.value.field == "mtp_processor"
    assert "MultiTokenPredictionBlock" in str(info.value)


def test_packed_mtp_is_refused_where_roll_tensor_cannot_roll_per_sequence() -> None:
    """Where ``roll_tensor`` takes no ``packed_seq_params`` it would roll labels
    across packed sequences: ``_compat.roll_tensor`` refuses THD input there."""
    if "packed_seq_params" in _compat.roll_accepts():
        pytest.skip(
            "roll_tensor takes packed_seq_params here: it rolls each packed sequence on its own"
        )
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
    )
    with pytest.raises(ContractError) as info:
        _compat.roll_tensor(torch.ones(1, 12), cp_group=None, packed_seq_params=packed)
    assert info.value.field == "packed_seq_params"
    assert "qkv_format='thd'" in str(info.value)


def test_roll_follows_megatron_roll_tensor() -> None:
    """``_compat.roll_tensor`` is Megatron's ``roll_tensor`` (shift -1, last
    position zeroed, with its sum) with the keywords the installed one takes."""
    x = torch.arange(1.0, 13.0).reshape(2, 6)
    rolled, total = _compat.roll_tensor(x, cp_group=None, packed_seq_params=None)
    want = torch.zeros_like(x)
    want[:, :-1] = x[:, 1:]
    assert torch.equal(rolled, want) and torch.equal(total, want.sum())
    params = inspect.signature(megatron_mtp.roll_tensor).parameters
    assert _compat.roll_accepts() == frozenset(params)


# ---------------------------------------------------------------------------
# The tensor-parallel reduction the adapter hands a contiguous gradient
# ---------------------------------------------------------------------------


def _reduce_rank(rank: int, keeps: bool) -> None:
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    x = (torch.arange(6.0).reshape(2, 3) * (rank + 1)).t()  # not contiguous
    out = reduce_from_tensor_model_parallel_region(x)
    reduced = torch.equal(out, torch.arange(6.0).reshape(2, 3).t() * 3)
    assert reduced == keeps, f"inspection says the result is reduced: {keeps}; it is: {reduced}"


@pytest.mark.slow
def test_reduce_inspection_matches_what_tp2_does() -> None:
    """The release table's TP defect cell comes from ``_compat``'s reading of
    ``_reduce``; two gloo ranks confirm it on the installed release."""
    run_distributed(_reduce_rank, _compat.reduce_keeps_noncontiguous_result(), tp=2)


# ---------------------------------------------------------------------------
# The schedule plan's post-process node
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("megatron_single")
@pytest.mark.parametrize(
    "processor", [stock_loss, stock_loss_upstream], ids=["hookspec", "upstream"]
)
def test_schedule_plan_post_process_node_runs_the_hook_like_forward(processor: Any) -> None:
    """The node gets what the plan hands it: the decoder's output before the final
    norm where the release's node (or the adapter's plan) applies the norm itself,
    after it otherwise; decided by counting the norm's calls in the node."""
    if not hasattr(GPTModel, "build_schedule_plan"):
        pytest.skip("GPTModel has no build_schedule_plan in this release")
    from tests.support.plan_support import post_node

    model = enable_output_processor(build_tiny_gpt()).eval()
    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    want = model(batch["input_ids"], batch["position_ids"], None, **kw, output_processor=processor)
    want.sum().backward()
    want_grad = model.output_layer.weight.grad.clone()
    model.zero_grad(set_to_none=True)

    norm = model.decoder.final_layernorm
    taken: dict[str, torch.Tensor] = {}
    handles = [
        norm.register_forward_pre_hook(lambda _m, args: taken.__setitem__("pre", args[0].detach())),
        norm.register_forward_hook(lambda _m, _a, out: taken.__setitem__("post", out.detach())),
    ]
    with torch.no_grad(), as_inner_stage(model):
        model(batch["input_ids"], batch["position_ids"], None)
    for handle in handles:
        handle.remove()
    calls: list[int] = []
    probe = norm.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        post_node(model, batch, output_processor=processor).post_process.forward_impl(
            taken["post"].clone()
        )
    probe.remove()
    node_input = taken["pre"] if calls else taken["post"]

    plan = post_node(model, batch, output_processor=processor)
    got = plan.post_process.forward_impl(node_input.clone().requires_grad_(True))
    assert torch.equal(got, want)
    got.sum().backward()
    assert torch.equal(model.output_layer.weight.grad, want_grad)
