"""The reproduction scripts of docs/upstream.md still reproduce on the pinned releases.

Each script under ``scripts/repro/`` runs on a CPU with torch and megatron-core only
and prints one JSON line whose ``defect`` says whether the Megatron defect showed.
Here each runs in a fresh interpreter on this environment's release, and the test
asserts what docs/upstream.md says of that release: when a release fixes a defect
(or starts to show one), this test fails and the document is re-read, so it cannot
go stale silently.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
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


def _run(script: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "repro" / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
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
def test_defect_shows_as_documented(script: str) -> None:
    if RELEASE not in EXPECTED[script]:
        pytest.skip(f"megatron-core {RELEASE} is not a pinned release of this test")
    report = _run(script)
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
