"""``python -m torch_impl.doctor``: the installed release, the adapter's path, the checks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from typing import Any

import pytest

from torch_impl import doctor, has_native_hook, installed_megatron


@pytest.mark.release_matrix
@pytest.mark.slow
def test_doctor_command_reports_the_installed_release_and_passes() -> None:
    """The command as a user runs it (the matrix runs it on every release)."""
    from megatron.core.models.gpt import GPTModel

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "PYTHONWARNINGS")
    }
    done = subprocess.run(
        [sys.executable, "-m", "torch_impl.doctor"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    _assert_no_known_notice(done.stderr)
    release = installed_megatron().release
    assert f"megatron-core {release} at " in out
    path = (
        "adapter path: native hook" if has_native_hook(GPTModel) else "adapter path: no native hook"
    )
    assert path in out
    covered = release in doctor.MATRIX_RELEASES
    assert (f"covered: yes, {release} is in the CI release matrix" in out) == covered
    assert doctor.facts_row() in out
    lines = [
        line.split()[0]
        for line in out.splitlines()
        if line.startswith("  ") and line.split()[0] in {"PASS", "FAIL", "SKIP"}
    ]
    assert lines.count("FAIL") == 0 and lines.count("PASS") >= 4, out
    assert len(lines) == len(list(doctor.default_checks()))


KNOWN_NOTICES = (
    "Transformer Engine and Apex",
    "Apex is not installed",
    "full scope is deprecated",
    "No CUDA runtime",
)


def _assert_no_known_notice(stderr: str) -> None:
    shown = [n for n in KNOWN_NOTICES if n in stderr]
    assert not shown, stderr


def test_the_doctor_prints_none_of_megatrons_known_notices() -> None:
    """As a user runs it (no PYTHONWARNINGS): Megatron's Transformer Engine and Apex
    notices, its CUDA-graph-scope deprecation and torch's "No CUDA runtime" line,
    about eight lines that hookcheck silenced and the doctor printed, are gone;
    anything else would still show."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-m", "torch_impl.doctor", "--no-checks"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_no_known_notice(done.stderr)
    assert "megatron-core " in done.stdout


def test_doctor_main_returns_2_for_a_bad_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_release_outside_the_matrix_gets_the_checks_not_a_refusal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def passes() -> None:
        pass

    def fails() -> None:
        raise AssertionError("output differs from stock")

    def skips() -> None:
        raise doctor.SkipCheck("no such feature in this release")

    checks = [
        ("a check that holds", passes),
        ("a check that breaks", fails),
        ("a missing feature", skips),
    ]
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
    assert capsys.readouterr().out.strip() == doctor.facts_row()


def test_doctor_prints_versions_device_and_the_auto_backend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.metadata
    import importlib.util

    import torch

    import hookspec
    from torch_impl.processors import auto_choice

    assert doctor.main(["--no-checks"]) == 0
    out = capsys.readouterr().out
    spec = ".".join(str(v) for v in hookspec.SPEC_VERSION)
    assert f"contract SPEC_VERSION {spec}" in out
    assert f"mcore-hookspec {importlib.metadata.version('mcore-hookspec')}" in out
    assert f"torch {torch.__version__};" in out
    assert f"megatron-core {installed_megatron().release};" in out
    triton = (
        importlib.metadata.version("triton") if importlib.util.find_spec("triton") else "absent"
    )
    assert f"triton {triton};" in out
    te = "absent" if importlib.util.find_spec("transformer_engine") is None else ""
    assert f"transformer-engine {te}" in out
    assert "CUDA device: " in out
    if not torch.cuda.is_available():
        assert "CUDA device: none" in out
    choice = auto_choice(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if torch.cuda.is_available():
        measured = (
            "measured on this device class"
            if choice.measured
            else "not measured on this device class"
        )
        assert (
            f'backend "auto": {choice.backend} on ' in out
            and f"({measured}: {choice.source})" in out
        )
    else:  # a CPU is not a device class that was, or could be, measured: the rule is said
        assert f'backend "auto": {choice.backend} on the CPU ({choice.source})' in out
        assert "measured" not in out


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the CPU message; the GPU runs them"
)
def test_gpu_checks_skip_on_a_cpu_with_the_reason() -> None:
    gpu = [c for c in doctor.default_checks() if c[0].startswith("GPU:")]
    assert len(gpu) == 2
    results = doctor.run_checks(gpu)
    assert [r.status for r in results] == ["skip", "skip"]
    assert all("no CUDA device" in r.detail for r in results)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the Triton backend needs triton"
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_gpu_checks_run_on_the_cpu_with_the_interpreter() -> None:
    """The GPU checks' code on the CPU, both backends (Triton under its interpreter):
    a keyword the API dropped fails here, not on the GPU (it did once: ``backend=``)."""
    gpu = list(doctor.gpu_checks("cpu"))
    assert [name for name, _ in gpu] == [
        c[0] for c in doctor.default_checks() if c[0].startswith("GPU:")
    ]
    results = doctor.run_checks(gpu)
    assert [r.status for r in results] == ["pass", "pass"], results


