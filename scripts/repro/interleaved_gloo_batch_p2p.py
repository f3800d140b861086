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
  (the order ``_p2p_ops`` keeps per peer) delivers correctly, so a batch can;
- ``shapes``, ``shapes_swapped``: the shape exchange that precedes the transfer
  under ``variable_seq_lengths=True`` (``P2PCommunicator._communicate_shapes``), with
  ``batch_p2p_comm=False``: rank 0's ``[received from prev, received from next]``
  when each rank sends an activation of shape ``ACTIVATION`` and a gradient of
  shape ``GRADIENT``; the shapes cross although ``batch_p2p_comm`` is off (the
  shape exchange always posts one batch in Megatron's order);
- ``variable_seq_lengths_call``: the same step as a whole (shape exchange, then the
  transfer, ``batch_p2p_comm=False``), run in two processes of its own since gloo
  aborts them: their exit codes and whether gloo reported the size mismatch the
  crossed shapes cause (each rank's buffers were sized from the other message; the
  first rank to receive aborts, its peer may see its connection reset instead).

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from unittest import mock

import torch
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

SHAPE = (2, 1, 4)  # [sequence, micro-batch, hidden], as the schedule's tensor_shape
# variable sequence lengths: the activation and the gradient of two different micro-batches
ACTIVATION, GRADIENT = (3, 1, 4), (2, 1, 4)


def variable_seq_lengths_config() -> ModelParallelConfig:
    return ModelParallelConfig(
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
        variable_seq_lengths=True,
    )


def exchange_shapes(rank: int) -> list[list[int]]:
    """Rank ``rank``'s received ``[from prev, from next]`` shapes, ``batch_p2p_comm=False``."""
    comm = P2PCommunicator(
        parallel_state.get_pipeline_model_parallel_group(), variable_seq_lengths_config()
    )
    activation, gradient = torch.zeros(ACTIVATION), torch.zeros(GRADIENT)
    # its shape buffers are on torch.cuda.current_device(); it synchronizes CUDA after the batch
    with (
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch("torch.cuda.synchronize"),
    ):
        from_prev, from_next = comm._communicate_shapes(activation, gradient, True, True)
    return [list(from_prev), list(from_next)]


def variable_seq_lengths_call(rank: int, port: int) -> None:
    """One process of the whole step with variable sequence lengths (gloo aborts it)."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    comm = P2PCommunicator(
        parallel_state.get_pipeline_model_parallel_group(), variable_seq_lengths_config()
    )
    with (
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch("torch.cuda.synchronize"),
    ):
        comm.send_forward_backward_recv_forward_backward(
            torch.zeros(ACTIVATION),
            torch.zeros(GRADIENT),
            recv_prev=True,
            recv_next=True,
            tensor_shape=ACTIVATION,
        )
    print("completed", flush=True)


def run_variable_seq_lengths_call() -> dict[str, object]:
    """Both processes of :func:`variable_seq_lengths_call`; their exit codes and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--variable-seq-lengths-call", str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    mismatch = "Received data size doesn't match expected size"
    return {
        "returncodes": [p.returncode for p in procs],
        "completed": ["completed" in out for out, _ in outputs],
        # the first rank to receive aborts; its peer may then see its connection reset instead
        "gloo_size_mismatch": any(mismatch in err for _, err in outputs),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    shapes = exchange_shapes(rank)
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
            "shapes": shapes,
            "shapes_swapped": shapes == [list(GRADIENT), list(ACTIVATION)],
        }
        queue.put(json.dumps(report))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def main() -> None:
    port = free_port()
    # forked, not spawned: nothing has run here but imports, and a rank then need not
    # import torch and Megatron again (most of the run time on a CPU)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    report = json.loads(queue.get(timeout=300))
    for p in procs:
        p.join(timeout=60)
    report["variable_seq_lengths_call"] = run_variable_seq_lengths_call()
    print(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--variable-seq-lengths-call"]:
        variable_seq_lengths_call(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
