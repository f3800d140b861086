"""Megatron Core: with two pipeline ranks and ``batch_p2p_comm=True`` (the
default), the interleaved schedule's send-forward-backward/recv-forward-backward
step puts the activation into the gradient's buffer and the gradient into the
activation's.

``_batched_p2p_ops`` posts ``[send_prev, recv_prev, send_next, recv_next]`` in one
``batch_isend_irecv`` on every rank. With two ranks the previous and the next
rank are the same process, so each rank sends its peer two messages and receives
two, and point-to-point messages between one pair of ranks match in posting
order: rank 0 sends the gradient (to "prev") first, rank 1 receives into its
activation buffer (from "prev") first. Same shapes, so no error.

Runs on a CPU with torch and megatron-core only: two processes over gloo,
pipeline parallel size 2, one call of
``P2PCommunicator.send_forward_backward_recv_forward_backward`` (the call of the
interleaved schedule's steady state). Rank ``r`` sends the activation
``10 (r + 1) + 1`` to the next rank and the gradient ``10 (r + 1) + 2`` to the
previous one, so rank 0 should receive the activation 21 and the gradient 22.
Prints one JSON line:

- ``defect``: with ``batch_p2p_comm=True`` a rank's buffers do not hold what its
  peer sent into them;
- ``batched``, ``unbatched``: rank 0's ``[activation, gradient]`` received with
  ``batch_p2p_comm`` True and False (Megatron's ``_p2p_ops``, the control);
- ``swapped``: the batched buffers hold exactly the two messages, crossed;
- ``reordered_batch_correct``: one ``batch_isend_irecv`` of the same four
  operations with the sends posted next-then-prev and the receives prev-then-next
  (the order ``_p2p_ops`` keeps per peer) delivers correctly, so a batch can.

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
from unittest import mock

import torch
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

SHAPE = (2, 1, 4)  # [sequence, micro-batch, hidden], as the schedule's tensor_shape


def exchange(rank: int, *, batch_p2p_comm: bool) -> list[float]:
    """Rank ``rank``'s received [activation, gradient] (one value each: constant)."""
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=batch_p2p_comm,
        batch_p2p_sync=False,  # a torch.cuda.synchronize() otherwise
    )
    comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    activation = torch.full(SHAPE, 10.0 * (rank + 1) + 1)
    gradient = torch.full(SHAPE, 10.0 * (rank + 1) + 2)
    # the receive buffers are torch.empty(..., device=torch.cuda.current_device())
    with mock.patch("torch.cuda.current_device", return_value="cpu"):
        got_activation, got_gradient = comm.send_forward_backward_recv_forward_backward(
            activation, gradient, recv_prev=True, recv_next=True, tensor_shape=SHAPE
        )
    return [float(got_activation.flatten()[0]), float(got_gradient.flatten()[0])]


def reordered_batch(rank: int) -> list[float]:
    """The same four operations in one batch, sends next-then-prev, receives
    prev-then-next: what each peer sends is posted in the order it is received."""
    group = parallel_state.get_pipeline_model_parallel_group()
    peer = 1 - rank
    got_activation, got_gradient = torch.empty(SHAPE), torch.empty(SHAPE)
    ops = [
        torch.distributed.P2POp(
            torch.distributed.isend, torch.full(SHAPE, 10.0 * (rank + 1) + 1), peer, group
        ),
        torch.distributed.P2POp(
            torch.distributed.isend, torch.full(SHAPE, 10.0 * (rank + 1) + 2), peer, group
        ),
        torch.distributed.P2POp(torch.distributed.irecv, got_activation, peer, group),
        torch.distributed.P2POp(torch.distributed.irecv, got_gradient, peer, group),
    ]
    for req in torch.distributed.batch_isend_irecv(ops):
        req.wait()
    return [float(got_activation.flatten()[0]), float(got_gradient.flatten()[0])]


def worker(rank: int, port: int, queue: mp.Queue[str]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    batched = exchange(rank, batch_p2p_comm=True)
    unbatched = exchange(rank, batch_p2p_comm=False)
    reordered = reordered_batch(rank)
    peer = 1 - rank
    expected = [10.0 * (peer + 1) + 1, 10.0 * (peer + 1) + 2]
    wrong = torch.tensor(float(batched != expected))
    torch.distributed.all_reduce(wrong)  # the defect on either rank
    if rank == 0:
        report = {
            "megatron_core": importlib.metadata.version("megatron-core"),
            "torch": torch.__version__,
            "defect": bool(wrong.item() > 0),
            "batched": batched,
            "unbatched": unbatched,
            "expected": expected,
            "swapped": batched == expected[::-1],
            "unbatched_correct": unbatched == expected,
            "reordered_batch_correct": reordered == expected,
        }
        queue.put(json.dumps(report))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
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
