"""veRL 0.9.1's own policy-loss and rollout-correction functions, as the tests' oracle.

veRL is installed without its dependencies (``requirements/verl-oracle.txt``, installed
``--no-deps`` by ``scripts/setup_env.sh``): its package ``__init__`` files import Ray,
transformers and the rest, so the three modules the tests call are loaded from their files
(``verl/utils/torch_functional.py``, ``verl/trainer/ppo/core_algos.py``,
``verl/trainer/ppo/rollout_corr_helper.py``) with the names they import but these functions
never call stood in by empty placeholders. Every function called is veRL's own code.
``sys.modules`` is put back as it was after loading.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VERSION = "0.9.1"

# module name -> the attributes imported from it that no called function uses
_STAND_INS: dict[str, tuple[str, ...]] = {
    "verl": (),
    "verl.utils": ("as_torch_index", "group_mean_std"),
    "verl.utils.device": ("get_device_name", "get_torch_device"),
    "verl.utils.import_utils": ("deprecated",),
    "verl.trainer": (),
    "verl.trainer.ppo": (),
    "verl.trainer.config": ("AlgoConfig",),
    "verl.trainer.config.algorithm": ("RolloutCorrectionConfig",),
    "verl.workers": (),
    "verl.workers.config": ("ActorConfig",),
    "verl.workers.config.actor": ("PolicyLossConfig",),
    "verl.protocol": ("DataProto",),
    "omegaconf": ("DictConfig",),
    "tensordict": ("TensorDict",),
    "transformers": ("PreTrainedTokenizer",),
}


def _placeholder(name: str) -> Any:
    if name == "deprecated":
        return lambda *_a, **_k: lambda fn: fn
    if name == "DataProto":
        return _DataProto
    if name == "ActorConfig":  # the losses that assert isinstance(config, ActorConfig)
        return ActorConfig
    return type(name, (), {})


class _DataProto:
    """The one use the rollout helper makes of ``DataProto``: a holder of tensors."""

    def __init__(self, batch: dict[str, Any]) -> None:
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict[str, Any]) -> _DataProto:
        return cls(dict(tensors))


def _verl_root() -> Path:
    spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"veRL {VERSION} is not installed: pip install --no-deps verl=={VERSION} "
            "(requirements/verl-oracle.txt)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@contextmanager
def _stand_ins() -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in _STAND_INS}
    for name, attributes in _STAND_INS.items():
        module = types.ModuleType(name)
        module.__path__ = []  # a package: its submodules stand in too
        for attribute in attributes:
            setattr(module, attribute, _placeholder(attribute))
        sys.modules[name] = module
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load(root: Path, name: str, relative: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, root / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load() -> types.SimpleNamespace:
    """``torch_functional``, ``core_algos`` and ``rollout_corr_helper`` of veRL 0.9.1."""
    from importlib.metadata import version

    if version("verl") != VERSION:
        raise ImportError(f"the oracle is veRL {VERSION}; installed: {version('verl')}")
    root = _verl_root()
    loaded = {}
    with _stand_ins():
        functional = _load(root, "verl.utils.torch_functional", "utils/torch_functional.py")
        sys.modules["verl.utils"].torch_functional = functional  # type: ignore[attr-defined]
        loaded["torch_functional"] = functional
        loaded["core_algos"] = _load(
            root, "verl.trainer.ppo.core_algos", "trainer/ppo/core_algos.py"
        )
        loaded["rollout_corr_helper"] = _load(
            root, "verl.trainer.ppo.rollout_corr_helper", "trainer/ppo/rollout_corr_helper.py"
        )
        for name in loaded:
            sys.modules.pop(f"verl.utils.{name}", None)
            sys.modules.pop(f"verl.trainer.ppo.{name}", None)
    return types.SimpleNamespace(**loaded)


@contextmanager
def importable(oracle: types.SimpleNamespace) -> Iterator[None]:
    """The loaded modules (and the stand-ins) in ``sys.modules`` for the length of a call:
    ``compute_policy_loss_bypass_mode`` imports the rollout helper when it runs."""
    names = {
        "verl.utils.torch_functional": oracle.torch_functional,
        "verl.trainer.ppo.core_algos": oracle.core_algos,
        "verl.trainer.ppo.rollout_corr_helper": oracle.rollout_corr_helper,
    }
    saved = {name: sys.modules.get(name) for name in names}
    with _stand_ins():
        sys.modules.update(names)
        try:
            yield
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


class ActorConfig(dict):  # type: ignore[type-arg]
    """The actor config veRL's loss functions read: attributes and ``.get`` of one mapping,
    ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error


def rollout_kwargs(config: Any) -> dict[str, Any]:
    """A ``torch_impl.processors.RolloutCorrection`` in the keywords of veRL's
    ``compute_rollout_correction_and_rejection_mask`` (its ``rollout_rs_threshold`` string:
    ``lower_upper`` for a k1 statistic, the upper bound for the others)."""
    lower, upper = config.rollout_is_threshold_lower, config.rollout_is_threshold
    rs = dict(config.rollout_rs)

    def spec(name: str) -> str:
        bounds = rs[name]
        return f"{bounds.lower!r}_{bounds.upper!r}" if name.endswith("k1") else repr(bounds.upper)

    return {
        "rollout_is": None if config.rollout_is is None else str(config.rollout_is),
        "rollout_is_threshold": upper if lower is None else f"{lower!r}_{upper!r}",
        "rollout_is_batch_normalize": config.rollout_is_batch_normalize,
        "rollout_rs": ",".join(rs) or None,
        "rollout_rs_threshold": ",".join(spec(name) for name in rs) or None,
    }


__all__ = ["VERSION", "ActorConfig", "importable", "load", "rollout_kwargs"]
