"""The GPU command's machinery, checked on a CPU: the time budget of
``scripts/gpu_tests.sh`` (every step under ``timeout``, at most 480 s in all), the
benchmark at a tiny size (rows appended as measured, the float64 reference, a method
that needs CUDA reported as such, a size past the budget named), the results page
(without a run a sentence, not a table of "not measured" rows; every row of a run that
measured nothing "not measured"; the targets and the backend choice from rows), and that
each GPU check the design asks for exists as a ``gpu``-marked test."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_logprobs, gpu_methods, gpu_results
from benchmarks.gpu_methods import (
    METHODS,
    REPLAY,
    REPLAY_METHODS,
    grpo_token_loss,
    loss_batch,
    objective,
)

# torch alone: the same outcome on every Megatron release and Python (docs/testing.md)
pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parents[2]
TESTS_SH = ROOT / "scripts" / "gpu_tests.sh"
BENCH_SH = ROOT / "scripts" / "gpu_bench.sh"
LIMIT_S = 480


# ---------------------------------------------------------------- the time budget


def _table() -> tuple[dict[str, int], int]:
    """The budget table at the top of gpu_tests.sh: ``{step: limit}`` and the total."""
    lines = TESTS_SH.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(r"#\s+step\s+limit s$", ln))
    steps: dict[str, int] = {}
    for ln in lines[start + 1 :]:
        m = re.match(r"#\s+(.+?)\s{2,}(\d+)$", ln)
        if m is None:
            break
        steps[m.group(1)] = int(m.group(2))
    return steps, steps.pop("total")


def _timeouts(path: Path) -> list[tuple[int, int]]:
    """``(kill grace, limit)`` of every ``timeout`` call, with run_tests' literal limits."""
    text = path.read_text()
    found = [(int(k), int(n)) for k, n in re.findall(r"\btimeout -k (\d+) (\d+)\b", text)]
    grace = [int(k) for k in re.findall(r'\btimeout -k (\d+) "\$limit"', text)]
    calls = [int(n) for n in re.findall(r"^run_tests \S+ (\d+) ", text, flags=re.M)]
    if grace:
        found += [(grace[0], n) for n in calls]
    return found


def test_budget_fits_eight_minutes() -> None:
    steps, total = _table()
    grace_row = [k for k in steps if k.startswith("kill grace")]
    assert len(grace_row) == 1
    grace = steps.pop(grace_row[0])
    timeouts = _timeouts(TESTS_SH) + _timeouts(BENCH_SH)
    # the table names every timed step, with the limit the code uses
    assert sorted(n for _, n in timeouts) == sorted(steps.values())
    assert grace == sum(k for k, _ in timeouts)
    assert total == sum(steps.values()) + grace
    assert total <= LIMIT_S
    assert "--no-bench" in TESTS_SH.read_text() and "gpu_bench.sh" in TESTS_SH.read_text()


@pytest.mark.parametrize("script", [TESTS_SH, BENCH_SH], ids=lambda p: p.name)
def test_every_command_runs_under_a_timeout(script: Path) -> None:
    """Every python, pip or pytest command is on a ``timeout`` line or inside a
    ``timeout ... bash -c '...'`` block: no step can outlast its limit."""
    inside = False
    for ln in script.read_text().splitlines():
        code = ln.split("#", 1)[0] if not ln.lstrip().startswith("#") else ""
        if re.search(r"\btimeout\b.*\bbash -c '$", code):
            inside = True
            continue
        if inside and re.search(r"^\s*true' _ ", code):
            inside = False
            continue
        runs_python = re.search(r'"\$py" -[mc]\b|\$\{pip\[@\]\}|"\$py" -m pytest', code)
        if runs_python and not inside:
            assert re.search(r"\btimeout -k \d+ (\d+|\"\$limit\")", code), ln
    assert not inside


def test_processor_only_files_agree() -> None:
    listed = re.search(r"^processor_only=\(([^)]*)\)", TESTS_SH.read_text(), flags=re.M)
    assert listed is not None
    assert tuple(listed.group(1).split()) == gpu_results.PROCESSOR_ONLY
    files = gpu_results.gpu_test_files(ROOT)
    assert files[0] == "tests/processors/test_gpu_checks.py"
    for f in files:
        assert "mark.gpu" in (ROOT / f).read_text()


def test_scripts_parse() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    import subprocess

    for script in (TESTS_SH, BENCH_SH, ROOT / "scripts" / "gpu_wheels.sh"):
        assert subprocess.run([bash, "-n", str(script)], capture_output=True).returncode == 0, (
            script
        )


# ---------------------------------------------------------------- the benchmark at a tiny size


