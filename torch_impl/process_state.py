"""The process state a tool (``python -m torch_impl.doctor``, ``hookcheck``) runs
under, and leaves as it found it when a caller runs it in process (a notebook, a
test, a training script under torchrun).

- :func:`tool_state`: the tool's own state inside (float32 default dtype, grad
  mode on, inference mode and autocast off, the CPU as default device), the
  caller's :class:`CallerState` put back afterwards, and every process group
  registered inside destroyed (:func:`process_groups_kept`);
- :func:`megatron_parallel`: ``torch.distributed`` (gloo on loopback) and
  Megatron's model-parallel groups for the length of a block, reusing a caller's
  and tearing down only what it made, the groups included (with the two groups
  Megatron's ``destroy_model_parallel`` leaves referenced: :func:`groups_left_released`);
- :func:`launcher_store` and :func:`rank_store`: the store a launcher holds for the
  ranks it starts, and a rank's client of it (``megatron_parallel(store=)``);
- :func:`known_noise_silenced`: the known import-time notices of Megatron Core
  and torch on a CPU, silenced by message, nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "KNOWN_LOG_RECORDS",
    "KNOWN_WARNINGS",
    "NOISE_NOTE",
    "CallerState",
    "callers_state_kept",
    "free_port",
    "group_globals",
    "groups_left_released",
    "known_noise_silenced",
    "launcher_store",
    "megatron_parallel",
    "process_groups_kept",
    "rank_store",
    "registered_process_groups",
    "tool_state",
]


@dataclasses.dataclass(frozen=True)
class CallerState:
    """A snapshot of what :func:`callers_state_kept` restores: the random number
    generators (torch CPU and initialised CUDA devices, Python's ``random``,
    NumPy's global one), torch's default dtype, default device and grad mode, and
    the environment variables (``MASTER_PORT`` and friends)."""

    torch_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...]
    python_rng: Any
    numpy_rng: Any
    default_dtype: torch.dtype
    default_device: torch.device
    grad_enabled: bool
    environ: dict[str, str]

    @classmethod
    def now(cls) -> CallerState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        numpy = sys.modules.get("numpy")
        return cls(
            torch_rng=torch.random.get_rng_state(),
            cuda_rng=tuple(cuda),
            python_rng=random.getstate(),
            numpy_rng=numpy.random.get_state() if numpy is not None else None,
            default_dtype=torch.get_default_dtype(),
            default_device=torch.get_default_device(),
            grad_enabled=torch.is_grad_enabled(),
            environ=dict(os.environ),
        )

    def restore(self) -> None:
        torch.random.set_rng_state(self.torch_rng)
        if self.cuda_rng:
            torch.cuda.set_rng_state_all(list(self.cuda_rng))
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        torch.set_default_dtype(self.default_dtype)
        if torch.get_default_device() != self.default_device:
            torch.set_default_device(self.default_device)
        torch.set_grad_enabled(self.grad_enabled)
        for name in set(os.environ) - set(self.environ):
            del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


@contextlib.contextmanager
def callers_state_kept() -> Iterator[CallerState]:
    """Run the body, then put back the state of :class:`CallerState` as it was."""
    state = CallerState.now()
    try:
        yield state
    finally:
        state.restore()


def registered_process_groups() -> list[Any]:
    """Every process group ``torch.distributed`` holds now (none where it is not
    initialised). Read from ``distributed_c10d._world.pg_map``, torch's registry,
    which has no public listing (torch 2.13)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return []
    return list(torch.distributed.distributed_c10d._world.pg_map)


@contextlib.contextmanager
def process_groups_kept() -> Iterator[None]:
    """Run the body; afterwards destroy every process group registered inside it.

    Megatron's ``destroy_model_parallel`` forgets its groups but leaves them
    registered, each with its sockets and threads: twenty-odd groups per
    ``initialize_model_parallel`` inside a caller's gloo group. Here a caller's
    default group and its other groups are kept; where the body made the default
    group and left it, ``destroy_process_group()`` ends it and every group with it.
    """
    had_default = torch.distributed.is_available() and torch.distributed.is_initialized()
    before = registered_process_groups()
    try:
        yield
    finally:
        if not had_default:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        else:
            for group in registered_process_groups():
                if not any(group is kept for kept in before):
                    torch.distributed.destroy_process_group(group)


@contextlib.contextmanager
def tool_state() -> Iterator[CallerState]:
    """Run a tool's checks under the tool's own state, and leave the caller's as found.

    Inside: default dtype float32, grad mode on, inference mode off, autocast off
    (CPU, and CUDA where there is one), default device the CPU, so that a caller
    inside ``torch.no_grad()``, ``torch.inference_mode()`` or with a float64
    default dtype gets the same verdict as any other. Afterwards: the caller's
    :class:`CallerState` and process groups (:func:`process_groups_kept`).
    Yields the caller's state, as found.
    """
    with callers_state_kept() as state, process_groups_kept(), contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        torch.set_default_dtype(torch.float32)
        if torch.get_default_device().type != "cpu":
            torch.set_default_device("cpu")
        yield state


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_store(world_size: int) -> torch.distributed.TCPStore:
    """A ``TCPStore`` server on a loopback port the OS picks, for ``world_size`` ranks this
    process then starts to meet at, each through :func:`rank_store` at its ``port``. The
    launcher holds the port from before the ranks start until it drops the store: a port
    chosen free (:func:`free_port`) and bound by rank 0 once started can be taken in between
    by another process, as a parallel test run's processes bind ports all the time."""
    return torch.distributed.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False
    )


