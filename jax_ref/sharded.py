"""A reference under ``shard_map``: the vocabulary split over a device mesh axis.

``shard_reference(reference, mesh)`` runs ``reference(hidden, weight_shard,
inputs)`` on every device of the mesh axis ``"tp"`` with the weight split by
rows (``P("tp", None)``) and the hidden states replicated, the way tensor
parallelism splits Megatron's output layer. Inside, ``inputs.vocab_start`` is
``axis_index * V_local`` and ``inputs.collectives`` is a
:class:`~jax_ref.JaxCollectives`, so a reference written with the contract's
recipe reduces across shards exactly as the torch processor does across ranks::

    with jax_ref.float64():
        f = shard_reference(reference, vocab_mesh(2))
        out, vjp = jax.vjp(lambda h, w: f(h, w, inputs), hidden, weight_full)
        dh, dw = vjp(cotangent)   # dh whole (psum'd), dw [V, h]: rank r owns rows r*V/2...

On a CPU the mesh needs virtual devices, set before JAX starts::

    XLA_FLAGS=--xla_force_host_platform_device_count=2
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hookspec import ContractError

from .collectives import JaxCollectives
from .inputs import ReferenceInputs

__all__ = ["DEVICE_COUNT_FLAG", "shard_map", "shard_reference", "vocab_mesh"]

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def shard_map(
    f: Callable[..., Any], /, *, mesh: Mesh, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
    """``jax.shard_map`` (jax >= 0.7), else ``jax.experimental.shard_map.shard_map``."""
    native = getattr(jax, "shard_map", None)
    if native is not None:
        return native(  # type: ignore[no-any-return]
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs
        )
    from jax.experimental.shard_map import shard_map as experimental  # pragma: no cover

    return experimental(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)  # pragma: no cover


def vocab_mesh(size: int, /, *, axis_name: str = "tp") -> Mesh:
    """A 1-D mesh of the first ``size`` devices along ``axis_name``."""
    devices = jax.devices()
    if len(devices) < size:
        raise ContractError(
            "devices",
            expected=f"at least {size} JAX devices for a {size}-way vocab mesh",
            actual=f"{len(devices)} ({devices[0].platform})",
            hint=f"On a CPU set XLA_FLAGS={DEVICE_COUNT_FLAG}={size} before JAX starts",
        )
    return Mesh(np.array(devices[:size]), (axis_name,))


def shard_reference(
    reference: Callable[..., Any],
    mesh: Mesh,
    /,
    *,
    axis_name: str = "tp",
) -> Callable[[jax.Array, jax.Array, ReferenceInputs], Any]:
    """``reference`` with its weight split by rows over ``mesh.shape[axis_name]`` shards.

    Returns ``f(hidden [s, b, h], weight [V, h], inputs) -> outputs``, outputs
    replicated. ``V`` must divide evenly.
    """
    size = mesh.shape[axis_name]

    def run(hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs) -> Any:
        if weight.shape[0] % size:
            raise ContractError(
                "weight",
                expected=f"rows divisible by {size} shards",
                actual=f"{weight.shape[0]} rows",
            )

        replicated = NamedSharding(mesh, PartitionSpec())
        put = _map_arrays(lambda a: jax.device_put(a, replicated), inputs)

        def body(h: jax.Array, w: jax.Array) -> Any:
            local = put.replace(
                vocab_start=lax.axis_index(axis_name) * w.shape[0],
                collectives=JaxCollectives(axis_name),
            )
            return reference(h, w, local)

        spec_w = PartitionSpec(axis_name, None)
        mapped = jax.jit(
            shard_map(
                body, mesh=mesh, in_specs=(PartitionSpec(), spec_w), out_specs=PartitionSpec()
            )
        )
        hidden = jax.device_put(hidden, replicated)
        weight = jax.device_put(weight, NamedSharding(mesh, spec_w))
        try:
            return mapped(hidden, weight)
        except ValueError as exc:
            if "vma" not in str(exc) and "varying" not in str(exc) and "replicat" not in str(exc):
                raise
            raise ContractError(
                "reference result",
                expected="values replicated over the vocab shards",
                actual="values that vary by shard",
                hint="A vocab-parallel reference must reduce across shards with inputs.collectives "
                "(all_reduce_sum / all_reduce_max) and offset labels by inputs.vocab_start",
            ) from None

    return run


def _map_arrays(fn: Callable[[jax.Array], jax.Array], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every JAX array in it (dataclasses,
    namespaces, mappings, tuples and lists are walked)."""
    if isinstance(obj, jax.Array):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _map_arrays(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init
        }
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, types.SimpleNamespace):
        return types.SimpleNamespace(**{k: _map_arrays(fn, v) for k, v in vars(obj).items()})
    if isinstance(obj, Mapping):
        return {k: _map_arrays(fn, v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_arrays(fn, v) for v in obj)
    return obj
