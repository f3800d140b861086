"""``hookcheck`` on bad input: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookspec
from jax_ref.check.hookcheck import main

ROOT = Path(__file__).resolve().parents[2]
REF = "jax_ref.check.examples:logprobs_entropy_reference"
GOOD = "jax_ref.check.examples:vocab_parallel_logprobs"
HERE = "tests.reference.test_hookcheck_bad_input"  # this module, as hookcheck imports it
FAST = ("--dtype", "float32", "--no-synthetic", "--quiet")


def float8_context(ctx):
    """A user context holding a tensor DLPack cannot hand to the reference."""
    return {"scale": torch.zeros(ctx.batch_size, ctx.seq_len).to(torch.float8_e4m3fn)}


@hookspec.processor
def raising(ctx):
    raise RuntimeError("boom in the processor")


NOT_CALLABLE = 42


def _run(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    text = out.getvalue() + err.getvalue()
    assert "Traceback" not in text, text
    return code, err.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--processor", "no_such_package.procs:mine", "--reference", REF),
            "hookcheck: error: --processor: expected an importable module 'no_such_package.procs', "
            "got ModuleNotFoundError: No module named 'no_such_package'",
        ),
        (
            ("--processor", "jax_ref.check.examples:nope", "--reference", REF),
            "hookcheck: error: --processor: expected 'jax_ref.check.examples:nope' to exist, "
            "got no attribute 'nope'",
        ),
        (
            ("--processor", "jax_ref.check.examples", "--reference", REF),
            "hookcheck: error: --processor: expected 'module:attr', got 'jax_ref.check.examples'",
        ),
        (
            ("--processor", GOOD, "--reference", "jax_ref.no_such_module:ref"),
            "hookcheck: error: --reference: expected an importable module 'jax_ref.no_such_module'",
        ),
        (
            ("--processor", GOOD, "--reference", f"{HERE}:NOT_CALLABLE"),
            f"hookcheck: error: --reference: expected {HERE}:NOT_CALLABLE "
            "to be a callable reference, got int",
        ),
        (
            ("--processor", GOOD),
            "hookcheck: error: arguments: expected one --reference per --processor",
        ),
        (
            (
                "--processor",
                GOOD,
                "--reference",
                "jax_ref.check.examples:token_mean_loss_reference",
            ),
            "hookcheck: error: reference 'token_mean_loss_reference' result: "
            "expected a mapping of arrays, as the processor returns, got one array of shape []",
        ),
        (
            (
                "--processor",
                GOOD,
                "--reference",
                REF,
                "--context",
                f"{HERE}:float8_context",
            ),
            "hookcheck: error: context['scale']: expected a dtype the DLPack boundary carries "
            "(float16, bfloat16, float32, float64, int8, int16, int32, int64, uint8, bool), "
            "got float8_e4m3fn",
        ),
        (
            ("--processor", f"{HERE}:raising", "--reference", REF),
            "hookcheck: error: processor 'raising': expected to run on the case, "
            "got RuntimeError: boom in the processor",
        ),
        (("--tp", "0"), "hookcheck: error: --tp: expected an int >= 1, got 0"),
        (
            ("--tp", "3"),
            "hookcheck: error: --tp: expected a divisor of the case model's 4 attention heads "
            "[1, 2, 4], got 3",
        ),
        (("--cp", "0"), "hookcheck: error: --cp: expected an int >= 1, got 0"),
        (
            ("--cp", "3"),
            "hookcheck: error: --cp: expected one of [1, 2, 4] (2 * cp must divide the cases' "
            "sequence length 8), got 3",
        ),
        (
            ("--cp", "2", "--tp", "2"),
            "hookcheck: error: --cp: expected --tp 1 beside it (tensor and context parallel "
            "together are not checked), got --tp 2",
        ),
        (
            (
                "--cp",
                "2",
                "--processor",
                "jax_ref.check.examples:full_vocab_logprobs",
                "--reference",
                REF,
            ),
            "hookcheck: error: --cp: expected hookspec processors (@hookspec.processor): an "
            "upstream-style processor sees no context-parallel group, got "
            "jax_ref.check.examples:full_vocab_logprobs",
        ),
        (
            ("--context", f"{HERE}:float8_context"),
            "hookcheck: error: arguments: expected one --reference per --processor (in order), "
            "at most one --context each, got 0 --processor, 0 --reference, 1 --context",
        ),
        (
            ("--processor", GOOD, "--reference", REF, "--context", "hookspec:SPEC_VERSION"),
            "hookcheck: error: --context: expected hookspec:SPEC_VERSION to be a callable "
            "make_context(ctx) -> user context, got tuple",
        ),
    ],
    ids=[
        "module-missing",
        "attr-missing",
        "no-colon",
        "reference-missing",
        "reference-not-callable",
        "no-reference",
        "structure",
        "dlpack-dtype",
        "processor-raises",
        "tp",
        "tp-not-a-divisor",
        "cp",
        "cp-not-a-divisor",
        "cp-with-tp",
        "cp-upstream-processor",
        "context-without-processor",
        "context-not-callable",
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(argv, message):
    code, err = _run(*FAST, *argv)
    assert code == 2
    assert message in err, err


def test_a_reference_missing_an_output_names_both_structures():
    def partial_ref(hidden, weight, inputs):
        from jax_ref.check.examples import logprobs_entropy_reference

        return {"logprobs": logprobs_entropy_reference(hidden, weight, inputs)["logprobs"]}

    sys.modules[__name__].partial_ref = partial_ref  # importable as module:attr for this test
    try:
        code, err = _run(*FAST, "--processor", GOOD, "--reference", f"{__name__}:partial_ref")
    finally:
        del sys.modules[__name__].partial_ref
    assert code == 2
    assert (
        "reference 'partial_ref' result: expected the processor's structure "
        "{entropy [3, 8], logprobs [3, 8]}, got {logprobs [3, 8]}" in err
    ), err


def test_a_contract_error_inside_the_processor_keeps_its_message():
    code, err = _run(*FAST, "--processor", "torch_impl.processors:policy_loss", "--reference", REF)
    assert code == 2 and "hookcheck: error:" in err and err.count("\n") <= 2


def test_bad_input_from_the_command_line_has_no_traceback():
    argv = [sys.executable, "-m", "jax_ref.check.hookcheck", "--processor", "no_such_package:x"]
    argv += ["--reference", REF]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert (
        "hookcheck: error: --processor: expected an importable module 'no_such_package'"
        in proc.stderr
    )
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("argv", "code", "stream", "text"),
    [
        (["--bogus"], 2, "err", "hookcheck: error: unrecognized arguments: --bogus"),
        (["--seed", "x"], 2, "err", "argument --seed: invalid int value: 'x'"),
        (["--help"], 0, "out", "usage: hookcheck"),
    ],
    ids=["unknown-option", "bad-int", "help"],
)
def test_argparse_exits_become_a_return_code_in_process(
    argv: list[str], code: int, stream: str, text: str
) -> None:
    """``main(["--bogus"])`` used to raise ``SystemExit`` at its caller; argparse's
    own message still goes to the stream the caller gave."""
    out, err = io.StringIO(), io.StringIO()
    assert main(argv, out=out, err=err) == code
    assert text in (out if stream == "out" else err).getvalue()


PROCESSOR_MODULE = """
from jax_ref.check.examples import logprobs_entropy_reference as ref
from jax_ref.check.examples import vocab_parallel_logprobs as proc
"""


def test_a_processor_in_the_current_directory_imports_as_under_python_m(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``hookcheck`` console script starts with its ``bin`` directory first on
    ``sys.path``, not the current directory as ``python -m`` does: ``--processor
    myproc:proc`` failed with "No module named 'myproc'" and no hint."""
    from jax_ref.check._spec import resolve

    (tmp_path / "cwd_myproc.py").write_text(PROCESSOR_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    path = list(sys.path)
    monkeypatch.delitem(sys.modules, "cwd_myproc", raising=False)
    assert resolve("cwd_myproc:proc").name == "vocab_parallel_logprobs"
    assert sys.path == path, "the caller's sys.path changed"
    with pytest.raises(hookspec.ContractError) as e:
        resolve("cwd_missing_module:proc")
    assert str(e.value).endswith(
        f"looked in the current directory {tmp_path} and on sys.path (PYTHONPATH)"
    )
    assert sys.path == path


@pytest.mark.slow
def test_the_console_script_runs_a_processor_from_the_current_directory(tmp_path: Path) -> None:
    """As a user runs it: a script outside the current directory (as the console
    script lives in ``bin``), a processor module in the current directory."""
    (tmp_path / "work").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "work" / "cwd_myproc.py").write_text(PROCESSOR_MODULE)
    script = tmp_path / "bin" / "hookcheck"
    script.write_text("import sys\nfrom jax_ref.check.hookcheck import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [
        sys.executable,
        str(script),
        *FAST,
        "--processor",
        "cwd_myproc:proc",
        "--reference",
        "cwd_myproc:ref",
    ]
    proc = subprocess.run(
        argv, cwd=tmp_path / "work", capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
