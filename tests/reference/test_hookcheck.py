"""``hookcheck``: the built-in run, deliberately wrong processors, tensor parallel."""

from __future__ import annotations

import io
import itertools
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jax_ref.check.hookcheck import BUILTIN_CHECKS, main

ROOT = Path(__file__).resolve().parents[2]
REF = "jax_ref.check.examples:logprobs_entropy_reference"


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


_ROW = (
    r"^(.+?)\s{2,}(.+?)\s{2,}(float32|bfloat16|float16)\s{2,}.*?\s{2,}"
    r"(ok(?: \(f32 floor\))?|FAIL \(\d+ of \d+\))$"
)


def _summary(out: str) -> dict[tuple[str, str, str], str]:
    """``(processor, case, dtype) -> result`` from the summary table."""
    rows = {}
    for line in out.splitlines():
        m = re.match(_ROW, line)
        if m:
            rows[m.group(1), m.group(2), m.group(3)] = m.group(4)
    return rows


@pytest.mark.release_independent
def test_default_run_checks_every_builtin_processor():
    code, out, err = _run()
    assert code == 0, out + err
    rows = _summary(out)
    unavailable = re.findall(r"unavailable, skipped: (.+?) \(", err)
    for check in BUILTIN_CHECKS:
        if check.name in unavailable:
            continue
        for case, dtype in [
            ("gpt", "float32"),
            ("gpt", "bfloat16"),
            ("gpt", "float16"),
            ("gpt-tied", "float32"),
        ]:
            assert rows[check.name, case, dtype].startswith("ok")
        for kind in ("strongly-negative", "peaked", "awkward"):
            assert rows[check.name, kind, "float32"].startswith("ok")
    assert "policy_loss(gspo)" not in unavailable, "torch_impl.processors should be importable here"
    assert not unavailable, unavailable
    assert re.search(r"hookcheck: all \d+ comparisons passed", out)
    progress = re.findall(r"^\[\s*(\d+)/(\d+)\]", err, flags=re.M)
    assert progress and progress[-1][0] == progress[-1][1] and int(progress[-1][1]) == len(rows)
    assert "Traceback" not in out + err


def test_deliberately_wrong_processors_are_caught():
    code, out, err = _run(
        "--dtype", "float32", "--no-synthetic",
        "--processor", "jax_ref.check.examples:wrong_sign_entropy", "--reference", REF,
        "--processor", "jax_ref.check.examples:wrong_reduction_loss",
        "--reference", "jax_ref.check.examples:token_mean_loss_reference",
        "--processor", "jax_ref.check.examples:vocab_parallel_logprobs", "--reference", REF,
    )  # fmt: skip
    assert code == 1, out + err
    rows = _summary(out)
    assert rows["wrong_sign_entropy", "gpt", "float32"] == "FAIL (3 of 6)"
    assert rows["wrong_reduction_loss", "gpt", "float32"] == "FAIL (3 of 3)"
    assert rows["vocab_parallel_logprobs", "gpt", "float32"] == "ok"
    fails = re.findall(r"^FAIL (\w+): (\w+) ([\w/ ]+?) \[", out, flags=re.M)
    assert {(p, o) for p, o, _ in fails} == {
        ("wrong_sign_entropy", "entropy"),
        ("wrong_reduction_loss", "output"),
    }
    assert "hookcheck: 12 of 30 comparisons FAILED" in out  # gpt and gpt-tied, 3 processors


def test_non_finite_values_fail_with_a_clear_line():
    code, out, _ = _run(
        "--dtype", "float32", "--processor", "jax_ref.check.examples:unshifted_softmax",
        "--reference", REF,
    )  # fmt: skip
    assert code == 1
    assert (
        "FAIL unshifted_softmax: logprobs value [strongly-negative, float32]: "
        "non-finite: 23 of 24 values" in out
    )
    assert _summary(out)["unshifted_softmax", "gpt", "float32"] == "ok"