def rank_store(port: int, world_size: int) -> torch.distributed.TCPStore:
    """A rank's client of the :func:`launcher_store` at ``port``, for
    ``megatron_parallel(store=)``."""
    return torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=False)


@contextlib.contextmanager
def megatron_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    rank: int = 0,
    world_size: int | None = None,
    port: int | None = None,
    backend: str = "gloo",
    vpp: int | None = None,
    store: torch.distributed.Store | None = None,
) -> Iterator[None]:
    """Initialise ``torch.distributed`` (gloo by default) on loopback and Megatron's
    model parallel groups (``tp`` x ``cp`` x ``pp`` ranks: tensor, context and
    pipeline parallel); tear both down on exit. One process per rank.
    ``vpp``: the virtual pipeline size (model chunks per pipeline rank).

    The group meets at ``tcp://127.0.0.1:port`` (a free port when ``port`` is
    ``None``), never at an inherited ``MASTER_ADDR``/``MASTER_PORT``: run under
    torchrun or Slurm, a tool such as ``hookcheck`` makes its own group without
    colliding with the caller's. One process (``world_size`` 1) with no ``port``
    given needs no rendezvous: its group is made over an in-memory store
    (``torch.distributed.HashStore``), no port at all, so that processes started
    side by side (test workers) cannot collide on one. ``store``: the ranks meet at
    this store instead of a port (as ``init_process_group(store=)``), a
    :func:`rank_store` of the :func:`launcher_store` that started them, say.

    The caller's state is left as found: a process group the caller initialised
    (of ``world_size`` ranks) is used and kept; Megatron's groups the caller
    initialised (of the same ``tp`` and ``pp``) are used and kept; only what this
    call made is torn down, the process groups Megatron registered for it
    included (:func:`process_groups_kept`). A caller's group or Megatron groups of
    other sizes raise ``RuntimeError`` (one process cannot hold two).
    """
    from megatron.core import parallel_state

    world_size = world_size or tp * pp * cp
    made_group = _join_process_group(world_size, rank=rank, port=port, backend=backend, store=store)
    made_state = _check_megatron_groups(parallel_state, tp, pp, cp, made_group=made_group)
    try:
        with process_groups_kept():
            held = group_globals(parallel_state)  # before: the caller's (or none)
            try:
                if made_state:
                    parallel_state.initialize_model_parallel(
                        tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=pp,
                        virtual_pipeline_model_parallel_size=vpp,
                        context_parallel_size=cp,
                    )
                yield
            finally:
                if made_state:
                    parallel_state.destroy_model_parallel()
                    groups_left_released(parallel_state, held)
    finally:
        if made_group:
            torch.distributed.destroy_process_group()


