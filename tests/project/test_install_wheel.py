"""The built wheel installs with ``--no-deps`` into an environment that holds only
torch and megatron-core, and a processor runs through an enabled model there.

The bare environment: a new virtual environment (``venv --without-pip``) whose
site-packages holds symlinks to exactly the distributions of torch and
megatron-core and their requirements, taken from the test's own environment
(no copy, no index: about a second). Neither this project, nor jax, nor anything
else of the test environment is importable there. The wheel is built from a copy
of the sources (``pip wheel --no-deps --no-build-isolation``, so the shared tree
gets no ``build/``) and installed with ``pip --python <venv> install --no-deps
--no-index``; the check runs in a subprocess started outside the checkout, and so
does ``python -m torch_impl.doctor``, the README's check of an installation.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[2]
TYPED = ("hookspec", "torch_impl", "jax_ref")
PACKAGED = ("pyproject.toml", "README.md", "build_backend", "hookspec", "torch_impl", "jax_ref")

CHECK = """
import importlib.util, json, pathlib
import torch
import torch_impl
from torch_impl.processors import selected_logprobs
from torch_impl.testing.tiny import build_tiny_gpt, megatron_parallel, tiny_batch

with megatron_parallel():
    b = tiny_batch()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    out = model(b["input_ids"], b["position_ids"], None, labels=b["labels"],
                output_processor=selected_logprobs(entropy=True))
    logits = build_tiny_gpt()(b["input_ids"], b["position_ids"], None)  # stock, same seed
    logp = torch.log_softmax(logits, -1)
    want = logp.gather(-1, b["labels"][..., None])[..., 0]
    print(json.dumps({
        "logprob_error": float((out["logprobs"] - want).abs().max()),
        "entropy_error": float((out["entropy"] + (logp.exp() * logp).sum(-1)).abs().max()),
        "mean_logprob": float(out["logprobs"].mean()),
        "torch_impl": torch_impl.__file__,
        "torch": torch.__file__,
        "has_jax": importlib.util.find_spec("jax") is not None,
        "has_pytest": importlib.util.find_spec("pytest") is not None,
        # PEP 561: each package says that it is typed
        "py_typed": [
            (pathlib.Path(importlib.util.find_spec(p).origin).parent / "py.typed").is_file()
            for p in ("hookspec", "torch_impl", "jax_ref")
        ],
    }))
"""


def _closure(*names: str) -> list[md.Distribution]:
    """The installed distributions ``names`` and, recursively, their unconditional
    requirements (markers evaluated without extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional or platform-specific requirement that is not installed
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _bare_env(where: pathlib.Path) -> pathlib.Path:
    """A venv holding torch and megatron-core (and their requirements) by symlink."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = pathlib.Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    here = pathlib.Path(sysconfig.get_paths()["purelib"])
    for dist in _closure("torch", "megatron-core"):
        tops = {pathlib.PurePath(str(f)).parts[0] for f in dist.files or []}
        for top in tops - {"..", "__pycache__"}:
            source, link = here / top, site / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    return python


@pytest.mark.slow
@pytest.mark.release_independent  # the wheel's files are the same for every release and Python
def test_wheel_installs_without_dependencies_into_a_bare_torch_megatron_env(
    tmp_path: pathlib.Path,
) -> None:
    src = tmp_path / "src"
    for name in PACKAGED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
            ".",
        ],
        cwd=src,
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("mcore_hookspec-*.whl")
    with zipfile.ZipFile(wheel) as whl:  # PEP 561: the marker of each package is in the wheel
        assert {f"{p}/py.typed" for p in TYPED} <= set(whl.namelist()), sorted(whl.namelist())[:20]

    python = _bare_env(tmp_path / "env")
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )
    assert (
        tmp_path / "env" / "bin" / "hookcheck"
    ).exists()  # the console script came with the wheel

    # nothing of this process's Python path, nor the rendezvous an earlier test left in os.environ
    dist_vars = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k not in dist_vars}
    env["PYTHONWARNINGS"] = "ignore"
    run = subprocess.run(
        [str(python), "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    env_dir = str((tmp_path / "env").resolve())
    assert result["torch_impl"].startswith(env_dir), result  # the installed wheel, not the checkout
    assert not result["has_jax"] and not result["has_pytest"], (
        result
    )  # only torch and megatron-core
    assert result["logprob_error"] < 1e-5 and result["entropy_error"] < 1e-5, result
    assert result["mean_logprob"] < -3.0, result  # about -log(64) for the untrained tiny model
    assert result["py_typed"] == [True] * len(TYPED), (
        result
    )  # installed, a type checker sees the types

    if (src / "torch_impl" / "doctor.py").exists():  # the README's check of an installation
        doctor = subprocess.run(
            [str(python), "-m", "torch_impl.doctor"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr


def _tree(root: pathlib.Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` with its size, mtime (ns) and mode."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return found


@pytest.mark.parametrize("how", ["wheel", "install --target"])
def test_building_from_a_read_only_checkout_writes_nothing_into_it(
    tmp_path: pathlib.Path, how: str
) -> None:
    """A copy of the checkout, made read-only (``chmod -R a-w``; root ignores the mode,
    so the tree is also compared before and after): ``pip wheel .`` and ``pip install
    --target`` leave it as it was, no ``build/``, no ``*.egg-info``, and the wheel
    holds the three packages."""
    src = tmp_path / "src"
    src.mkdir()
    for name in PACKAGED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run(["chmod", "-R", "a-w", str(src)], check=True)
    before = _tree(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    common = ["--no-deps", "--no-build-isolation", "--no-index"]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        if how == "wheel":
            cmd = [*pip, "wheel", *common, "-w", str(tmp_path / "dist"), "."]
        else:
            cmd = [*pip, "install", *common, "--target", str(tmp_path / "target"), "."]
        done = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
        after = _tree(src)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(src)], check=True)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert after == before, sorted(set(after) ^ set(before)) or "a file changed"
    if how == "wheel":
        (wheel,) = (tmp_path / "dist").glob("mcore_hookspec-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
        tops = {n.split("/")[0] for n in names}
        assert {"hookspec", "torch_impl", "jax_ref"} <= tops and "build_backend" not in tops, tops
        assert {f"{p}/py.typed" for p in TYPED} <= names, (
            "PEP 561: each package's marker in the wheel"
        )
    else:
        assert (tmp_path / "target" / "hookspec" / "__init__.py").exists()
        assert all((tmp_path / "target" / p / "py.typed").is_file() for p in TYPED), (
            "PEP 561 markers"
        )


def test_torch_extra_lower_bounds_are_the_tested_ones() -> None:
    """The ``torch`` extra asks for what the tests ran on (README, "Installing into a
    training environment"), and this environment satisfies it."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["torch"]
    bounds = {Requirement(r).name: Requirement(r).specifier for r in extra}
    assert str(bounds["torch"]) == ">=2.11" and str(bounds["megatron-core"]) == ">=0.13.1"
    for name, spec in bounds.items():
        assert spec.contains(md.version(name).split("+")[0], prereleases=True), (
            name,
            md.version(name),
        )
