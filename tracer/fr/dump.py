"""Enable and dump PyTorch's Flight Recorder (FR) in a live process group.

Facts measured on torch 2.13 (CPU build, gloo): recording is on by default and
``TORCH_FR_BUFFER_SIZE=0`` turns it off; the size is read once per process, when the recorder
is first touched (first process group or first dump), so it must be in the environment before
``init_process_group``. gloo registers every group under the pg name ``""`` in ``pg_config``,
so a dump alone cannot say which ranks a group holds: :func:`dump_flight_recorder` adds a
``"dmuon"`` block with every group's ranks. Parsing dumps: :mod:`tracer.fr.parse`.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

#: Environment variable holding the number of FR entries kept per process (0 disables FR).
ENV_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
#: Older name that torch still reads when ``TORCH_FR_BUFFER_SIZE`` is unset.
ENV_BUFFER_SIZE_LEGACY = "TORCH_NCCL_TRACE_BUFFER_SIZE"
#: Default ring-buffer size: enough for many training steps of a small model.
DEFAULT_BUFFER_ENTRIES = 20_000
#: Key of the block :func:`dump_flight_recorder` adds to the dump (rank, groups' ranks, ...).
CONTEXT_KEY = "dmuon"


def flight_recorder_env(buffer_entries: int = DEFAULT_BUFFER_ENTRIES) -> dict[str, str]:
    """Environment to set (before ``init_process_group``) so FR keeps ``buffer_entries``.

    Raises:
        ValueError: ``buffer_entries`` is not an int >= 1.
    """
    if type(buffer_entries) is not int or buffer_entries < 1:
        raise ValueError(f"Invalid {buffer_entries=}. Must be an int >= 1 (entries per process).")
    return {ENV_BUFFER_SIZE: str(buffer_entries)}


def _dump_json_raw(include_collectives: bool = True) -> dict:
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return json.loads(_dump_fr_trace_json(includeCollectives=include_collectives))


def flight_recorder_enabled() -> bool:
    """Whether FR records in this process.

    With a live process group the recorder itself is asked (an enabled recorder registers each
    group in ``pg_config``; a disabled one dumps ``pg_config: {}``). Without one, the answer
    comes from the environment: ``TORCH_FR_BUFFER_SIZE`` (else ``TORCH_NCCL_TRACE_BUFFER_SIZE``)
    other than ``"0"``; unset counts as on (torch 2.13's default, measured on gloo).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return bool(_dump_json_raw(include_collectives=False).get("pg_config"))
    value = os.environ.get(ENV_BUFFER_SIZE, os.environ.get(ENV_BUFFER_SIZE_LEGACY))
    return value is None or value.strip() != "0"


def _process_group_context(rank: int) -> dict:
    """Rank, host, pid and every known group's ranks, keyed by the pg name FR records."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg_ranks = {}
    for pg, name in c10d._world.pg_names.items():  # private, but the only full registry
        pg_ranks[name] = sorted(dist.get_process_group_ranks(pg))
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "torch_version": str(torch.__version__),  # TorchVersion would pickle as a class
        "pid": os.getpid(),
        "host": socket.gethostname().split(".")[0],
        "pg_ranks": pg_ranks,
    }


def dump_flight_recorder(
    out_dir: str | Path, rank: int, *, fmt: str = "json", include_stack_traces: bool = False
) -> Path:
    """Write this rank's FR dump to ``out_dir/fr_rank<rank>.json`` (or ``.pkl``).

    The file is FR's own dump (``_dump_fr_trace_json()`` for ``fmt="json"``, which has no stack
    frames; the unpickled ``_dump_fr_trace()`` for ``fmt="pickle"``, with Python ``frames`` per
    entry only if ``include_stack_traces``: symbolising them took ~10 s per rank on the first
    dump, measured on torch 2.13 CPU with 4 ranks on 2 cores) plus one extra top-level
    key, ``"dmuon"``: ``{rank, world_size, backend, torch_version, pid, host, pg_ranks}`` where
    ``pg_ranks`` maps every process group's name (as FR records it in ``process_group[0]``) to
    its sorted world ranks, because gloo's ``pg_config`` cannot be trusted for that (see the
    module docstring).

    Raises:
        ValueError: no default process group, ``rank`` is not this process's rank, ``fmt`` is
            unknown, or FR is disabled (``TORCH_FR_BUFFER_SIZE=0`` when the group was made).
    """
    import torch.distributed as dist

    if fmt not in ("json", "pickle"):
        raise ValueError(f"Invalid {fmt=}. Must be 'json' or 'pickle'.")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "Invalid call dump_flight_recorder() without a process group. Must be called after "
            "torch.distributed.init_process_group()."
        )
    if rank != dist.get_rank():
        raise ValueError(f"Invalid {rank=}. Must be this process's rank {dist.get_rank()}.")
    if not flight_recorder_enabled():
        raise ValueError(
            f"Invalid Flight Recorder state: disabled in this process "
            f"({ENV_BUFFER_SIZE}={os.environ.get(ENV_BUFFER_SIZE)!r}). Must be enabled before "
            f"init_process_group: set os.environ.update(flight_recorder_env()) first."
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    context = _process_group_context(rank)
    if fmt == "json":
        dump = _dump_json_raw()
        dump[CONTEXT_KEY] = context
        path = out_dir / f"fr_rank{rank}.json"
        path.write_text(json.dumps(dump))
    else:
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(includeStackTraces=include_stack_traces))
        dump[CONTEXT_KEY] = context
        path = out_dir / f"fr_rank{rank}.pkl"
        path.write_bytes(pickle.dumps(dump))
    return path
