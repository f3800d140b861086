"""A tool run in process leaves the caller's state as it found it: the process
group, Megatron's ``parallel_state``, the RNG states, the default dtype, grad
mode, environment variables, warning filters and loggers; and everything it
creates, it destroys: process groups, and with them file descriptors and threads.
Its checks run under their own state, whatever the caller's.

``doctor.run_checks`` and an in-process ``hookcheck.main`` used to destroy the
caller's process group (``torch.distributed.is_initialized()`` was False after).
Inside a caller's gloo group, one ``doctor.main([])`` then took the caller from 1
to 161 registered process groups (38 to 665 open file descriptors, 14 to 490
threads) and one ``hookcheck.main()`` added 20 groups: Megatron's
``destroy_model_parallel`` forgets its groups but leaves them registered. Under
``torch.no_grad()``, ``torch.inference_mode()`` or a float64 default dtype the
doctor reported the hook broken and hookcheck blamed a correct processor.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from torch_impl import doctor
from torch_impl.process_state import (
    CallerState,
    free_port,
    group_globals,
    groups_left_released,
    megatron_parallel,
    registered_process_groups,
)


@pytest.fixture
def callers_group() -> Iterator[Any]:
    """The caller's own gloo group (world size 1), as a notebook or a test has it."""
    assert not torch.distributed.is_initialized()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield torch.distributed.group.WORLD
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _snapshot() -> dict[str, Any]:
    return {
        "torch_rng": torch.random.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "environ": dict(os.environ),
        "warning_filters": list(warnings.filters),
        "megatron_log_level": logging.getLogger("megatron").level,
        "megatron_core_log_level": logging.getLogger("megatron.core").level,
        "distributed_log_level": logging.getLogger("torch.distributed").level,
    }


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert torch.equal(before["torch_rng"], after["torch_rng"]), "torch RNG state changed"
    assert before["python_rng"] == after["python_rng"], "random's state changed"
    assert np.array_equal(before["numpy_rng"], after["numpy_rng"]), "numpy's RNG state changed"
    for key in ("dtype", "grad", "environ", "warning_filters"):
        assert before[key] == after[key], key
    for key in ("megatron_log_level", "megatron_core_log_level", "distributed_log_level"):
        assert before[key] == after[key], key


def test_megatron_parallel_keeps_the_callers_process_group(callers_group: Any) -> None:
    with megatron_parallel():
        assert parallel_state.model_parallel_is_initialized()
        assert torch.distributed.group.WORLD is callers_group
    assert torch.distributed.is_initialized(), "the caller's group was destroyed"
    assert torch.distributed.group.WORLD is callers_group
    assert not parallel_state.model_parallel_is_initialized(), "ours, torn down"


def test_megatron_parallel_keeps_the_callers_megatron_groups(callers_group: Any) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    with megatron_parallel():
        assert parallel_state.get_tensor_model_parallel_group() is tp_group
    assert parallel_state.model_parallel_is_initialized()
    assert parallel_state.get_tensor_model_parallel_group() is tp_group
    assert torch.distributed.is_initialized()


def test_megatron_parallel_of_another_size_inside_a_callers_group_is_refused(
    callers_group: Any,
) -> None:
    with pytest.raises(RuntimeError, match="caller's process group has 1 ranks, 2 asked"):
        with megatron_parallel(tp=2):
            pass
    assert torch.distributed.is_initialized()


def test_megatron_parallel_alone_tears_down_what_it_made() -> None:
    with megatron_parallel():
        assert torch.distributed.is_initialized()
    assert not torch.distributed.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()


def _meddling_check() -> None:
    """A check that changes every piece of state the tools promise to keep."""
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["MASTER_PORT"] = "1"
    os.environ["HOOKSPEC_TOOL_STATE_TEST"] = "set by a check"


@pytest.mark.parametrize("with_group", [True, False], ids=["caller-group", "no-group"])
def test_doctor_run_checks_leaves_the_callers_state(
    request: pytest.FixtureRequest, with_group: bool
) -> None:
    if with_group:
        request.getfixturevalue("callers_group")
    before = _snapshot()
    checks = [next(iter(doctor.default_checks())), ("meddles", _meddling_check)]
    results = doctor.run_checks(checks)
    assert [r.status for r in results] == ["pass", "pass"], results
    _assert_same(before, _snapshot())
    assert torch.distributed.is_initialized() == with_group


def test_hookcheck_main_leaves_the_callers_state(callers_group: Any) -> None:
    from jax_ref.check.hookcheck import main

    before = _snapshot()
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "--quiet", "--dtype", "float32", "--case", "masked",
        "--processor", "jax_ref.check.examples:token_mean_loss",
        "--reference", "jax_ref.check.examples:token_mean_loss_reference",
    ]  # fmt: skip
    assert main(argv, out=out, err=err) == 0, out.getvalue() + err.getvalue()
    assert torch.distributed.is_initialized(), "hookcheck destroyed the caller's group"
    assert torch.distributed.group.WORLD is callers_group
    _assert_same(before, _snapshot())


