"""Model options that change the stock logits change the built-in processors'
logits the same way, or are refused by name.

What Megatron Core's own output path reads (``GPTModel._postprocess``,
``LanguageModule._scale_logits``, ``compute_language_model_loss``, the output
layer) on 0.16.1 and 0.19.2:

- ``use_mup`` / ``mup_output_mult`` (0.19.2; absent in 0.16.1): the logits are
  scaled by ``scale_logits``. Followed: the processors probe ``ctx.scale_logits``
  and scale their own logits by the same factor.
- ``cross_entropy_loss_fusion`` / ``cross_entropy_fusion_impl``: the same cross
  entropy by another kernel (rounding only). ``sequence_parallel``: the gather
  (the collectives). ``mtp_num_layers``, ``mtp_loss_scaling_factor``,
  ``calculate_per_token_loss``: the MTP losses, not the logits.
  ``inference_cuda_graph_scope``, ``materialize_only_last_token_logits``:
  inference only.
- ``logit_dtype`` (fp32 output logits) and logit softcapping by other names: read
  by neither release; keyed on the config attribute existing and being set, refused
  by name (:data:`UNSUPPORTED_LOGIT_OPTIONS`), tested with a stand-in config.
  ``final_logit_softcapping`` is followed (``tests/processors/test_softcap.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, VocabShard
from torch_impl.processors import cross_entropy_loss, policy_loss, selected_logprobs
from torch_impl.processors._checks import UNSUPPORTED_LOGIT_OPTIONS, context_logit_scale

B, S, H, V = 2, 5, 8, 11


def _ctx(*, scale_logits: Any = None, config: Any = None) -> OutputContext:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 1] = -100
    return OutputContext(
        hidden_states=h,
        labels=labels,
        loss_mask=torch.ones(B, S, dtype=torch.float64),
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        scale_logits=scale_logits,
        config=config,
    )


def _truth(ctx: OutputContext, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, from the materialised logits ``c * h @ W.T``: logprobs and entropy [b, s]."""
    z = c * torch.einsum(
        "sbh,vh->bsv",
        ctx.hidden_states,  # type: ignore[arg-type]
        ctx.vocab_weight,  # type: ignore[arg-type]
    )
    logp = torch.log_softmax(z, -1)
    labels = ctx.labels
    assert isinstance(labels, torch.Tensor)
    lp = torch.where(labels == -100, 0.0, logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0])
    return lp, -(logp.exp() * logp).sum(-1)


@dataclasses.dataclass
class _Config:
    use_mup: bool = False
    mup_output_mult: float = 1.0
    logit_dtype: Any = None
    output_logit_softcapping: Any = None
    logit_softcapping: Any = None
    final_logit_softcapping: Any = None


_SET = {
    "logit_dtype": torch.float32,
    "output_logit_softcapping": 30.0,
    "logit_softcapping": 30.0,
    "final_logit_softcapping": 30.0,
}


@pytest.mark.parametrize("field", UNSUPPORTED_LOGIT_OPTIONS)
@pytest.mark.parametrize(
    "make",
    [lambda: selected_logprobs(entropy=True), cross_entropy_loss, policy_loss],
    ids=["sel", "ce", "pol"],
)
def test_each_unsupported_logit_option_is_refused_by_name_when_set(field: str, make: Any) -> None:
    ctx = _ctx(config=_Config(**{field: _SET[field]}))
    with pytest.raises(ContractError) as info:
        make()(ctx)
    assert info.value.field == f"config.{field}"
    assert "unset" in str(info.value.expected)


@pytest.mark.parametrize("field", UNSUPPORTED_LOGIT_OPTIONS)
def test_unset_options_pass(field: str) -> None:
    assert context_logit_scale(_ctx(config=_Config(**{field: None})), processor="p") == 1.0


