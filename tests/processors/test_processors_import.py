"""``torch_impl.processors`` imports with torch alone: no Megatron Core in
``sys.modules`` after importing it and running ``linear_logprobs`` on CPU
tensors; ``torch_impl``'s public names load on first use (PEP 562)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import torch_impl

_MEGATRON = "sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))"


def _modules_after(code: str) -> list[str]:
    script = f"import sys, json\n{code}\nprint(json.dumps({_MEGATRON}))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.release_independent  # our import graph, not Megatron's
def test_importing_the_processors_imports_no_megatron() -> None:
    assert _modules_after("import torch_impl.processors") == []


@pytest.mark.release_independent  # our import graph, not Megatron's
def test_running_linear_logprobs_on_cpu_imports_no_megatron() -> None:
    code = (
        "import torch\n"
        "from torch_impl.processors import linear_logprobs, selected_logprobs, policy_loss\n"
        "g = torch.Generator().manual_seed(0)\n"
        "h, w = torch.randn(6, 4, generator=g), torch.randn(10, 4, generator=g)\n"
        "y = torch.tensor([0, 3, 9, -100, 2, 5])\n"
        "r = linear_logprobs(h.requires_grad_(), w, y, with_entropy=True)\n"
        "r.logprobs.sum().backward()\n"
        "assert torch.isfinite(h.grad).all()\n"
        "selected_logprobs(entropy=True); policy_loss()\n"
    )
    assert _modules_after(code) == []


@pytest.mark.release_independent  # our import graph, not Megatron's
def test_the_package_itself_loads_megatron_only_when_a_name_is_used() -> None:
    assert _modules_after("import torch_impl") == []
    assert "megatron.core" in _modules_after(
        "import torch_impl; torch_impl.enable_output_processor"
    )


def test_every_public_name_resolves_and_is_listed_once() -> None:
    assert sorted(torch_impl.__all__) == sorted(set(torch_impl.__all__))
    for name in torch_impl.__all__:
        assert getattr(torch_impl, name) is not None, name
    assert set(dir(torch_impl)) >= set(torch_impl.__all__)
    try:
        torch_impl.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
