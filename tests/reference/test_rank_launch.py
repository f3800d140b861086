"""``hookcheck``'s ranks (``--tp``, ``--cp``) start from one spawned process that imports
torch and Megatron once and forks them (``jax_ref.check.gpt_cases.spawn_ranks``): each
rank used to be spawned and import them anew, about 10 s of CPU a rank. These tests hold
what the spawned ranks gave: every rank reports, a rank that dies or hangs is named, and
nothing is left running after a failure.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jax_ref.check.gpt_cases import spawn_ranks


def _report(rank: int, world: int, port: int, payload: Any, results: Any) -> None:
    # what the rank found on arrival: the launcher's imports, its parent, the payload
    preloaded = "megatron.core" in sys.modules and "torch_impl.process_state" in sys.modules
    results.put((rank, "ok", (world, port > 0, payload, os.getppid(), os.getpid(), preloaded)))


def _rank_one_dies(rank: int, world: int, port: int, payload: Any, results: Any) -> None:
    if rank == 1:
        os._exit(3)
    results.put((rank, "ok", rank))


def _hang(rank: int, world: int, port: int, payload: Any, results: Any) -> None:
    time.sleep(120)


def _rank_zero_fails_while_one_hangs(
    rank: int, world: int, port: int, payload: Any, results: Any
) -> None:
    pid_file = Path(payload, "rank1.pid")
    if rank == 1:
        pid_file.write_text(str(os.getpid()))
        time.sleep(120)
    while not pid_file.exists():
        time.sleep(0.05)
    results.put((rank, "error", ("ValueError: planted", "")))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone


pytestmark = pytest.mark.release_independent  # multiprocessing's, not Megatron's


def test_every_rank_reports_from_one_launcher_that_imported_megatron() -> None:
    got = spawn_ranks(_report, 3, {"case": 1}, timeout_s=120, what="test")
    assert sorted(got) == [0, 1, 2]
    parents = {got[r][3] for r in got}
    assert len(parents) == 1 and os.getpid() not in parents  # one launcher, not the caller
    assert len({got[r][4] for r in got}) == 3
    for r in got:
        world, port_set, payload, _, _, preloaded = got[r]
        assert (world, port_set, payload, preloaded) == (3, True, {"case": 1}, True)
    assert multiprocessing.active_children() == []


def test_a_rank_that_dies_before_reporting_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"^rank 1 of 2 exited with code 3 before reporting$"):
        spawn_ranks(_rank_one_dies, 2, None, timeout_s=120, what="test")
    assert multiprocessing.active_children() == []


def test_a_run_past_its_timeout_is_named_and_ends() -> None:
    with pytest.raises(RuntimeError, match=r"^test run timed out after 2 s$"):
        spawn_ranks(_hang, 2, None, timeout_s=2, what="test")
    assert multiprocessing.active_children() == []


def test_a_failed_rank_ends_the_run_and_no_rank_is_left_running(tmp_path: Path) -> None:
    """Rank 0 fails while rank 1 hangs (as in a collective the failed rank never joins):
    the failure is raised at once, and rank 1, forked by the launcher, is ended with it."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 0 of 2 failed: ValueError: planted\n"):
        spawn_ranks(_rank_zero_fails_while_one_hangs, 2, str(tmp_path), timeout_s=120, what="t")
    assert time.monotonic() - started < 100  # not the timeout, nor rank 1's sleep
    pid = int(tmp_path.joinpath("rank1.pid").read_text())
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    assert multiprocessing.active_children() == []
