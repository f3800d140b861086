"""Megatron Core: ``destroy_model_parallel`` leaves two process groups referenced by
``parallel_state``, alive with their sockets and threads for the life of the process.

``initialize_model_parallel`` sets ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and
``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO`` (with one distributed-optimizer
instance, aliases of the data-parallel groups with context parallel);
``destroy_model_parallel`` resets the groups they alias but not these two names. A
gloo group lives as long as a reference does: destroying it with
``torch.distributed.destroy_process_group`` takes it out of torch's registry and frees
nothing.

Runs on a CPU with torch and megatron-core only: one gloo process (world size 1),
``initialize_model_parallel()`` then ``destroy_model_parallel()`` and
``destroy_process_group`` on every group it registered, as a careful caller does; once
to warm up (what a first initialisation makes once per process), then measured.
Prints one JSON line:

- ``defect``: some global of ``parallel_state`` still holds a process group after
  ``destroy_model_parallel``;
- ``left``: those globals, found by enumerating the module's globals before
  ``initialize_model_parallel`` and after ``destroy_model_parallel``;
- ``listening_sockets``, ``threads``: this process's listening TCP sockets and threads
  before the measured ``initialize_model_parallel``, after the teardown, and after the references
  are dropped (the control: the script sets the names back to ``None``, the value
  they had, and collects garbage);
- ``freed_by_dropping``: the control gave back every socket and thread the teardown left.

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import socket

import torch
from megatron.core import parallel_state


def holds_group(value: object) -> bool:
    group = torch.distributed.ProcessGroup
    if isinstance(value, group):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, group) for v in value)


def group_globals() -> dict[str, object]:
    return {name: value for name, value in vars(parallel_state).items() if holds_group(value)}


def listening_sockets() -> int:
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                listening |= {
                    line.split()[9] for line in f.read().splitlines()[1:] if line.split()[3] == "0A"
                }
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    return len(listening & mine)


def resources() -> list[int]:
    return [listening_sockets(), len(os.listdir("/proc/self/task"))]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def destroy_new_groups(registry: dict[object, object], registered: set[object]) -> None:
    """``destroy_process_group`` on every group registered since ``registered`` (in a
    function of its own: no local name keeps the last one alive)."""
    for group in [g for g in list(registry) if g not in registered]:
        torch.distributed.destroy_process_group(group)


def cycle(registry: dict[object, object]) -> tuple[list[str], list[int], list[int]]:
    """One ``initialize_model_parallel`` / ``destroy_model_parallel``, every group it
    registered destroyed; ``(left, resources after, resources after the control)``."""
    registered = set(registry)
    held = group_globals()
    parallel_state.initialize_model_parallel()
    parallel_state.destroy_model_parallel()
    destroy_new_groups(registry, registered)
    gc.collect()
    left = sorted(name for name, value in group_globals().items() if held.get(name) is not value)
    after = resources()
    for name in left:  # the control: the reference dropped, the group goes
        setattr(parallel_state, name, held.get(name))
    gc.collect()
    return left, after, resources()


def main() -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    registry = (
        torch.distributed.distributed_c10d._world.pg_map
    )  # torch's registry (no public listing)
    cycle(registry)  # what a first initialisation makes once per process (imports, pools)
    before = resources()
    left, after, dropped = cycle(registry)
    torch.distributed.destroy_process_group()
    print(
        json.dumps(
            {
                "megatron_core": importlib.metadata.version("megatron-core"),
                "torch": torch.__version__,
                "defect": bool(left),
                "left": left,
                "listening_sockets": [before[0], after[0], dropped[0]],
                "threads": [before[1], after[1], dropped[1]],
                "freed_by_dropping": dropped == before and after != before,
            }
        )
    )


if __name__ == "__main__":
    main()
