"""``torch_impl.tiny``, the tiny CPU GPT that the quickstart, the examples, the tools and
the tests build on: a supported entry point, apart from test support.

Pipeline parallel: each stage holds the unpipelined model's tensors, checked with two
gloo ranks in ``tests/hook/test_enable_pp.py`` (a stage against pp=1, and the first
micro-batch's values and gradients) and ``tests/hook/test_schedules.py`` (1F1B, tied
embeddings, interleaved chunks), without copying weights.
"""

from __future__ import annotations

import ast
import doctest
import pathlib

import pytest
import torch

import torch_impl.process_state as process_state
import torch_impl.testing.tiny as support
import torch_impl.tiny as tiny

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_module_imports_no_test_support() -> None:
    tree = ast.parse((ROOT / "torch_impl" / "tiny.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if "testing" in m], imported


def test_test_support_re_exports_the_same_objects() -> None:
    assert support.__all__ == tiny.__all__
    assert all(getattr(support, name) is getattr(tiny, name) for name in tiny.__all__)


def test_the_docstring_example_runs() -> None:
    failed, attempted = doctest.testmod(tiny, optionflags=doctest.ELLIPSIS)
    assert attempted == 3 and failed == 0


@pytest.mark.usefixtures("megatron_single")
def test_same_seed_same_weights_and_the_callers_rng_left_as_found() -> None:
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    a = tiny.build_tiny_gpt()
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG, as found
    b = tiny.build_tiny_gpt()
    c = tiny.build_tiny_gpt(seed=1235)
    sa, sb, sc = (m.state_dict() for m in (a, b, c))
    weights = [k for k in sa if "_extra_state" not in k]
    assert all(torch.equal(sa[k], sb[k]) for k in weights)
    assert not torch.equal(
        sa["decoder.layers.0.mlp.linear_fc1.weight"], sc["decoder.layers.0.mlp.linear_fc1.weight"]
    )


def test_one_process_takes_no_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process group meets over an in-memory store: nothing to collide on when
    test workers start side by side (it took a free TCP port and could lose it)."""

    def no_port() -> int:
        raise AssertionError("a one-process group asked for a port")

    monkeypatch.setattr(process_state, "free_port", no_port)
    with tiny.megatron_parallel():
        x = torch.ones(2)
        torch.distributed.all_reduce(x)
        assert torch.distributed.get_world_size() == 1 and torch.equal(x, torch.ones(2))
    assert not torch.distributed.is_initialized()


def test_ranks_meet_at_a_given_store_and_a_port_beside_it_is_refused() -> None:
    store = torch.distributed.HashStore()
    with tiny.megatron_parallel(store=store):
        assert torch.distributed.get_world_size() == 1
    assert store.num_keys() > 0  # the group met there
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"port=29500 and store=.*expected port=None"):
        with tiny.megatron_parallel(store=store, port=29500):
            pass
    assert not torch.distributed.is_initialized()


def _sum_of_ranks(rank: int) -> None:
    x = torch.tensor([float(rank)])
    torch.distributed.all_reduce(x)
    assert x.item() == 1.0


def test_test_ranks_meet_at_the_parents_store_not_a_port_freed_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port chosen free and bound by rank 0 only once started could be taken in between
    by a parallel test's process: the parent holds the ranks' store from the start."""
    from tests.support.distributed import run_distributed

    def no_port() -> int:
        raise AssertionError("the test's ranks were given a port to bind later")

    monkeypatch.setattr(process_state, "free_port", no_port)
    monkeypatch.setattr(support, "free_port", no_port)
    run_distributed(_sum_of_ranks, tp=2)