def test_caller_state_restores_what_it_saved() -> None:
    before = _snapshot()
    state = CallerState.now()
    _meddling_check()
    state.restore()
    _assert_same(before, _snapshot())


def _resources() -> dict[str, int]:
    """What a leak grows: registered process groups, open file descriptors, threads."""
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    return {"groups": len(registered_process_groups()), "fds": fds, "threads": threads}


def test_megatron_parallel_destroys_the_groups_it_registers_in_a_callers_group(
    callers_group: Any,
) -> None:
    before = _resources()
    for _ in range(3):
        with megatron_parallel():
            assert len(registered_process_groups()) > before["groups"]
    assert _resources()["groups"] == before["groups"] == 1


def test_doctor_destroys_every_group_it_creates_in_a_callers_group(callers_group: Any) -> None:
    checks = [next(iter(doctor.default_checks()))]
    groups = _resources()["groups"]
    assert [r.status for r in doctor.run_checks(checks)] == ["pass"]
    warm = _resources()  # after one run: imports, torch's thread pools, made once per process
    assert warm["groups"] == groups == 1
    assert [r.status for r in doctor.run_checks(checks)] == ["pass"]
    assert _resources() == warm


@contextlib.contextmanager
def _caller_float64() -> Iterator[None]:
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


CALLER_STATES = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "float64_default": _caller_float64,
    "bf16_autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


@pytest.mark.parametrize("state", list(CALLER_STATES))
def test_doctor_checks_run_under_their_own_state(state: str) -> None:
    """The caller's grad mode, inference mode, default dtype or autocast used to
    fail every check ("0 passed, 6 failed")."""
    checks = [c for c in doctor.default_checks() if not c[0].startswith("GPU:")][:3]
    with CALLER_STATES[state]():
        inside = (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.get_default_dtype(),
        )
        results = doctor.run_checks(checks)
        assert (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.get_default_dtype(),
        ) == inside
    assert [r.status for r in results] == ["pass"] * 3, results


HOOKCHECK_ARGV = [
    "--quiet", "--dtype", "float32", "--no-synthetic",
    "--processor", "jax_ref.check.examples:token_mean_loss",
    "--reference", "jax_ref.check.examples:token_mean_loss_reference",
]  # fmt: skip


@pytest.mark.parametrize("state", ["inference_mode", "float64_default"])
def test_hookcheck_runs_under_its_own_state(state: str) -> None:
    """Under a float64 default dtype or inside ``torch.inference_mode()`` hookcheck
    returned 2 and blamed a correct built-in processor."""
    from jax_ref.check.hookcheck import main

    out, err = io.StringIO(), io.StringIO()
    with CALLER_STATES[state]():
        code = main(HOOKCHECK_ARGV, out=out, err=err)
    assert code == 0, out.getvalue() + err.getvalue()


def test_hookcheck_destroys_every_group_it_creates_in_a_callers_group(callers_group: Any) -> None:
    from jax_ref.check.hookcheck import main

    groups = _resources()["groups"]
    out, err = io.StringIO(), io.StringIO()
    assert main(HOOKCHECK_ARGV, out=out, err=err) == 0, out.getvalue() + err.getvalue()
    warm = _resources()
    assert warm["groups"] == groups == 1
    assert main(HOOKCHECK_ARGV, out=out, err=err) == 0, out.getvalue() + err.getvalue()
    assert _resources() == warm


def _listening_sockets() -> int:
    """This process's listening TCP sockets (``/proc/net/tcp*`` state 0A, by inode)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                listening |= {
                    line.split()[9] for line in f.read().splitlines()[1:] if line.split()[3] == "0A"
                }
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[8:-1])
    return len(listening & mine)


def _groups_alive() -> dict[str, Any]:
    """Everything a gloo group left alive shows as: listening sockets, threads,
    registered groups, and Megatron's globals that hold one (enumerated). Garbage is
    collected first: an earlier test file's unreachable groups (the same worker process)
    would otherwise count before and be freed during the tool's run, whenever the
    collector runs; a group the tool leaves referenced survives the collection."""
    gc.collect()
    return {
        "listening": _listening_sockets(),
        "threads": len(os.listdir("/proc/self/task")),
        "registered": len(registered_process_groups()),
        "megatron globals": sorted(group_globals(parallel_state)),
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_doctor_leaves_no_gloo_group_alive_in_a_callers_group(callers_group: Any) -> None:
    """The first run too (a steady state hid it: each run freed the last run's). Before
    the fix: 2 listening sockets, 6 threads, held by parallel_state's
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and ``..._WITH_CP_GLOO``, which
    ``destroy_model_parallel`` does not reset (0.16.1 and 0.19.2)."""
    # an earlier test's own initialise/destroy (a caller's, not a tool's) leaves the two
    # groups referenced: release them first, so that what the doctor leaves shows
    groups_left_released(parallel_state, {})
    with megatron_parallel():  # the imports and torch's pools, made once per process
        pass
    torch.distributed.destroy_process_group()  # the warm-up's groups left alive, if any, go with it
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    before = _groups_alive()
    assert before["megatron globals"] == [] and before["registered"] == 1
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        doctor.main([])
    assert _groups_alive() == before
