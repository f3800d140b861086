"""Which backend ``backend="auto"`` runs, per class of device (``docs/processors.md``,
"Backends and tiles"): as measured (``MEASURED_CHOICES``), ``"triton"`` on an unmeasured
GPU, ``"torch"`` on a CPU or without Triton.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Literal

import torch

__all__ = ["MEASURED_CHOICES", "BackendChoice", "auto_choice", "device_class", "triton_available"]


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend ``"auto"`` picks, and whether a measurement on this class chose it."""

    backend: Literal["torch", "triton"]
    measured: bool
    source: str  # where the measurement is recorded, or why there is none


MEASURED_CHOICES: dict[str, BackendChoice] = {
    "H200": BackendChoice(
        "triton",
        measured=True,
        source=(
            "docs/gpu-results.md: the run of 2026-11-26 on one NVIDIA H200 (torch 2.11.0+cu130, "
            "Triton 3.6.0, commit 49dd243): triton faster on 9 of 9 size and path pairs, 480.4 ms "
            "against torch's 596.5 ms in all (docs/gpu-runs/2026-11-26-h200/bench.log)"
        ),
    ),
}
"""``device_class -> choice`` where the GPU benchmark (``benchmarks/gpu_logprobs.py``,
``docs/gpu-results.md``) measured both backends in one run on that class. A row is of the
code its run measured (its ``source`` names the commit): the H200 row is of commit 49dd243,
and no GPU has measured the backends since (``docs/gpu-results.md``, "Not measured since")."""

_UNMEASURED_GPU = BackendChoice(
    "triton",
    measured=False,
    source="not measured on this device class: cuBLAS GEMMs with Triton epilogues by default",
)
_CPU = BackendChoice(
    "torch", measured=False, source="the CPU path (torch ops; Triton would be interpreted)"
)
_NO_TRITON = BackendChoice("torch", measured=False, source="triton is not installed")

_KNOWN = tuple(
    "GH200 H200 H100 H800 H20 B200 B100 GB200 A100 A800 L40S L4 A10".split()
)  # first match wins


def device_class(name: str, capability: tuple[int, int]) -> str:
    """The table's key for a CUDA device: the product family in its name (``"H100"``,
    ``"H200"``, ...), else ``"sm_<major><minor>"``::

        device_class("NVIDIA H100 80GB HBM3", (9, 0)) == "H100"
        device_class("Some GPU", (8, 9)) == "sm_89"
    """
    for family in _KNOWN:
        if re.search(rf"(?<![A-Za-z0-9]){family}(?![0-9])", name):
            return family
    return f"sm_{capability[0]}{capability[1]}"


def triton_available() -> bool:
    """Triton is importable (it ships with the CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def auto_choice(device: torch.device) -> BackendChoice:
    """What ``backend="auto"`` runs on ``device`` (for bf16/fp16/fp32; float64 always
    takes the torch path), and whether that was measured."""
    if device.type != "cuda":
        return _CPU
    if not triton_available():
        return _NO_TRITON
    key = device_class(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    return MEASURED_CHOICES.get(key, _UNMEASURED_GPU)
