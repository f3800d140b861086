"""Megatron Core 0.16: ``copy_to_tensor_model_parallel_region``'s backward
returns the unreduced gradient when that gradient is not contiguous.

``_reduce`` all-reduces ``input_.contiguous()``: for a non-contiguous tensor
that is a copy, which is reduced and thrown away, and the input is returned as
it was. Runs on a CPU with torch and megatron-core only: two processes over
gloo (tensor parallel size 2). Each rank copies ``x`` into the region and
takes a loss whose gradient reaches the copy transposed (not contiguous), and
once contiguous as a control. Rank ``r`` contributes ``r + 1``, so the right
gradient of ``x`` is 3 everywhere. Prints one JSON line:

- ``defect``: the non-contiguous case leaves a rank with its own gradient only;
- ``grad_noncontiguous``, ``grad_contiguous``: rank 0's ``x.grad`` (one value,
  it is constant) in each case.

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket

import torch
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region


def grad_of_x(rank: int, transposed: bool) -> torch.Tensor:
    x = torch.zeros(3, 4, requires_grad=True)
    y = copy_to_tensor_model_parallel_region(x)
    weight = torch.full((4, 3) if transposed else (3, 4), float(rank + 1))
    loss = (y.t() * weight).sum() if transposed else (y * weight).sum()
    loss.backward()  # y.t()'s backward hands the copy a transposed, non-contiguous gradient
    return x.grad


def worker(rank: int, port: int, queue: mp.Queue[str]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    noncontiguous = grad_of_x(rank, transposed=True)
    contiguous = grad_of_x(rank, transposed=False)
    if rank == 0:
        report = {
            "megatron_core": importlib.metadata.version("megatron-core"),
            "defect": not bool((noncontiguous == 3.0).all()),
            "grad_noncontiguous": float(noncontiguous.flatten()[0]),
            "grad_contiguous": float(contiguous.flatten()[0]),
            "expected": 3.0,
        }
        queue.put(json.dumps(report))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked, not spawned: nothing has run here but imports, and a rank then need not
    # import torch and Megatron again (most of the run time on a CPU)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    report = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print(report)


if __name__ == "__main__":
    main()