def test_quick_cpu_run_appends_every_row(tmp_path: Path) -> None:
    methods = [
        "floor3",
        "naive",
        "naive-loss",
        "ours-torch",
        "ours-ce-torch",
        "ours-loss-torch",
        "liger",
        "cce",
    ]
    argv = [
        "--quick",
        "--device",
        "cpu",
        "--methods",
        ",".join(methods),
        "--runs",
        "2",
        "--warmup",
        "1",
    ]
    assert gpu_logprobs.main([*argv, "--out", str(tmp_path)]) == 0
    rows = gpu_results.read_rows(tmp_path / gpu_logprobs.RESULTS)
    assert len(rows) == len(methods) * len(gpu_logprobs.QUICK_SIZES)
    first = {r["method"]: r for r in rows if r["tokens"] == gpu_logprobs.QUICK_SIZES[0]["tokens"]}
    assert set(first) == set(methods)
    assert first["liger"]["error"] == "needs CUDA" and first["cce"]["error"] == "needs CUDA"
    for m in ("naive", "naive-loss", "ours-torch", "ours-ce-torch", "ours-loss-torch"):
        assert first[m]["error"] == "", first[m]
        assert first[m]["time_ms"] > 0
        assert first[m]["dh_rel_err"] < 1e-5 and first[m]["dw_rel_err"] < 1e-5, first[
            m
        ]  # fp32 vs float64
    assert "dh_rel_err" not in first["floor3"]


def test_rows_are_written_as_they_come(tmp_path: Path) -> None:
    """Each row reaches the file when its method ends; a method past the deadline is named."""
    size = gpu_logprobs.QUICK_SIZES[1]
    out = tmp_path / gpu_logprobs.RESULTS
    seen: list[int] = []
    real = gpu_logprobs._append

    def spy(path: Path | None, row: dict[str, Any]) -> None:
        seen.append(len(out.read_text().splitlines()) if out.exists() else 0)
        real(path, row)

    gpu_logprobs._append = spy  # type: ignore[assignment]
    try:
        gpu_logprobs.run_size(size, ["floor3", "naive"], device="cpu", runs=1, warmup=0, out=out)
        gpu_logprobs.run_size(
            size, ["ours-torch"], device="cpu", runs=1, warmup=0, out=out, deadline=0.0
        )
    finally:
        gpu_logprobs._append = real  # type: ignore[assignment]
    assert seen == [0, 1, 2]
    rows = gpu_results.read_rows(out)
    assert [r["method"] for r in rows] == ["floor3", "naive", "ours-torch"]
    assert rows[2]["error"] == "not reached: the time budget was spent"


def test_sizes_past_the_budget_are_named(tmp_path: Path) -> None:
    args = ["--quick", "--device", "cpu", "--methods", "floor3,cce", "--runs", "2",
            "--budget", "0", "--out", str(tmp_path)]  # fmt: skip
    assert gpu_logprobs.main(args) == 0
    rows = gpu_results.read_rows(tmp_path / gpu_logprobs.RESULTS)
    assert len(rows) == 2 * len(gpu_logprobs.QUICK_SIZES)
    assert all(r["error"] == "not reached: the time budget was spent" for r in rows)