@pytest.mark.gpu
def test_gpu_checks_pass_on_a_cuda_device() -> None:
    gpu = [c for c in doctor.default_checks() if c[0].startswith("GPU:")]
    results = doctor.run_checks(gpu)
    assert [r.status for r in results] == ["pass", "pass"], results


def test_what_is_read_from_megatron_lives_in_one_object() -> None:
    """``_compat.installed_megatron()`` is computed once; the doctor's facts and the
    old readers of ``_compat`` are views of it; the doctor reads no Megatron code itself."""
    import ast
    import dataclasses
    import inspect

    from torch_impl import _compat

    facts = _compat.installed_megatron()
    assert _compat.installed_megatron() is facts
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.native_hook = not facts.native_hook  # type: ignore[misc]
    assert _compat.mtp_loss_in_block() is facts.mtp_loss_in_block
    assert _compat.roll_accepts() is facts.roll_keywords
    assert _compat.reduce_keeps_noncontiguous_result() is facts.reduce_keeps_noncontiguous_result
    row = doctor.facts_row()
    assert row == doctor.facts_row(facts)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == facts.release and cells[2] == facts.mtp_loss_site
    assert cells[1] == ("yes" if facts.native_hook else "no")
    assert cells[-1] == ("; ".join(facts.workarounds()) or "none")
    tree = ast.parse(inspect.getsource(doctor))
    reads = {
        f"{n.value.id}.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in ("inspect", "ast")
    }
    assert not reads, f"the doctor works out a fact itself: {sorted(reads)}"


def test_the_process_group_api_is_read_from_gpt_model() -> None:
    import inspect

    from megatron.core.models.gpt import GPTModel

    from torch_impl import _compat

    params = inspect.signature(GPTModel.__init__).parameters
    want = (
        "pg_collection"
        if "pg_collection" in params
        else "model_comm_pgs"
        if "model_comm_pgs" in params
        else "parallel_state"
    )
    assert _compat.installed_megatron().process_groups == want


def test_library_code_imports_no_test_support() -> None:
    """The doctor imported ``torch_impl.testing`` (its tiny models, its caller-state
    keeper) and kept its own copies of ``_compat``'s facts (``Installed``) and of the
    stock head (``_stock_loss_upstream``); hookcheck imported it too. No module of
    ``hookspec``, ``torch_impl`` (outside ``testing``) or ``jax_ref`` imports it now."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    found = []
    for package in ("hookspec", "torch_impl", "jax_ref"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("torch_impl", "testing"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom):
                    base = "." * node.level + (node.module or "")
                    names = [base] + [f"{base}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(
                    n.startswith(("torch_impl.testing", ".testing", "..testing")) for n in names
                ):
                    found.append(f"{rel}:{node.lineno}")
    assert found == []
    source = pathlib.Path(doctor.__file__).read_text()
    assert "class Installed" not in source and "_stock_loss_upstream" not in source
