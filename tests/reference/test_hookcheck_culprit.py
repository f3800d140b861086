"""``hookcheck`` names the input at fault, for every input it takes (processor,
reference, context maker, seed, tp, case), explains its pass rule and its FAIL
lines, runs the synthetic cases it documents when asked, and says how to run it
without the console script.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hookspec
from jax_ref.check.hookcheck import ALL_SYNTHETIC_KINDS, main

ROOT = Path(__file__).resolve().parents[2]
REF = "jax_ref.check.examples:logprobs_entropy_reference"
GOOD = "jax_ref.check.examples:vocab_parallel_logprobs"
FAST = ("--dtype", "float32", "--no-synthetic", "--quiet")
HERE = __name__


def raising_reference(hidden: Any, weight: Any, inputs: Any) -> Any:
    raise ValueError("boom in the reference")


def raising_context(ctx: Any) -> Any:
    raise KeyError("boom in the context maker")


def contract_raising_reference(hidden: Any, weight: Any, inputs: Any) -> Any:
    raise hookspec.ContractError("inputs.context", expected="a temperature", actual="None")


def not_an_array_reference(hidden: Any, weight: Any, inputs: Any) -> Any:
    return {"logprobs": "not an array", "entropy": "nor this"}


@hookspec.processor
def raising_processor(ctx: Any) -> Any:
    raise RuntimeError("boom in the processor")


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return code, out.getvalue(), err.getvalue()


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("hookcheck: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "culprit", "not_blamed"),
    [
        (
            ("--processor", GOOD, "--reference", f"{HERE}:raising_reference"),
            f"reference 'raising_reference' (--reference {HERE}:raising_reference): "
            "expected to run on the case [gpt, float32], got ValueError: boom in the reference",
            "processor",
        ),
        (
            ("--processor", GOOD, "--reference", f"{HERE}:contract_raising_reference"),
            "reference 'contract_raising_reference' (--reference",
            "processor",
        ),
        (
            ("--processor", GOOD, "--reference", f"{HERE}:not_an_array_reference"),
            "reference 'not_an_array_reference'",
            "processor",
        ),
        (
            ("--processor", GOOD, "--reference", REF, "--context", f"{HERE}:raising_context"),
            f"context maker 'raising_context' (--context {HERE}:raising_context): "
            "expected to run on the case [gpt, float32], got KeyError",
            "processor",
        ),
        (
            ("--processor", f"{HERE}:raising_processor", "--reference", REF),
            "processor 'raising_processor': expected to run on the case, "
            "got RuntimeError: boom in the processor",
            "reference",
        ),
        (
            ("--seed", str(2**70), "--processor", GOOD, "--reference", REF),
            f"--seed: expected an int in [0, 2**32 - 1], got {2**70}",
            "processor",
        ),
        (("--seed", "-1"), "--seed: expected an int in [0, 2**32 - 1], got -1", "processor"),
        (("--tp", "0"), "--tp: expected an int >= 1, got 0", "processor"),
        (("--case", "random"), "--case: expected no --no-synthetic beside it", "processor"),
    ],
    ids=[
        "reference-raises",
        "reference-raises-contract-error",
        "reference-returns-no-array",
        "context-raises",
        "processor-raises",
        "seed-huge",
        "seed-negative",
        "tp",
        "case-and-no-synthetic",
    ],
)
def test_each_input_at_fault_is_named(argv: tuple[str, ...], culprit: str, not_blamed: str) -> None:
    code, _, err = _run(*FAST, *argv)
    assert code == 2
    line = _error_line(err)
    assert culprit in line, line
    assert not_blamed not in line.split(": expected")[0], line


def test_a_reference_raising_on_a_synthetic_case_names_the_case() -> None:
    code, _, err = _run(
        "--dtype", "float32", "--quiet", "--case", "peaked",
        "--processor", GOOD, "--reference", f"{HERE}:raising_reference",
    )  # fmt: skip
    assert code == 2
    assert "reference 'raising_reference'" in _error_line(err)


def test_help_says_how_to_run_without_the_script_and_how_to_ask_for_the_cases() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jax_ref.check.hookcheck", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "python -m jax_ref.check.hookcheck" in text
    assert "--case random --case masked" in text and "--case all" in text
    assert "max abs err <= atol + rtol * max|reference| + 8 * floor" in text
    assert "(floor X)" in text


def test_the_documented_kinds_are_the_cases_kinds() -> None:
    from jax_ref.check.cases import CASE_KINDS

    assert set(ALL_SYNTHETIC_KINDS) == set(CASE_KINDS)


def test_random_and_masked_run_when_asked_and_not_by_default() -> None:
    proc = "jax_ref.check.examples:token_mean_loss"
    ref = "jax_ref.check.examples:token_mean_loss_reference"
    code, out, err = _run(
        "--dtype",
        "float32",
        "--case",
        "random",
        "--case",
        "masked",
        "--processor",
        proc,
        "--reference",
        ref,
    )
    assert code == 0, out + err
    cases = set(re.findall(r"^token_mean_loss\s{2,}(\S+)\s{2,}float32", out, flags=re.M))
    assert {"random", "masked"} <= cases and not cases & {
        "peaked",
        "awkward",
        "strongly-negative",
    }, cases
    code, out, _ = _run(
        "--dtype", "float32", "--case", "all", "--processor", proc, "--reference", ref
    )
    cases = set(re.findall(r"^token_mean_loss\s{2,}(\S+)\s{2,}float32", out, flags=re.M))
    assert code == 0 and set(ALL_SYNTHETIC_KINDS) <= cases, cases
    code, out, _ = _run("--dtype", "float32", "--processor", proc, "--reference", ref)
    cases = set(re.findall(r"^token_mean_loss\s{2,}(\S+)\s{2,}float32", out, flags=re.M))
    assert code == 0 and not cases & {"random", "masked"}, cases


def test_the_pass_rule_is_printed_under_the_table_with_atol() -> None:
    code, out, _ = _run(
        "--full", "--dtype", "float32", "--no-synthetic",
        "--processor", "jax_ref.check.examples:token_mean_loss",
        "--reference", "jax_ref.check.examples:token_mean_loss_reference",
    )  # fmt: skip
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("case"))
    assert re.search(r"\brtol\s+atol\s+result$", header), header
    assert "pass: max abs err <= atol + rtol * max|reference| + 8 * floor" in out
    assert "float32 rtol 1e-04 atol 1e-07" in out
    assert "floor: the error of the reference's own formula run in float32" in out


def test_a_fail_line_explains_its_floor() -> None:
    """A planted wrong entropy: its FAIL lines carry the tolerance and, where the
    floor was computed, what the floor is and the bound it allowed."""
    code, out, _ = _run(
        *FAST[:-1], "--processor", "jax_ref.check.examples:wrong_sign_entropy", "--reference", REF
    )  # fmt: skip
    assert code == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert fails and all("(rtol 0.0001, atol 1e-07)" in line for line in fails), fails
    for line in fails:
        if "(floor " in line:
            assert "the float32 formula's own error; allowed 1e-07 + 1e-04 * " in line, line


def test_known_megatron_warnings_are_named_and_explained_once() -> None:
    """Run as a user does (no PYTHONWARNINGS): the Transformer Engine / Apex notices
    are gone, one line says what was silenced, nothing else is silenced."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    argv = [
        sys.executable, "-m", "jax_ref.check.hookcheck", "--dtype", "float32", "--no-synthetic",
        "--processor", "jax_ref.check.examples:token_mean_loss",
        "--reference", "jax_ref.check.examples:token_mean_loss_reference",
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (
        "Apex are not installed" not in proc.stderr and "Apex is not installed" not in proc.stderr
    )
    assert "No CUDA runtime is found" not in proc.stderr
    assert proc.stderr.count("are silenced") == 1


def test_the_tolerances_in_help_are_the_ones_applied() -> None:
    """--help states the tolerances without importing jax or torch: they must be the
    ones comparison.TOLERANCES applies."""
    from jax_ref.check.comparison import TOLERANCES
    from jax_ref.check.hookcheck import _EPILOG

    text = " ".join(_EPILOG.split())
    number = r"([0-9.e-]+)"
    found = {
        "float32": re.search(rf"float32: rtol {number}, atol {number}", text),
        "float16": re.search(rf"float16: {number}, {number}", text),
        "bfloat16": re.search(rf"bfloat16: {number}, {number}\)", text),
    }
    for dtype, m in found.items():
        assert m is not None, dtype
        assert (float(m.group(1)), float(m.group(2))) == (
            TOLERANCES[dtype].rtol,
            TOLERANCES[dtype].atol,
        )
    slack = re.search(rf"\+ {number} \* floor", text)
    assert slack is not None and float(slack.group(1)) == TOLERANCES["float32"].slack