@pytest.mark.parametrize("family", ["lp+ent", "lp", "loss"])
def test_reference_matches_autograd(family: str) -> None:
    """The row-subset float64 reference equals autograd through the full logits."""
    g = torch.Generator().manual_seed(0)
    n, v = 13, 29
    h = torch.randn(n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    logp = (h @ w.T).log_softmax(-1)
    lp = logp.gather(1, y[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    fn = objective(family, n, "cpu")
    fn(lp, ent).backward()
    rows, cols = torch.tensor([0, 5, 12]), torch.tensor([1, 2, 28])
    dh, dw = gpu_logprobs.reference(h.detach(), w.detach(), y, rows, cols, fn)
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(dh, h.grad[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(dw, w.grad[cols], rtol=0, atol=1e-12)


# ---------------------------------------------------------------- sampling replay

REPLAY_SIZE = {"tokens": 8, "hidden": 8, "vocab": 128, "dtype": "fp32", "logits": "peaked"}
"""Tiny: the Triton methods run under the interpreter (a few tenths of a second a call)."""


def _kept_by_rule(z: torch.Tensor, parameters: dict[str, Any]) -> torch.Tensor:
    """vLLM's rule written pairwise (``[n, V, V]``), another form than the benchmark's
    sort: a token stays in top-k while fewer than k kept tokens are strictly above it,
    and in top-p while the kept mass strictly above it is under ``top_p``."""
    keep = torch.ones_like(z, dtype=torch.bool)
    above = z[:, None, :] > z[:, :, None]  # [n, j, i]: z_i > z_j
    if "min_p" in parameters:
        keep &= z >= z.amax(1, keepdim=True) + torch.log(torch.tensor(parameters["min_p"]))
    if "top_k" in parameters:
        keep &= (above & keep[:, None, :]).sum(2) < parameters["top_k"]
    if "top_p" in parameters:
        q = z.masked_fill(~keep, -torch.inf).softmax(1)
        keep &= (above * q[:, None, :]).sum(2) < parameters["top_p"]
    return keep


def _replay_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 leaves whose logits have ties (halves), so that the ties at the k-th and at
    the top-p boundary are exercised; labels drawn among the largest logits."""
    g = torch.Generator().manual_seed(3)
    n, hid, v = 6, 8, 80
    h = torch.randn(n, hid, generator=g, dtype=torch.float64)
    w = torch.randn(v, hid, generator=g, dtype=torch.float64)
    z = h @ w.T
    y = z.topk(3, dim=1).indices[:, 2]  # the third largest: kept by most rules
    return h * 3.0, w, y


@pytest.mark.parametrize("family", list(REPLAY))
def test_replay_reference_matches_autograd(family: str) -> None:
    """The chunked float64 reference over a kept set equals autograd through the full
    logits renormalised over that set, the set by the rule written another way."""
    h, w, y = _replay_inputs()
    h.requires_grad_()
    w.requires_grad_()
    z = h @ w.T
    if family == "replay-ids":
        ids = gpu_methods.kept_ids(y, w.shape[0])
        kept = torch.zeros_like(z, dtype=torch.bool)
        for i, row in enumerate(ids.tolist()):
            kept[i, [j for j in row if j >= 0]] = True
    else:
        kept = _kept_by_rule(z.detach(), REPLAY[family])
        assert 0 < int(kept.sum()) < kept.numel()  # the rule removes tokens, keeps some
    logq = z.masked_fill(~kept, -torch.inf).log_softmax(-1)
    lp = logq.gather(1, y[:, None]).squeeze(1)
    logq = torch.where(kept, logq, 0.0)  # no -inf * 0 forward or backward
    ent = -torch.where(kept, logq.exp() * logq, 0.0).sum(-1)
    fn = objective(family, h.shape[0], "cpu")
    fn(lp, ent).backward()
    keep = gpu_logprobs.replay_mask(family, y, w.shape[0])
    assert keep is not None
    got_lp, got_ent = gpu_logprobs.reference_stats(h.detach(), w.detach(), y, keep=keep)
    torch.testing.assert_close(got_lp, lp.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(got_ent, ent.detach(), rtol=0, atol=1e-12)
    rows, cols = torch.tensor([0, 3, 5]), torch.tensor([1, 2, 40, 79])
    dh, dw = gpu_logprobs.reference(h.detach(), w.detach(), y, rows, cols, fn, keep=keep)
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(dh, h.grad[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(dw, w.grad[cols], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["replay-topk-topp", "replay-topp"])
def test_parameter_mask_keeps_tie_groups_whole(family: str) -> None:
    """The sort-based rule equals the pairwise one on logits full of ties."""
    z = (torch.randn(32, 120, generator=torch.Generator().manual_seed(4)) * 4).round() / 2
    z = z.double()
    want = _kept_by_rule(z, REPLAY[family])
    torch.testing.assert_close(gpu_logprobs.parameter_mask(z, **REPLAY[family]), want)
    assert bool((want.sum(1) < z.shape[1]).all())


def test_parameter_mask_matches_jax_ref() -> None:
    """Where JAX is installed: the benchmark's rule is ``jax_ref.sampling.kept_mask``."""
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    import jax_ref
    from jax_ref.sampling import kept_mask

    z = (torch.randn(16, 90, generator=torch.Generator().manual_seed(5)) * 4).round() / 2
    z = z.double()
    for parameters in REPLAY.values():
        if "kept_ids" in parameters:
            continue
        with jax_ref.float64():
            want = np.asarray(kept_mask(jnp.asarray(z.numpy()), **parameters))
        got = gpu_logprobs.parameter_mask(z, **parameters).numpy()
        assert (got == want).all(), parameters


def test_replay_methods_match_the_float64_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sampling-replay method on both backends (Triton interpreted on a CPU), through
    the benchmark's own row: values and gradients against float64 over the kept set (one
    call each: the profiled call, tested above, left out)."""
    monkeypatch.setattr(gpu_logprobs, "profile_call", lambda fn, device: {})
    rows = gpu_logprobs.run_size(REPLAY_SIZE, REPLAY_METHODS, device="cpu", runs=1, warmup=0)
    assert [r["method"] for r in rows] == REPLAY_METHODS
    for r in rows:
        assert r["error"] == "", r
        assert r["family"] in REPLAY and r["backend"] in ("torch", "triton")
        for key in ("lp_rel_err", "dh_rel_err", "dw_rel_err"):
            assert r[key] < 1e-5, r  # fp32 against float64
        assert r["support_mismatch"] == 0, r
        assert "of labels outside the kept set" in r["note"]
    outside = {r["family"]: r["outside_support"] for r in rows}
    assert outside["replay-ids"] == 0.0  # the label is the first kept id


def test_a_wrong_support_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method that replays another support than the family's gets errors far above an
    fp32 method's: the check can fail."""
    real = gpu_methods.replay_support

    def wrong(family: str, y: torch.Tensor, vocab: int) -> Any:
        support = real(family, y, vocab)
        if family == "replay-ids":  # the label kept, the other ids one token over
            ids = support.kept_ids.clone()
            ids[:, 1:] = torch.where(ids[:, 1:] >= 0, (ids[:, 1:] + 1) % vocab, -1)
            return type(support)(kept_ids=ids)
        return type(support)(top_p=0.5)

    monkeypatch.setattr(gpu_methods, "replay_support", wrong)
    methods = ["ours-support-ids-torch", "ours-support-topp-torch"]
    rows = gpu_logprobs.run_size(REPLAY_SIZE, methods, device="cpu", runs=1, warmup=0)
    for r in rows:
        assert r["error"] == "", r
        assert r["lp_rel_err"] > 1e-3 or r["support_mismatch"] > 0, r
        assert r["dh_rel_err"] > 1e-3, r


def test_replay_runs_beside_its_baseline_on_peaked_logits() -> None:
    """Each size that runs a replay method runs ``linear_logprobs`` on both backends too
    (the ratio's denominator); the replay methods run on peaked logits only."""
    sizes = [s for s in gpu_logprobs.SIZES if gpu_logprobs.methods_at(s, REPLAY_METHODS)]
    assert sizes and all(s["logits"] == "peaked" for s in sizes)
    for size in sizes:
        assert gpu_logprobs.methods_at(size, REPLAY_METHODS) == REPLAY_METHODS
        assert {"ours-ce-torch", "ours-ce-triton"} <= set(gpu_logprobs.methods_at(size, [*METHODS]))
    target = gpu_logprobs.size_of(dict(gpu_logprobs.TARGET_SIZE, logits="peaked"))
    assert target in [gpu_logprobs.size_of(s) for s in sizes]  # where replay_target reads


def test_grpo_loss_is_ppo_of_the_batch() -> None:
    batch = loss_batch(4, "cpu")
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    ent = torch.tensor([0.5, 0.1, 0.2, 0.3])
    ratio = torch.exp(lp - batch["old"])
    a = batch["adv"]
    want = (
        torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * batch["weight"]
    ).sum()  # no entropy term
    torch.testing.assert_close(grpo_token_loss(lp, ent, batch), want, rtol=0, atol=0)
    halves = grpo_token_loss(lp[:2], ent[:2], batch, slice(0, 2)) + grpo_token_loss(
        lp[2:], ent[2:], batch, slice(2, 4)
    )
    torch.testing.assert_close(halves, want)


# ---------------------------------------------------------------- the results page


def _rows(logits: str = "flat", busy: float | None = None, **times: float) -> list[dict[str, Any]]:
    size = {k: gpu_logprobs.TARGET_SIZE[k] for k in gpu_logprobs.SIZE_KEYS}
    size["logits"] = logits
    out = []
    for m, t in times.items():
        name = m.replace("_", "-")
        row: dict[str, Any] = dict(
            size, method=name, family=METHODS[name].family, backend=METHODS[name].backend
        )
        row.update(error="", note="", device="NVIDIA H100 80GB HBM3", device_class="H100")
        row.update(time_ms=t, peak_extra_gb=0.9 if name != "verl-triton" else 2.5, dh_rel_err=3e-3)
        if busy is not None:
            row.update(busy_fraction=busy, kernels=40, launches=41)
        if name == "naive":
            row["dh_rel_err"] = 4e-3
        out.append(row)
    return out


def test_targets_from_rows() -> None:
    rows = _rows(floor3=44.0, floor4=62.0, ours_triton=61.0, ours_torch=70.0,
                 ours_loss_triton=47.0, ours_loss_torch=46.0, naive=99.0, verl_triton=90.0,
                 liger=83.0, cce=58.0)  # fmt: skip
    got = {a: (b, c) for a, b, c in gpu_results.targets(rows)}
    verdicts = [b for b, _ in got.values()]
    # floor4, floor3, busy (not profiled), peers (no peaked rows), memory, dh, replay (no
    # peaked rows), the CPU's
    assert verdicts == [
        "met", "met", "not measured", "not measured", "met", "met", "not measured",
        "not measured",
    ]  # fmt: skip
    first = next(iter(got.values()))[1]
    assert "ours-triton 61.0 ms = 0.98x floor4" in first
    assert "ours-loss-torch 46.0 ms" in list(got.values())[1][1]
    rows = [r for r in rows if r["method"] != "floor4"]
    assert gpu_results.targets(rows)[0][1] == "not measured"
    slow = _rows(floor4=62.0, ours_triton=66.0, ours_torch=90.0)  # 1.06x: over 1.05
    assert gpu_results.targets(slow)[0][1] == "not met"
    idle = _rows(busy=0.62, floor3=44.0, floor4=62.0, ours_triton=61.0, ours_loss_triton=47.0)
    assert gpu_results.targets(idle)[2][1:] == ("not met", "0.62 / 0.62")


def test_peers_are_compared_like_with_like_on_both_logits() -> None:
    times = dict(ours_triton=60.0, verl_triton=90.0, ours_ce_triton=59.0, liger=83.0, cce=70.0,
                 cce_exact=180.0, ours_ce_mean_triton=45.0, liger_mean=80.0, cce_mean=60.0,
                 cce_mean_exact=179.0)  # fmt: skip
    both = _rows("flat", **times) + _rows("peaked", **times)
    verdict, text = gpu_results.peers_target(both)[1:]
    assert verdict == "met", text
    assert "peaked: ours-ce-mean-triton 45.0 / cce-mean-exact 179.0 ms" in text
    assert "flat: liger-sm90 left out (not measured: its package is not carried)" in text
    assert gpu_results.peers_target(_rows("flat", **times))[1] == "not measured"  # no peaked rows
    fast_cce = _rows("flat", **times) + _rows("peaked", **dict(times, cce_mean=40.0))
    assert gpu_results.peers_target(fast_cce)[1] == "not met"


def test_replay_rows_against_linear_logprobs() -> None:
    """The replay table: each row's ratio to ``linear_logprobs`` on its backend; the
    kept-ids target from the faster backend of each, on the peaked logits."""
    rows = _rows("peaked", ours_ce_triton=60.0, ours_ce_torch=80.0, ours_support_ids_triton=63.0,
                 ours_support_ids_torch=90.0, ours_support_topp_triton=120.0)  # fmt: skip
    for r in rows:
        if r["family"] in REPLAY:
            r.update(lp_rel_err=2e-3, note="5.0% of labels outside the kept set (-inf)")
    text = "\n".join(gpu_results.replay_lines(rows))
    assert "| ours-ce-torch | none (`linear_logprobs`) | torch | 80.0 | 1.00 | 4 |" in text
    assert "| ours-support-ids-triton | `kept_ids` (`K = 64`) | triton | 63.0 | 1.05 | 4 " in text
    assert "| ours-support-ids-torch | `kept_ids` (`K = 64`) | torch | 90.0 | 1.12 | 4 " in text
    assert "| triton | 120.0 | 2.00 | 7 | 2.0e-03 | 3.0e-03 |" in text
    assert "| ours-support-topp-torch | `top_p=0.9` (no top-k bound: the radix select) | torch " \
        "| not measured | not measured | 7 |" in text  # fmt: skip
    what, verdict, measured = gpu_results.replay_target(rows)
    assert "1.1x" in what and verdict == "met"
    assert measured == "ours-support-ids-triton 63.0 ms = 1.05x ours-ce-triton 60.0 ms"
    slow = _rows("peaked", ours_ce_triton=60.0, ours_support_ids_triton=67.0)
    assert gpu_results.replay_target(slow)[1] == "not met"
    flat = _rows("flat", ours_ce_triton=60.0, ours_support_ids_triton=63.0)
    assert gpu_results.replay_target(flat)[1:] == ("not measured", "not measured")


def test_backend_choice_per_device_class() -> None:
    rows = _rows(
        ours_triton=66.0,
        ours_torch=70.0,
        ours_loss_triton=48.0,
        ours_loss_torch=46.0,
        ours_ce_torch=5.0,
    )
    got = {c["path"]: c for c in gpu_results.backend_choice(rows)}
    assert set(got) == {
        "logprobs + entropy",
        "fused GRPO loss",
    }  # logprobs only: one backend measured
    assert (
        got["logprobs + entropy"]["faster"] == "triton"
        and got["fused GRPO loss"]["faster"] == "torch"
    )
    assert got["fused GRPO loss"]["device_class"] == "H100"
    # the class's one row: the smaller total over both pairs (66 + 48 triton < 70 + 46 torch)
    assert gpu_results.class_choice(rows) == {"H100": ("triton", 116.0, 114.0, 2)}


def test_a_run_with_nothing_measured_says_not_measured_everywhere() -> None:
    regions = gpu_results.render(None)
    run = regions["run"]
    for f in gpu_results.gpu_test_files(ROOT):
        assert f"`{f}`" in run
    for m in METHODS:
        sizes = [s for s in gpu_logprobs.SIZES if gpu_logprobs.methods_at(s, [m])]
        assert len(
            re.findall(rf"^\| {re.escape(m)} \| [^|]+ \| not measured \|", run, flags=re.M)
        ) == len(sizes)
    assert re.search(r"\d+\.\d+ ms|\d\.\d+e-\d\d", run) is None  # no figure at all
    assert all(b == "not measured" for _, b, _ in gpu_results.targets([]))


def test_render_a_run_and_write_the_page(tmp_path: Path) -> None:
    env = {"device": "NVIDIA H200", "device_class": "H200", "torch": "2.11.0", "triton": "3.6.0",
           "commit": "abc", "packages": {"megatron-core": ["0.19.2", "0.16.1"]}}  # fmt: skip
    (tmp_path / "env.json").write_text(json.dumps(env))
    rows = _rows(floor3=44.0, floor4=62.0, ours_triton=66.0)
    (tmp_path / gpu_logprobs.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tests-0.19.2.log").write_text(
        "tests/processors/test_gpu_checks.py::test_a[x] PASSED [ 10%]\n"
        "tests/processors/test_gpu_checks.py::test_b FAILED [ 20%]\n"
        "tests/hook/test_schedule_plan.py::test_c SKIPPED (no TE) [ 30%]\n"
        "tests/hook/test_schedule_plan.py::test_d \n"
    )
    (tmp_path / "tests-0.16.1.log").write_text(
        "tests/hook/test_schedule_plan.py::test_c PASSED [ 50%]\n==== 1 passed in 3.2s ====\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "# head\n<!-- gpu-results:run -->\nold\n<!-- gpu-results:run end -->\nmiddle\n"
        "<!-- gpu-results:targets -->\nold\n<!-- gpu-results:targets end -->\ntail\n"
    )
    assert gpu_results.main(["render", str(tmp_path), "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# head\n") and "\nmiddle\n" in text and text.endswith("tail\n")
    assert "old" not in text
    assert (
        "| device | NVIDIA H200 (class H200" in text
        and "| megatron-core | 0.19.2, 0.16.1 |" in text
    )
    assert "| `tests/processors/test_gpu_checks.py` | 1 failed, 1 passed |" in text
    assert "1 skipped, cut at the time limit in test_d | 1 passed |" in text
    assert (
        "| ours-triton | ours, logprobs + entropy, backend triton "
        "| 66.0 | 1.50 | 1.06 | 0.90 | 3.0e-03 |" in text
    )
    assert "no summary line" in text  # the 0.19.2 run was cut
    assert (tmp_path / "gpu-results.md").exists()


def _region(text: str, name: str) -> str:
    start, end = f"<!-- gpu-results:{name} -->", f"<!-- gpu-results:{name} end -->"
    assert start in text and end in text, name
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def test_committed_page_has_both_regions() -> None:
    """Each region holds a rendered run (its device and date recorded) or the sentence
    for no run, never the template: tables whose every row says "not measured"."""
    text = (ROOT / "docs" / "gpu-results.md").read_text()
    _, total = _table()
    assert f"limits add up to {total} s" in " ".join(
        text.split()
    )  # the page quotes the script's budget
    for name in gpu_results.MARKERS:
        region = _region(text, name)
        if region != gpu_results.NO_RUN[name]:
            assert name != "run" or re.search(r"^\| date \(UTC\) \| \d{4}-\d\d-\d\d", region, re.M)
            assert not re.search(r"^\| device \| not measured \|", region, re.M), region


def test_no_run_writes_a_sentence_not_a_table(tmp_path: Path) -> None:
    """``render --empty --write``: each region says that no run is recorded, in words."""
    page = tmp_path / "page.md"
    page.write_text(
        "# head\n<!-- gpu-results:run -->\nold\n<!-- gpu-results:run end -->\n"
        "<!-- gpu-results:targets -->\nold\n<!-- gpu-results:targets end -->\n"
    )
    assert gpu_results.main(["render", "--empty", "--write", str(page)]) == 0
    text = page.read_text()
    for name in gpu_results.MARKERS:
        region = _region(text, name)
        assert region == gpu_results.NO_RUN[name]
        assert "|" not in region and "not measured" not in region
        assert "No run" in region


# ---------------------------------------------------------------- the GPU checks exist, marked


def _gpu_tests(path: Path) -> dict[str, str]:
    """``{name: source}`` of the gpu-marked test functions of one file (read, not imported)."""
    source = path.read_text()
    tree = ast.parse(source)
    module_marked = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "mark.gpu" in ast.unparse(node.value)
        for node in tree.body
    )
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            marked = module_marked or any("mark.gpu" in ast.unparse(d) for d in node.decorator_list)
            if marked:
                out[node.name] = ast.get_source_segment(source, node) or ""
    return out


REQUIRED = [
    # (what, file, test, a phrase its body must hold)
    ("the 1F1B plan equal to forward", "test_schedule_plan.py",
     "test_whole_plan_on_gpu_matches_forward", "_gpu_forward"),
    ("the label check makes no host read", "test_value_checks.py",
     "test_cuda_defers_without_a_host_read", 'set_sync_debug_mode("error")'),
    ("the processors make no host read", "test_gpu_checks.py",
     "test_no_host_read_forward_and_backward", 'set_sync_debug_mode("error")'),
    ("a processor in a CUDA graph", "test_value_checks.py",
     "test_cuda_graph_captures_a_processor_with_its_checks", "torch.cuda.graph("),
    ("linear_logprobs in a CUDA graph", "test_gpu_checks.py",
     "test_cuda_graph_replay_equals_eager", "torch.cuda.graph("),
    ("bitwise determinism run to run", "test_gpu_checks.py", "test_bitwise_run_to_run",
     "torch.equal"),
    ("Triton against float64", "test_processors_triton.py", "test_gpu_three_way_real_sizes",
     "three_way_real_sizes("),
    ("the fused loss against float64", "test_gpu_checks.py", "test_fused_loss_against_float64",
     ".double()"),
    ("softcap and bias against float64", "test_gpu_checks.py", "test_peer_options_against_float64",
     "peer_options("),
]  # fmt: skip


@pytest.mark.parametrize(("what", "file", "test", "phrase"), REQUIRED, ids=[r[0] for r in REQUIRED])
def test_each_gpu_check_exists_and_is_marked(what: str, file: str, test: str, phrase: str) -> None:
    (path,) = (ROOT / "tests").rglob(file)
    tests = _gpu_tests(path)
    assert test in tests, f"{what}: no gpu-marked {test} in {path.relative_to(ROOT)}"
    assert phrase in tests[test], f"{what}: {test} no longer holds {phrase!r}"


def test_env_reads_the_commit_from_the_wheels_folder_without_git(tmp_path: Path) -> None:
    """The GPU machine's copy of the tree has no .git: the commit comes from .whl/commit.txt."""
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "commit.txt").write_text(
        "abc123\nuncommitted paths: 0\nwritten: 2026-11-26T10:00:00Z\n"
    )
    (tmp_path / ".site-mcore-0.16.1" / "megatron_core-0.16.1.dist-info").mkdir(parents=True)
    env = gpu_results._env(tmp_path)
    assert env["commit"] == "abc123" and "commit.txt" in env["commit_note"]
    assert env["packages"]["megatron-core"] == ["0.16.1"]
    assert env["torch"] == torch.__version__


def test_env_takes_the_stamp_over_an_enclosing_repository(tmp_path: Path) -> None:
    """The GPU run of 2026-11-26 recorded the commit of a repository holding the copy:
    the stamp wins, and without one a tree that is not its own checkout's top says unknown."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tree = tmp_path / "copy"
    (tree / ".whl").mkdir(parents=True)
    assert gpu_results._env(tree)["commit"] == "unknown"
    (tree / ".whl" / "commit.txt").write_text("def456\nuncommitted paths: 2\n")
    env = gpu_results._env(tree)
    assert env["commit"] == "def456" and "uncommitted paths: 2" in env["commit_note"]


# ---------------------------------------------------------------- what the command measures first


def test_measure_first_runs_before_the_tests_and_the_benchmark() -> None:
    text = TESTS_SH.read_text()
    body = text[text.index("set -uo pipefail") :]
    order = [
        body.index(s)
        for s in (
            "-m benchmarks.gpu_results env",
            "-m benchmarks.gpu_measure",
            "\nrun_tests 0.19.2",
            "bash scripts/gpu_bench.sh",
        )
    ]
    assert order == sorted(order)


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore::RuntimeWarning:triton.runtime.interpreter"
)  # masked lanes: -inf - -inf
def test_measure_dry_run_writes_each_row_as_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU at a tiny size: the GEMMs, the copy, every Triton kernel found by running
    the Triton backend (no list of kernels here), the floors; each row in the file when
    the next starts."""
    from benchmarks import gpu_measure

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here (py311's CPU torch wheel has none)")
    seen: list[int] = []
    real = gpu_measure._append
    out = tmp_path / gpu_measure.RESULTS

    def spy(path: Path | None, row: dict[str, Any]) -> dict[str, Any]:
        seen.append(len(out.read_text().splitlines()) if out.exists() else 0)
        return real(path, row)

    monkeypatch.setattr(gpu_measure, "_append", spy)
    size = {"tokens": 24, "hidden": 16, "vocab": 200, "dtype": "fp32"}
    rows = gpu_measure.measure(size, device="cpu", runs=1, warmup=0, out=tmp_path)
    assert seen == list(range(len(rows)))
    assert gpu_results.read_rows(out) == rows
    whats = [r["what"] for r in rows]
    assert whats == sorted(whats, key=["mm", "copy", "kernel", "floor"].index)
    cases = [r["case"] for r in rows]
    assert cases[:2] == ["mm fp32->fp32", "mm fp32->fp32 (out_dtype)"]
    assert "error" in rows[1] and "mm.dtype" in rows[1]["error"]  # out_dtype: CUDA only
    assert {"dh gemm strided", "dW gemm contiguous", "floor3", "floor4"} <= set(cases)
    strided = next(r for r in rows if r["case"] == "dh gemm strided")
    assert strided["stride"] == [2 * 200, 1] and strided["tflops"] > 0
    kernels = [r for r in rows if r["what"] == "kernel"]
    names = {r["case"].split("(")[0] for r in kernels}
    assert len(names) >= 2, names  # the statistics and the gradient kernels, found by running them
    assert all(0 < r["of_copy"] and r["bytes"] >= 24 * 200 * 4 for r in kernels), kernels
    assert any("WITH_ENTROPY=False" in r["case"] for r in kernels)
    copy = next(r for r in rows if r["what"] == "copy")
    assert all(r["launches"] == gpu_measure.BACK_TO_BACK >= 20 for r in [*kernels, copy])


def test_time_ms_divides_back_to_back_launches() -> None:
    from benchmarks import gpu_measure

    calls: list[int] = []
    t = gpu_measure.time_ms(lambda: calls.append(1), device="cpu", runs=3, warmup=2, launches=20)
    assert len(calls) == 2 + 3 * 20 and t >= 0


def test_measure_takes_a_registered_kernel_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch_impl.processors.kernel_cases(device)``, where it exists, replaces the recording."""
    import torch_impl.processors as processors
    from benchmarks import gpu_measure

    calls: list[int] = []
    monkeypatch.setattr(
        processors,
        "kernel_cases",
        lambda device: [("copy kernel", lambda: calls.append(1), 1000)],
        raising=False,
    )
    size = {"tokens": 8, "hidden": 8, "vocab": 64, "dtype": "fp32"}
    rows = gpu_measure.measure(size, device="cpu", runs=2, warmup=1, out=None)
    (k,) = [r for r in rows if r["what"] == "kernel"]
    assert (
        k["case"] == "kernel copy kernel"
        and k["bytes"] == 1000
        and k["source"].endswith("kernel_cases")
    )
    assert (
        len(calls) == 1 + 2 * gpu_measure.BACK_TO_BACK
    )  # a warm-up, then 2 runs of 20 back to back


def test_chunk_shape_is_the_triton_backends() -> None:
    from benchmarks.gpu_measure import chunk_shape

    assert chunk_shape(8192, 151936, "cuda") == (8192, 8192)  # TILE_BYTES: 256 MiB of fp32
    assert chunk_shape(32768, 151936, "cuda") == (32768, 2048)


def test_render_measurements_and_the_model_beside_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import types

    from benchmarks import gpu_measure

    rows = [
        {
            "what": "mm",
            "case": "mm bf16->fp32",
            "time_ms": 1.5,
            "tflops": 733.0,
            "shape": "8192x32768x4096",
        },
        {"what": "copy", "case": "copy 1024 MiB", "time_ms": 0.5, "gbps": 4294.0},
        {
            "what": "kernel",
            "case": "kernel k(F=True)",
            "time_ms": 0.4,
            "gbps": 2684.0,
            "of_copy": 0.63,
        },
        {"what": "mm", "case": "dh gemm strided", "error": "RuntimeError: no"},
    ]
    (tmp_path / gpu_measure.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "env.json").write_text(
        json.dumps({"device": "NVIDIA H200", "device_class": "H200"})
    )
    monkeypatch.setitem(sys.modules, "benchmarks.gpu_model", None)  # as if absent: the import fails
    run = gpu_results.render(tmp_path)["run"]
    assert "| mm bf16->fp32 | 8192x32768x4096 | 1.500 | 733 TFLOP/s |" in run
    assert "| kernel k(F=True) |  | 0.400 | 2684 GB/s = 0.63 of copy |" in run
    assert "| dh gemm strided |  | not measured | | RuntimeError: no |" in run
    assert "| floor3 |  | not measured |" in run
    assert "predicted" not in run  # no model module: no column
    model = types.ModuleType("benchmarks.gpu_model")
    model.predicted_ms = lambda cls: {  # type: ignore[attr-defined]
        "mm bf16->fp32": 1.2,
        "kernel k(F=True)": 0.5,
        "floor3": 40.0,
    }
    monkeypatch.setitem(sys.modules, "benchmarks.gpu_model", model)
    run = gpu_results.render(tmp_path)["run"]
    assert "prediction for H200" in run
    assert "| mm bf16->fp32 | 1.500 | 1.200 | 1.25 |" in run
    assert "| floor3 | not measured | 40.000 | not measured |" in run