def _join_process_group(
    world_size: int,
    *,
    rank: int,
    port: int | None,
    backend: str,
    store: torch.distributed.Store | None,
) -> bool:
    """:func:`megatron_parallel`'s process group: the caller's (of ``world_size`` ranks,
    else ``RuntimeError``), or one made here; whether it was made here."""
    if store is not None and port is not None:
        raise ValueError(
            f"megatron_parallel: port={port} and store={store!r} given; the ranks meet at one "
            "of them, expected port=None with a store"
        )
    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != world_size:
            raise RuntimeError(
                "megatron_parallel: the caller's process group has "
                f"{torch.distributed.get_world_size()} ranks, {world_size} asked; run this in "
                "a process of its own"
            )
        return False
    if store is not None:
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    elif world_size == 1 and port is None:  # one process meets no one: no port to collide on
        torch.distributed.init_process_group(
            backend, store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    else:
        port = free_port() if port is None else port
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    return True


def _check_megatron_groups(
    parallel_state: Any, tp: int, pp: int, cp: int, *, made_group: bool
) -> bool:
    """Whether :func:`megatron_parallel` makes Megatron's groups: none are there, or they
    are stale (there without a process group: destroyed here); the caller's of other
    sizes raise ``RuntimeError``, the caller's of these sizes are used and kept."""
    if not parallel_state.model_parallel_is_initialized():
        return True
    if made_group:  # Megatron groups without a process group: stale, not the caller's
        parallel_state.destroy_model_parallel()
        return True
    sizes = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )
    if sizes != (tp, pp, cp):
        raise RuntimeError(
            f"megatron_parallel: the caller's Megatron groups are tp={sizes[0]}, "
            f"pp={sizes[1]}, cp={sizes[2]}; tp={tp}, pp={pp}, cp={cp} asked"
        )
    return False


def _holds_group(value: Any) -> bool:
    group = getattr(torch.distributed, "ProcessGroup", None)
    if group is None:  # a torch built without distributed
        return False
    if isinstance(value, group):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, group) for v in value)


def group_globals(module: Any) -> dict[str, Any]:
    """The globals of ``module`` that hold a process group (or a list of them), by
    name: the enumeration :func:`groups_left_released` compares against."""
    return {name: value for name, value in vars(module).items() if _holds_group(value)}


def groups_left_released(module: Any, before: dict[str, Any]) -> list[str]:
    """Put back, as they were before ``initialize_model_parallel``, the globals of
    Megatron's ``parallel_state`` (``module``) that still hold a process group after
    ``destroy_model_parallel``; returns their names.

    Megatron Core 0.16.1 and 0.19.2 set ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``
    and ``..._WITH_CP_GLOO`` (aliases of the data-parallel groups with one optimizer
    instance) and never reset them (``docs/upstream.md``, report 7). Each keeps a gloo
    group alive: a listening socket and its threads, for the life of the process.
    Destroying the group (``torch.distributed.destroy_process_group``, done already
    by :func:`process_groups_kept`) takes it out of torch's registry but frees
    nothing while a reference remains, and no Megatron API resets these two: the
    reference itself must go. The names are found by enumeration (every global that
    holds a group now and did not hold that group before), not by a list, so a
    release that leaves other groups behind is covered, and one that fixes its
    ``destroy_model_parallel`` finds nothing to do.

    This is the one place the project writes Megatron's module state, and only to
    put back the value the caller had (None, for a process that never initialised
    Megatron): it changes no behaviour of Megatron's, it finishes the teardown that
    ``destroy_model_parallel`` documents ("Set the groups to none"). A later
    ``initialize_model_parallel`` would overwrite them either way."""
    left = [
        name
        for name, value in group_globals(module).items()
        if name not in before or before[name] is not value
    ]
    for name in left:
        setattr(module, name, before.get(name))  # the caller's value: None where it had none
    return left


KNOWN_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # megatron.core at import, where neither is installed; the CPU checks use neither
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"Apex is not installed", UserWarning),
    # megatron-core 0.19.2, every TransformerConfig: its own default cuda_graph_scope is the
    # deprecated one
    (r"full scope is deprecated", UserWarning),
)
"""The warnings the tools silence, by message: nothing else."""

KNOWN_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    # torch, when it looks for CUDA on a CPU-only machine
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    # megatron-core 0.19 logs this once per GPTModel built: the tools' models are GPTModels
    # on purpose
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
)
"""The log records the tools drop, by logger and message start: nothing else."""

NOISE_NOTE = (
    "Megatron Core's notices that Transformer Engine and Apex are absent (the CPU checks use "
    "neither), its GPTModel and CUDA-graph-scope deprecation notices and torch's 'No CUDA runtime' "
    "line are silenced"
)
"""What :func:`known_noise_silenced` silences, in words, for a tool to print."""


class _DropRecords(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def known_noise_silenced() -> Iterator[None]:
    """Silence :data:`KNOWN_WARNINGS` and :data:`KNOWN_LOG_RECORDS` inside; the
    warning filters and loggers are as they were afterwards."""
    filters = [
        (logging.getLogger(name), _DropRecords(prefix)) for name, prefix in KNOWN_LOG_RECORDS
    ]
    with warnings.catch_warnings():
        for message, category in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for logger, f in filters:
            logger.addFilter(f)
        try:
            yield
        finally:
            for logger, f in filters:
                logger.removeFilter(f)
