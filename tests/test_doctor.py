"""``python -m torch_impl.doctor``: the installed release, the adapter's path, the checks."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from torch_impl import doctor, has_native_hook


@pytest.mark.release_matrix
@pytest.mark.slow
def test_doctor_command_reports_the_installed_release_and_passes() -> None:
    """The command as a user runs it (the matrix runs it on every release)."""
    from megatron.core.models.gpt import GPTModel

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run(
        [sys.executable, "-m", "torch_impl.doctor"], capture_output=True, text=True, env=env, timeout=600
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    release = doctor.installed_release().release
    assert f"megatron-core {release} at " in out
    path = "adapter path: native hook" if has_native_hook(GPTModel) else "adapter path: no native hook"
    assert path in out
    covered = release in doctor.MATRIX_RELEASES
    assert (f"covered: yes, {release} is in the CI release matrix" in out) == covered
    assert doctor.release_facts().row() in out
    lines = [
        line.split()[0]
        for line in out.splitlines()
        if line.startswith("  ") and line.split()[0] in {"PASS", "FAIL", "SKIP"}
    ]
    assert lines.count("FAIL") == 0 and lines.count("PASS") >= 4, out
    assert len(lines) == len(list(doctor.default_checks()))


def test_release_outside_the_matrix_gets_the_checks_not_a_refusal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def passes() -> None:
        pass

    def fails() -> None:
        raise AssertionError("output differs from stock")

    def skips() -> None:
        raise doctor.SkipCheck("no such feature in this release")

    checks = [("a check that holds", passes), ("a check that breaks", fails), ("a missing feature", skips)]
    monkeypatch.setattr(doctor, "MATRIX_RELEASES", {})
    monkeypatch.setattr(doctor, "default_checks", lambda: iter(checks))
    status = doctor.main([])
    out = capsys.readouterr().out
    assert status == 1
    assert "covered: no," in out and "the checks below say what holds here" in out
    assert "PASS  a check that holds" in out
    assert "FAIL  a check that breaks" in out and "AssertionError: output differs from stock" in out
    assert "SKIP  a missing feature" in out and "no such feature in this release" in out
    assert "1 passed, 1 failed, 1 skipped" in out
    assert "outside the matrix: the failed checks above are what does not hold here" in out


def test_a_broken_bitwise_check_is_reported_as_a_failure() -> None:
    """A check whose comparison fails, or that raises inside Megatron, is a
    failure with the exception and where it was raised, never a crash."""
    import torch

    def planted() -> None:
        a = torch.ones(3)
        b = a.clone()
        b[1] = torch.nextafter(b[1], torch.tensor(2.0))  # one ulp
        if not torch.equal(a, b):
            raise AssertionError("output differs from stock by one ulp")

    def raising() -> Any:
        return {}["missing"]

    results = doctor.run_checks([("planted", planted), ("raising", raising)])
    assert [r.status for r in results] == ["fail", "fail"]
    assert results[0].detail.startswith(
        "AssertionError: output differs from stock by one ulp (test_doctor.py:"
    )
    assert results[1].detail.startswith("KeyError: 'missing' (test_doctor.py:")


def test_facts_row_option_prints_the_table_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--facts-row"]) == 0
    assert capsys.readouterr().out.strip() == doctor.release_facts().row()
