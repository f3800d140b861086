"""The label range check that does not stall the GPU (``torch_impl.label_check``).

On a CPU the check is immediate and names the field, the range and the ids found. On
CUDA (``gpu``-marked) it makes no host read: the result of one call is read at the
next call or on request, and a captured CUDA graph carries a device-side assert.
"""

from __future__ import annotations

import pytest
import torch

from hookspec import ContractError
from torch_impl.label_check import check_labels_deferred, pending_label_checks, raise_pending_label_errors


def test_cpu_is_immediate_and_names_the_values() -> None:
    check_labels_deferred(torch.tensor([0, 4, -100]), 5, ignore_index=-100)
    with pytest.raises(ContractError) as err:
        check_labels_deferred(torch.tensor([0, 7, -3, -100, 9]), 5, ignore_index=-100, field="labels")
    text = str(err.value)
    assert "labels" in text and "[0, 5)" in text and "3 ids outside it, in [-3, 9]" in text
    assert pending_label_checks() == 0


def test_cpu_wrong_types_are_named() -> None:
    with pytest.raises(ContractError, match="integer dtype"):
        check_labels_deferred(torch.tensor([0.0, 1.0]), 5, ignore_index=-100)
    with pytest.raises(ContractError, match="array"):
        check_labels_deferred([0, 1], 5, ignore_index=-100)


@pytest.mark.gpu
def test_cuda_defers_without_a_host_read() -> None:
    raise_pending_label_errors(wait=True)
    good = torch.tensor([0, 4, -100], device="cuda")
    bad = torch.tensor([0, 7, -3, -100], device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        check_labels_deferred(good, 5, ignore_index=-100)
        check_labels_deferred(bad, 5, ignore_index=-100, field="labels")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending_label_checks() >= 1
    with pytest.raises(ContractError, match=r"2 ids outside it, in \[-3, 7\]"):
        raise_pending_label_errors(wait=True)
    assert pending_label_checks() == 0


@pytest.mark.gpu
def test_cuda_graph_capture_carries_the_check() -> None:
    labels = torch.tensor([0, 4, -100], device="cuda")
    out = torch.zeros(3, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture, as torch.cuda.graphs requires
        check_labels_deferred(labels, 5, ignore_index=-100)
        raise_pending_label_errors(wait=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        check_labels_deferred(labels, 5, ignore_index=-100)
        out.copy_(labels.float())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.tensor([0.0, 4.0, -100.0]))
