"""hookspec on its own: no framework imported, typed context, validation errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import hookspec
from hookspec import ContractError, OutputContext, ParallelLayout, VocabShard
from tests.support.identity_collectives import identity_collectives


def test_import_pulls_in_no_framework() -> None:
    code = (
        "import sys, json, hookspec, hookspec.conventions, hookspec.validation;"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('torch', 'jax', 'jaxlib', 'flax', 'numpy', 'megatron'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_public_surface_is_explicit() -> None:
    assert sorted(hookspec.__all__) == sorted(set(hookspec.__all__))
    for name in hookspec.__all__:
        assert hasattr(hookspec, name), name
    assert hookspec.SPEC_VERSION == (1, 2)
    assert len(hookspec.UPSTREAM_HOOK_KEYWORDS) == 16


def test_context_carries_every_upstream_keyword_by_name() -> None:
    fields = [f.name for f in dataclasses.fields(OutputContext)]
    assert fields[:16] == list(hookspec.UPSTREAM_HOOK_KEYWORDS)
    for extra in ("vocab_weight", "padding_mask", "parallel", "vocab", "mtp_depth", "collectives"):
        assert extra in fields


def test_context_is_frozen() -> None:
    ctx = OutputContext(hidden_states=np.zeros((4, 2, 3), np.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.labels = None  # type: ignore[misc]
    assert ctx.replace(mtp_depth=1).mtp_depth == 1


def _ctx(**kw: object) -> OutputContext:
    base: dict[str, object] = dict(
        hidden_states=np.zeros((8, 2, 4), np.float32),
        labels=np.zeros((2, 8), np.int64),
        loss_mask=np.ones((2, 8), np.float32),
        vocab_weight=np.zeros((16, 4), np.float32),
        vocab=VocabShard(0, 16, 16),
    )
    base.update(kw)
    return OutputContext(**base)  # type: ignore[arg-type]


def test_valid_context_passes() -> None:
    hookspec.validate_context(_ctx())


@pytest.mark.parametrize(
    ("changes", "field", "expected", "actual"),
    [
        ({"labels": np.zeros((2, 7), np.int64)}, "labels", "[b=2, s=8]", "[2, 7]"),
        ({"labels": np.zeros((3, 8), np.int64)}, "labels", "[b=2, s=8]", "[3, 8]"),
        ({"loss_mask": np.ones((2, 9))}, "loss_mask", "[b=2, s=8]", "[2, 9]"),
        ({"hidden_states": np.zeros((8, 2))}, "hidden_states", "3 dims", "[8, 2]"),
        ({"hidden_states": np.zeros((8, 2, 4), np.int32)}, "hidden_states", "floating", "int32"),
        ({"vocab_weight": np.zeros((16, 5))}, "vocab_weight", "h=4", "[16, 5]"),
        # found by the contract fuzzer: an integer weight reached the tensor functions,
        # whose error named their own argument ('weight'), not the context's field
        ({"vocab_weight": np.zeros((16, 4), np.int64)}, "vocab_weight", "floating", "int64"),
        ({"labels": np.zeros((2, 8), np.float32)}, "labels", "integer", "float32"),
    ],
)
def test_mismatched_shapes_name_field_expected_actual(
    changes: dict[str, object], field: str, expected: str, actual: str
) -> None:
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(_ctx(**changes))
    err = info.value
    assert err.field == field
    assert expected in str(err.expected)
    assert actual in str(err.actual)
    assert str(err).startswith(f"{field}: expected ")


# A user's collectives over two ranks (stand-in: the reductions are not run here).
_TwoRanks = identity_collectives(
    "_TwoRanks", gather_hidden_states=lambda self, x: np.concatenate([x, x])
)


def test_sequence_parallel_hidden_states_are_a_tp_slice() -> None:
    sp = ParallelLayout(tp_size=2, tp_rank=1, sequence_parallel=True)
    ctx = _ctx(
        hidden_states=np.zeros((4, 2, 4), np.float32),
        parallel=sp,
        vocab=VocabShard(8, 16, 16),
        vocab_weight=np.zeros((8, 4), np.float32),
        collectives=_TwoRanks(),
    )
    hookspec.validate_context(ctx)
    assert ctx.seq_len == 8
    with pytest.raises(ContractError, match="under sequence parallel"):
        hookspec.validate_context(ctx.replace(hidden_states=np.zeros((8, 2, 4), np.float32)))


def test_labels_outside_vocabulary_are_refused_ignore_index_is_not() -> None:
    labels = np.zeros((2, 8), np.int64)
    labels[0, 0] = -100
    hookspec.validate_context(_ctx(labels=labels))
    labels[1, 3] = 16
    labels[1, 4] = -1
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(_ctx(labels=labels))
    assert info.value.field == "labels"
    assert "[0, 16)" in str(info.value.expected)
    assert "2 ids outside it, in [-1, 16]" in str(info.value.actual)
    hookspec.validate_context(_ctx(labels=labels), check_values=False)
    labels[0, 0] = labels[1, 3] = labels[1, 4] = -1
    hookspec.validate_context(_ctx(labels=labels, ignore_index=-1))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tp_size": 0}, "parallel.tp_size"),
        ({"tp_size": 2, "tp_rank": 2}, "parallel.tp_rank"),
        ({"cp_rank": -1}, "parallel.cp_rank"),
    ],
)
def test_parallel_layout_ranges(kw: dict[str, int], field: str) -> None:
    with pytest.raises(ContractError) as info:
        ParallelLayout(**kw)
    assert info.value.field == field


def test_vocab_shard_range_and_tp_consistency() -> None:
    with pytest.raises(ContractError, match="start < end"):
        VocabShard(8, 8, 16)
    with pytest.raises(ContractError, match="end <= size"):
        VocabShard(0, 17, 16)
    ctx = _ctx(vocab=VocabShard(0, 8, 16), vocab_weight=np.zeros((8, 4), np.float32))
    with pytest.raises(ContractError, match="tp_size"):
        hookspec.validate_context(ctx)


@pytest.mark.parametrize(
    ("result", "field", "actual"),
    [
        (np.zeros((2, 7)), "processor result", "[2, 7]"),
        (np.zeros((8, 2)), "processor result", "[8, 2]"),
        ([1.0, 2.0], "processor result", "list"),
        ({"logprobs": np.zeros((2, 8)), "bad": np.zeros(3)}, "processor result['bad']", "[3]"),
        ({}, "processor result", "an empty mapping"),
        ({1: np.zeros((2, 8))}, "processor result", "key 1"),
    ],
)
def test_results_of_the_wrong_shape_or_type(result: object, field: str, actual: str) -> None:
    with pytest.raises(ContractError) as info:
        hookspec.validate_result(result, batch=2, seq=8)
    assert info.value.field == field
    assert actual in str(info.value.actual)


def test_results_per_token_scalar_and_mapping_pass() -> None:
    hookspec.validate_result(np.zeros((2, 8)), batch=2, seq=8)
    hookspec.validate_result(np.float32(1.0), batch=2, seq=8)
    hookspec.validate_result({"loss": np.zeros(()), "logprobs": np.zeros((2, 8))}, batch=2, seq=8)


def test_processor_marker_and_native_call_error() -> None:
    def fn(ctx: OutputContext) -> object:
        return ctx.hidden_states

    p = hookspec.processor(fn)
    assert hookspec.is_hookspec_processor(p) and not hookspec.is_hookspec_processor(fn)
    assert p.name == "fn" and hookspec.processor(p, name="other").name == "other"
    assert hookspec.processor(p) is p
    ctx = _ctx()
    assert p(ctx) is ctx.hidden_states
    with pytest.raises(ContractError, match="enable_output_processor"):
        p(hidden_states=ctx.hidden_states, labels=None)
    with pytest.raises(ContractError, match="callable"):
        hookspec.processor(3)  # type: ignore[arg-type]


def test_single_process_collectives_are_identities() -> None:
    coll = hookspec.SingleProcessCollectives()
    x = np.arange(3.0)
    assert (
        coll.all_reduce_sum(x) is x
        and coll.all_reduce_max(x) is x
        and coll.gather_hidden_states(x) is x
    )
    assert isinstance(coll, hookspec.Collectives)


def test_enum_values_match_the_documented_names() -> None:
    assert [k.value for k in hookspec.KLEstimator] == ["k1", "k2", "k3", "abs"]
    assert [a.value for a in hookspec.Aggregation] == [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "token-sum",
        "seq-mean-token-sum-norm",
    ]
    doc = hookspec.conventions.__doc__ or ""
    formulas = (
        "logsumexp(z / T)",
        "k3 = exp(log_ratio) - log_ratio - 1",
        "max(-A * ratio",
        "abs = |logp - ref|",
        "token-sum:           sum(L * M)",
        "M = M * keep;  pg = w * pg",
    )
    for formula in formulas:
        assert formula in doc


def test_upstream_hook_sources_partition_the_sixteen_keywords() -> None:
    groups = hookspec.UPSTREAM_HOOK_SOURCES
    flat = [k for group in groups for k in group]
    assert sorted(flat) == sorted(hookspec.UPSTREAM_HOOK_KEYWORDS) and len(flat) == 16
    assert groups.call[0] == "labels" and groups.call[-1] == "runtime_gather_output"
    assert groups.caller == ("context",) and groups.decoder == ("hidden_states",)


def test_every_upstream_field_is_documented() -> None:
    doc = OutputContext.__doc__ or ""
    for field in dataclasses.fields(OutputContext):
        assert f"        {field.name}: " in doc, field.name


def test_mtp_result_contract() -> None:
    loss = np.zeros((2, 8), np.float32)
    accepted = np.ones((2, 8), bool)
    assert hookspec.validate_mtp_result(loss, batch=2, seq=8)[1] is None
    got = hookspec.validate_mtp_result({"loss": loss, "accepted": accepted}, batch=2, seq=8)
    assert got[0] is loss and got[1] is accepted
    bad = [
        ({"logprobs": loss}, "mtp_processor result", "a mapping with a 'loss'"),
        (loss[:, :7], "mtp_processor result['loss']", "per-token shape [b=2, s=8]"),
        (
            {"loss": loss, "accepted": accepted[:1]},
            "mtp_processor result['accepted']",
            "[b=2, s=8]",
        ),
        ([0.0], "mtp_processor result['loss']", "an array [b, s]"),
        (np.zeros((2, 8), np.int64), "mtp_processor result['loss']", "a floating dtype"),
    ]
    for result, field, expected in bad:
        with pytest.raises(ContractError) as err:
            hookspec.validate_mtp_result(result, batch=2, seq=8)
        assert err.value.field == field and expected in str(err.value.expected), (field, err.value)


def test_collectives_recipe_runs_as_written() -> None:
    import doctest

    import hookspec.collectives

    result = doctest.testmod(hookspec.collectives, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 15 and result.failed == 0


def test_lazy_names_load_once_and_refuse_what_the_package_lacks() -> None:
    """``hookspec.lazy.LazyNames``, the one lazy ``__getattr__`` of ``torch_impl``,
    ``jax_ref`` and ``jax_ref.check``: a name loads from its module on first use and is
    bound in the package; an unknown name is an ``AttributeError`` naming the package."""
    import sys
    import types

    import pytest

    from hookspec.lazy import LazyNames

    pkg = types.ModuleType("lazy_pkg_for_test")
    lazy = LazyNames(pkg.__name__, {"dumps": "json", "Path": "pathlib"})
    pkg.__getattr__ = lazy.load  # type: ignore[method-assign]
    sys.modules[pkg.__name__] = pkg
    try:
        import json

        assert "dumps" not in vars(pkg)
        assert pkg.dumps is json.dumps and vars(pkg)["dumps"] is json.dumps  # bound: loaded once
        assert {"dumps", "Path"} <= set(lazy.names())
        with pytest.raises(
            AttributeError, match="module 'lazy_pkg_for_test' has no attribute 'nope'"
        ):
            pkg.nope  # noqa: B018
    finally:
        del sys.modules[pkg.__name__]


def test_the_tests_identity_collectives_have_exactly_the_methods_asked_for() -> None:
    """tests.support.identity_collectives: the tests that ask which methods a user's
    collectives has rely on the class having those and no more."""
    from tests.support.identity_collectives import OPTIONAL, REQUIRED

    methods = set(REQUIRED) | set(OPTIONAL)

    def has(cls: type) -> set[str]:
        return {m for m in methods if callable(getattr(cls(), m, None))}

    assert has(identity_collectives("Spec10")) == set(REQUIRED)
    assert has(identity_collectives("Gathers", "all_gather")) == {*REQUIRED, "all_gather"}
    assert identity_collectives("Echo")().all_reduce_max(3.5) == 3.5
    assert isinstance(identity_collectives("Checked")(), hookspec.Collectives)
    with pytest.raises(ValueError, match="all_reduce_min"):
        identity_collectives("Bad", "all_reduce_min")
