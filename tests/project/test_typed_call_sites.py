"""A keyword the API no longer takes is a type error, wherever the call is.

The doctor once called ``linear_logprobs(..., backend=...)`` after ``backend`` had moved
into ``LinearOptions``: the tensor functions took ``**unexpected: Any`` (to raise a
``TypeError`` naming the new field), so strict typing accepted the call and only the
GPU run found it. The catch-alls are now ``**unexpected: Never``: the runtime error is
unchanged, and mypy refuses any keyword the signature does not name. These tests prove
that mypy does, and run it over the call sites outside mypy's ``files`` (the
benchmarks, the scripts, the notebooks' code), reporting that class of error only.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_MYPY = (
    subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode == 0
)
pytestmark = [
    pytest.mark.skipif(not HAS_MYPY, reason="mypy is not installed"),
    pytest.mark.release_independent,  # mypy reads the source; CI's type step runs it once, in py312
]

# the errors of a keyword the callee does not take: without a catch-all, and with one
# typed Never
STALE_KEYWORD = re.compile(
    r'Unexpected keyword argument|incompatible type "[^"]*"; expected "Never"'
)


def _mypy(*paths: Path) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration on ``paths`` (the repository's packages
    resolved from the checkout)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            *map(str, paths),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


CALLS = """
import torch
from torch_impl.processors import (
    DistillConfig, LinearOptions, SparseTeacher, cross_entropy_loss, distillation_loss,
    fused_token_loss, linear_distillation_loss, linear_logprobs, linear_topk_logprobs,
    policy_loss, selected_logprobs, topk_logprobs,
)

h, w = torch.zeros(2, 3), torch.zeros(4, 3)
y = torch.zeros(2, dtype=torch.long)
t = SparseTeacher(ids=torch.zeros(2, 1, dtype=torch.long), logprobs=torch.zeros(2, 1))
linear_logprobs(h, w, y, options=LinearOptions(backend="torch"))
linear_topk_logprobs(h, w, k=1, options=LinearOptions(tile_rows=1))
fused_token_loss(h, w, y, lambda lp, ent, rows: lp.sum(), options=LinearOptions())
linear_distillation_loss(h, w, y, t, options=LinearOptions(), config=DistillConfig())
selected_logprobs(tile_rows=8, tile_cols=16)
cross_entropy_loss(reduction="mean", tile_rows=8)
policy_loss(tile_rows=8, tile_cols=16)
topk_logprobs(2, tile_cols=16)
distillation_loss(DistillConfig(), tile_rows=8)
"""

STALE = {
    "linear_logprobs(h, w, y, backend='torch')": "linear_logprobs",
    "linear_topk_logprobs(h, w, k=1, temperature=2.0)": "linear_topk_logprobs",
    "fused_token_loss(h, w, y, lambda lp, ent, rows: lp.sum(), chunk_size=8)": "fused_token_loss",
    "linear_distillation_loss(h, w, y, t, tile_elements=64)": "linear_distillation_loss",
    "selected_logprobs(vocab_chunk_size=8)": "selected_logprobs",
    "cross_entropy_loss(fused_tile_elements=64)": "cross_entropy_loss",
    "policy_loss(token_chunk_size=8)": "policy_loss",
    "topk_logprobs(2, vocab_chunk_size=8)": "topk_logprobs",
    "distillation_loss(DistillConfig(), tile_elements=64)": "distillation_loss",
}


def test_mypy_refuses_a_keyword_the_signature_no_longer_takes(tmp_path: Path) -> None:
    """Each stale call is an error on its own line; the same file without them passes
    (so the errors are the keywords', not the file's)."""
    good = tmp_path / "good_calls.py"
    good.write_text(CALLS)
    ok = _mypy(good)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    stale = tmp_path / "stale_calls.py"
    lines = list(STALE)
    stale.write_text(CALLS + "\n".join(lines) + "\n")
    first = CALLS.count("\n") + 1
    bad = _mypy(stale)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    flagged = {
        int(m.group(1)) for m in re.finditer(r"stale_calls\.py:(\d+): error: .*", bad.stdout)
    }
    for i, call in enumerate(lines):
        assert first + i in flagged, f"mypy accepted {call}:\n{bad.stdout}"
    errors = [line for line in bad.stdout.splitlines() if ": error:" in line]
    assert all(STALE_KEYWORD.search(line) for line in errors), bad.stdout


def _notebook_code(path: Path, out: Path) -> Path:
    """The code cells of notebook ``path`` as one module (IPython magics and shell
    lines dropped)."""
    cells = json.loads(path.read_text())["cells"]
    code = [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in cells
        if c.get("cell_type") == "code"
    ]
    text = "\n\n".join(
        "\n".join(line for line in cell.splitlines() if not line.lstrip().startswith(("%", "!")))
        for cell in code
    )
    target = out / f"nb_{path.stem}.py"
    target.write_text(text + "\n")
    return target


@pytest.mark.slow
def test_call_sites_outside_the_packages_pass_no_stale_keyword(tmp_path: Path) -> None:
    """mypy over the benchmarks, the scripts and the notebooks' code: no call passes a
    keyword its callee does not take. (Other findings there are not this test's.)"""
    paths = [ROOT / "benchmarks", *sorted((ROOT / "scripts").rglob("*.py"))]
    paths += [_notebook_code(nb, tmp_path) for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    paths += sorted((ROOT / "notebooks").glob("*.py"))
    result = _mypy(*paths)
    assert "error: " not in result.stderr, result.stderr
    stale = [line for line in result.stdout.splitlines() if STALE_KEYWORD.search(line)]
    assert not stale, "\n".join(stale)