def _set_by_default(config_cls: Any) -> list[str]:
    """The unsupported options ``config_cls`` has with a default that is set (a model
    built with defaults would be refused)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    return [
        n
        for n in UNSUPPORTED_LOGIT_OPTIONS
        if n in fields and fields[n].default not in (None, False, 0)
    ]


PINNED_RELEASES = ("0.16.1", "0.19.2")


def test_the_installed_config_has_none_of_them_or_defaults_them_unset() -> None:
    """The pinned releases have none of these fields (asserted: a release that adds one
    fails here, and this module is re-read); any release that has one must default it
    unset, so that only a model that sets it is refused. The check of the defaults
    can fail: a stand-in config that defaults one set is caught."""
    import importlib.metadata

    from megatron.core.transformer.transformer_config import TransformerConfig

    present = sorted(
        set(UNSUPPORTED_LOGIT_OPTIONS) & {f.name for f in dataclasses.fields(TransformerConfig)}
    )
    if importlib.metadata.version("megatron-core") in PINNED_RELEASES:
        assert present == []
    assert _set_by_default(TransformerConfig) == []
    assert _set_by_default(_Config) == []
    soft = dataclasses.make_dataclass(
        "Soft", [("logit_softcapping", float, dataclasses.field(default=30.0))]
    )
    assert _set_by_default(soft) == ["logit_softcapping"]


@pytest.mark.parametrize("c", [0.25, 1.0, 3.0])
def test_a_scaling_scale_logits_is_followed_by_every_builtin_processor(c: float) -> None:
    """A model whose ``scale_logits`` multiplies by ``c`` (MuP's output multiplier),
    whatever its config says: the processors' logits are scaled the same way. Before,
    they read ``config.use_mup`` only and dropped a scaling the config did not name."""
    ctx = _ctx(scale_logits=lambda z: z * c, config=None)
    lp, ent = _truth(ctx, c)
    got = selected_logprobs(entropy=True)(ctx)
    torch.testing.assert_close(got["logprobs"].double(), lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["entropy"].double(), ent, rtol=1e-6, atol=1e-6)
    ce = cross_entropy_loss()(ctx)
    torch.testing.assert_close(ce.double(), -lp, rtol=1e-6, atol=1e-6)
    if c != 1.0:
        unscaled, _ = _truth(ctx, 1.0)
        assert (got["logprobs"].double() - unscaled).abs().max() > 1e-3  # the scaling matters here


def test_the_config_multiplier_is_used_for_a_hand_built_context_without_scale_logits() -> None:
    ctx = _ctx(config=_Config(use_mup=True, mup_output_mult=0.5))
    lp, _ = _truth(ctx, 0.5)
    torch.testing.assert_close(
        selected_logprobs()(ctx)["logprobs"].double(), lp, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (lambda z: 30.0 * torch.tanh(z / 30.0), "softcapping"),
        (lambda z: 1e4 * torch.tanh(z / 1e4), "softcapping with a wide cap"),
        (lambda z: z.clamp(-5, 5), "a clamp whose cap the logits exceed"),
        (lambda z: 2.0 * z.clamp(-1e6, 1e6), "a scaled clamp at a large cap"),
        (lambda z: torch.where(z.abs() < 1e-20, 0.0, z), "small logits flushed to zero"),
        (lambda z: z + 1.0, "an offset"),
        (lambda z: -z, "a negative factor"),
        (lambda z: "logits", "not a tensor"),
        (lambda z: z[..., :1], "another shape"),
    ],
    ids=[
        "softcap",
        "wide-softcap",
        "clamp",
        "large-clamp",
        "flush",
        "offset",
        "negative",
        "not-tensor",
        "shape",
    ],
)
def test_a_scale_logits_that_is_not_a_positive_scaling_is_refused(fn: Any, why: str) -> None:
    """A clamp (``z.clamp(-5, 5)``) used to pass: the probe's values sat inside its
    cap, the processors then ignored the cap and the logprob was off by 30. The
    probe spans 1e-30 to 1e30 in size, so any map that is not ``c * z`` on it is
    refused."""
    ctx = _ctx(scale_logits=fn)
    with pytest.raises(ContractError) as info:
        selected_logprobs()(ctx)
    assert info.value.field == "scale_logits", why


def test_a_scale_logits_in_another_dtype_is_taken_as_its_factor() -> None:
    """The probe is float64; a scaling that computes in float32 rounds it to 1e-7
    relative, within the probe's tolerance: its factor is taken."""
    assert context_logit_scale(_ctx(scale_logits=lambda z: z.float()), processor="p") == 1.0
    assert context_logit_scale(_ctx(scale_logits=lambda z: z.float() * 0.5), processor="p") == 0.5


def test_megatron_mup_model_through_the_hook(megatron_single: None) -> None:
    """A tiny GPT with MuP on (where the installed release has it): the processors'
    logprobs equal log_softmax of the stock model's (scaled) logits."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "use_mup" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        pytest.skip("this megatron-core has no MuP (TransformerConfig.use_mup)")
    from torch_impl import enable_output_processor
    from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

    b = tiny_batch()
    options = {"use_mup": True, "mup_output_mult": 0.37}
    stock = build_tiny_gpt(**options)
    logits = stock(b["input_ids"], b["position_ids"], None)  # [b, s, V], scaled
    assert stock.config.mup_output_mult == 0.37
    want = torch.log_softmax(logits.double(), -1).gather(-1, b["labels"][..., None])[..., 0]
    model = enable_output_processor(build_tiny_gpt(**options))
    got = model(
        b["input_ids"],
        b["position_ids"],
        None,
        labels=b["labels"],
        output_processor=selected_logprobs(),
    )
    torch.testing.assert_close(got["logprobs"].double(), want, rtol=1e-5, atol=1e-5)
