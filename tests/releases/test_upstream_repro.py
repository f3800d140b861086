"""The reproduction scripts of docs/upstream.md still reproduce on the pinned releases.

Each script under ``scripts/repro/`` runs on a CPU with torch and megatron-core only
and prints one JSON line whose ``defect`` says whether the Megatron defect showed.
Here each runs on this environment's release, in a process forked from one that has
imported torch and megatron.core only (what a fresh interpreter running it does first), and
the test asserts what docs/upstream.md says of that release: when a release fixes a defect
(or starts to show one), this test fails and the document is re-read, so it cannot go stale
silently.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASE = importlib.metadata.version("megatron-core")

# script -> {pinned release: the defect shows}; the releases of the two environments.
EXPECTED: dict[str, dict[str, bool]] = {
    "final_norm_schedule_plan.py": {"0.16.1": True, "0.19.2": True},
    "tp_reduce_noncontiguous_grad.py": {"0.16.1": True, "0.19.2": False},
    "moe_router_without_te.py": {"0.16.1": True, "0.19.2": False},
    "interleaved_gloo_batch_p2p.py": {"0.16.1": True, "0.19.2": True},
    "plan_mtp_overwrites_input_ids.py": {"0.16.1": True, "0.19.2": True},
    # the function is newer than both releases: shown on Megatron-LM main only (report 6)
    "mtp_layer_without_te.py": {"0.16.1": False, "0.19.2": False},
    "destroy_model_parallel_leaves_groups.py": {"0.16.1": True, "0.19.2": True},
}


# A script runs in a process forked from one that has imported torch and megatron.core and
# nothing else (each script's first imports): as a fresh interpreter would run it, without
# the ~10 s of CPU those imports take in each.
_SERVER = r"""
import os, runpy, sys, traceback
import torch, megatron.core
for line in sys.stdin:
    script, out, err = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv, code = [script], 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[subprocess.Popen[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    with subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    ) as proc:  # on leaving: its pipes closed (the end of its input ends it), and waited for
        yield proc


def _run(server: subprocess.Popen[str], script: str, tmp: Path) -> dict[str, object]:
    assert server.stdin is not None and server.stdout is not None
    out, err = tmp / "stdout", tmp / "stderr"
    server.stdin.write(f"{ROOT / 'scripts' / 'repro' / script}\t{out}\t{err}\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], 600)
    if not ready:
        server.kill()
        pytest.fail(f"{script} ran past 600 s")
    returncode = int(server.stdout.readline())
    stdout, stderr = out.read_text(), err.read_text()
    assert returncode == 0, stdout + stderr
    report: dict[str, object] = json.loads(stdout.strip().splitlines()[-1])
    assert report["megatron_core"] == RELEASE
    return report


def test_every_script_is_listed_and_documented() -> None:
    scripts = sorted(p.name for p in (ROOT / "scripts" / "repro").glob("*.py"))
    assert scripts == sorted(EXPECTED)
    doc = (ROOT / "docs" / "upstream.md").read_text()
    for name in scripts:
        assert f"scripts/repro/{name}" in doc, name


@pytest.mark.slow  # each script starts its own processes
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_defect_shows_as_documented(
    script: str, server: subprocess.Popen[str], tmp_path: Path
) -> None:
    if RELEASE not in EXPECTED[script]:
        pytest.skip(f"megatron-core {RELEASE} is not a pinned release of this test")
    report = _run(server, script, tmp_path)
    assert report["defect"] is EXPECTED[script][RELEASE], report
    if script == "final_norm_schedule_plan.py":
        # the cause, not only the symptom: the plan is forward without the final norm
        assert report["plan_is_forward_without_final_norm"] is True, report
    if script == "tp_reduce_noncontiguous_grad.py":
        assert report["grad_contiguous"] == report["expected"] == 3.0, report  # the control
        assert (report["grad_noncontiguous"] == 3.0) is not report["defect"], report
    if script == "interleaved_gloo_batch_p2p.py":
        # the controls: unbatched and reordered-batch exchanges deliver; the defect is a swap
        assert report["expected"] == [21.0, 22.0], report
        assert report["unbatched"] == report["expected"], report
        assert report["reordered_batch_correct"] is True, report
        assert report["swapped"] is report["defect"], report
        # the shape exchange of variable sequence lengths crosses even with batch_p2p_comm=False,
        # and the whole step then aborts gloo on the size mismatch (both pinned releases)
        assert report["shapes"] == [[2, 1, 4], [3, 1, 4]] and report["shapes_swapped"] is True, (
            report
        )
        call = report["variable_seq_lengths_call"]
        assert call["completed"] == [False, False] and call["gloo_size_mismatch"] is True, report
    if script == "plan_mtp_overwrites_input_ids.py":
        # the cause: the chunk's ids rolled once per MTP layer; the consequences where the
        # release has them (0.18+: the plan's output hook; 0.19: RL labels from input_ids)
        assert report["rolled_by"] == report["mtp_num_layers"] == 2, report
        newer = RELEASE != "0.16.1"
        assert report["output_hook_sees_chunk_ids"] is (False if newer else None), report
        assert report["rl_mtp_loss_equal"] is (False if newer else None), report
    if script == "mtp_layer_without_te.py":
        assert report["function_present"] is False and report["check_error"] is None, report
        assert report["mtp_model_builds"] is True, report
    if script == "destroy_model_parallel_leaves_groups.py" and report["defect"]:
        # the two names, and what they hold: two gloo groups (a listening socket and three
        # threads each) that only dropping the reference frees (the control)
        left = [
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        ]
        assert report["left"] == left, report
        sockets, threads = report["listening_sockets"], report["threads"]
        assert sockets[1] - sockets[0] == 2 and threads[1] - threads[0] == 6, report
        assert report["freed_by_dropping"] is True, report
    if script == "moe_router_without_te.py" and not report["defect"]:
        assert report["transformer_engine"] or report["matches_matmul"] is True, report