@pytest.mark.release_independent  # the hook at tp=2 on every release: test_enable_tp.py
def test_missing_tensor_parallel_reduction_is_caught_on_two_ranks():
    """Two gloo ranks (Megatron tp=2, vocab split), the reference sharded over two
    virtual JAX devices, in float32 and bfloat16 (``--dtype``: the GPT in bf16 on the
    ranks, its rows under bf16 tolerances; it once ran fp32 whatever was asked): the
    right recipe passes on both ranks; the processor that skips gather_hidden_states
    fails exactly the hidden-state gradients, in both dtypes."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("XLA_FLAGS", None)
    argv = [
        sys.executable, "-m", "jax_ref.check.hookcheck", "--tp", "2", "--no-synthetic",
        "--dtype", "float32", "--dtype", "bfloat16",
        "--processor", "jax_ref.check.examples:vocab_parallel_logprobs", "--reference", REF,
        "--processor", "jax_ref.check.examples:missing_tp_reduction", "--reference", REF,
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert "reference sharded over 2 JAX devices" in out
    legend = next(line for line in out.splitlines() if line.startswith("pass: "))
    assert "bfloat16 rtol 2e-02 atol 1e-05" in legend and "float32 rtol 1e-04" in legend, legend
    rows = _summary(out)
    for rank, dtype in itertools.product((0, 1), ("float32", "bfloat16")):
        assert rows["vocab_parallel_logprobs", f"gpt tp2 rank{rank}", dtype] == "ok"
        assert rows["missing_tp_reduction", f"gpt tp2 rank{rank}", dtype] == "FAIL (2 of 6)"
    fails = re.findall(r"^FAIL (\w+): (\w+) ([\w/ ]+?) \[(.+?), (\w+)\]", out, flags=re.M)
    assert {(p, q) for p, _, q, _, _ in fails} == {("missing_tp_reduction", "d/d hidden")}
    assert {c for *_, c, _ in fails} == {"gpt tp2 rank0", "gpt tp2 rank1"}
    assert {d for *_, d in fails} == {"float32", "bfloat16"}
    assert "Traceback" not in out + proc.stderr


@pytest.mark.release_independent  # Megatron's cp split on every release: test_policy_cp.py
def test_context_parallel_passes_shares_and_catches_a_rank_local_mean():
    """``--cp 2``: every case split over two gloo ranks as Megatron splits a batch. The
    per-token recipe and the token mean over the CP group's count pass; the same mean
    over each rank's own tokens (right at cp=1) fails its value and both gradients on
    every case; the synthetic case that 2 cp does not divide (awkward, s=7) is skipped."""
    ex = "jax_ref.check.examples"
    code, out, err = _run(
        "--cp", "2", "--case", "peaked", "--case", "awkward",
        "--processor", f"{ex}:vocab_parallel_logprobs", "--reference", REF,
        "--processor", f"{ex}:token_mean_loss", "--reference", f"{ex}:token_mean_loss_reference",
        "--processor", f"{ex}:rank_mean_loss", "--reference", f"{ex}:token_mean_loss_reference",
    )  # fmt: skip
    assert code == 1, out + err
    rows = _summary(out)
    for case in ("gpt cp2", "peaked cp2"):
        assert rows["vocab_parallel_logprobs", case, "float32"].startswith("ok"), out
        assert rows["token_mean_loss", case, "float32"] == "ok", out
        assert rows["rank_mean_loss", case, "float32"] == "FAIL (3 of 3)", out
    assert not any(case.startswith("awkward") for _, case, _ in rows), out
    assert "case 'awkward' skipped (s=7 is no multiple of 2 * cp = 4)" in out
    assert "hookcheck: 6 of 24 comparisons FAILED" in out


@pytest.mark.release_independent
@pytest.mark.slow
def test_context_parallel_builtin_run():
    """``hookcheck --cp 2`` with no processor: every built-in check that runs under
    context parallel passes (policy, preference losses and their sequence-level sums
    among them); those that refuse it, or need a count the check's context lacks, are
    listed as skipped, with why."""
    code, out, err = _run("--cp", "2", "--no-synthetic")
    assert code == 0, out + err
    rows = _summary(out)
    skipped = re.findall(r"unavailable, skipped: (.+?) \(", err)
    assert set(skipped) == {c.name for c in BUILTIN_CHECKS if c.tp1_only or c.cp_refused}, skipped
    for check in BUILTIN_CHECKS:
        if check.name not in skipped:
            assert rows[check.name, "gpt cp2", "float32"].startswith("ok"), check.name
    assert "policy_loss(gspo)" not in skipped


def test_console_script_and_module_entry_points():
    script = Path(sys.executable).with_name("hookcheck")
    assert script.exists(), "pip install -e . installs the hookcheck console script"
    for argv in (
        [str(script), "--help"],
        [sys.executable, "-m", "jax_ref.check.hookcheck", "--help"],
    ):
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "--processor MODULE:ATTR" in proc.stdout


@pytest.mark.parametrize("flag", ["--full"])
def test_full_table(flag):
    code, out, _ = _run(flag, "--dtype", "float32", "--no-synthetic", "--processor",
                        "jax_ref.check.examples:token_mean_loss", "--reference",
                        "jax_ref.check.examples:token_mean_loss_reference")  # fmt: skip
    assert code == 0
    assert "max abs err" in out and len(re.findall(r"^gpt", out, flags=re.M)) == 6


def test_inherited_master_port_does_not_collide():
    """Under torchrun or Slurm, MASTER_ADDR/MASTER_PORT (and RANK, WORLD_SIZE) are set
    for the caller's group, whose store already listens on that port: hookcheck's own
    gloo group meets on a port of its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(
            os.environ, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
        argv = [
            sys.executable, "-m", "jax_ref.check.hookcheck", "--quiet",
            "--dtype", "float32", "--no-synthetic",
            "--processor", "jax_ref.check.examples:token_mean_loss",
            "--reference", "jax_ref.check.examples:token_mean_loss_reference",
        ]  # fmt: skip
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout
