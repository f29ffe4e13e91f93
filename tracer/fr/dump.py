"""Enable and dump PyTorch's Flight Recorder (FR) in a live process group.

Facts measured on torch 2.13 (CPU build, gloo): recording is on by default and
``TORCH_FR_BUFFER_SIZE=0`` turns it off; the size is read once per process, when the recorder
is first touched (first process group or first dump), so it must be in the environment before
``init_process_group``. gloo registers every group under the pg name ``""`` in ``pg_config``,
so a dump alone cannot say which ranks a group holds: :func:`dump_flight_recorder` adds a
``"dmuon"`` block with every group's ranks. Parsing dumps: :mod:`tracer.fr.parse`.

Two recorders. torch keeps one Flight Recorder per event type: ProcessGroupNCCL records into
the CUDA one (``FlightRecorder<at::cuda::CUDAEvent>``), dumped by
``torch._C._distributed_c10d._dump_nccl_trace_json`` / ``_dump_nccl_trace``, which exist only
in builds with NCCL (``USE_C10D_NCCL``: absent from the CPU wheel, present in torch 2.11+cu130,
checked); gloo records into the CPU one (``FlightRecorder<c10::Event>``), dumped by
``_dump_fr_trace_json`` / ``_dump_fr_trace`` (every build). Both take ``includeCollectives`` /
``onlyActive`` (the pickle ones also ``includeStackTraces``; signatures read from the
bindings' docstrings on torch 2.13+cpu and 2.11+cu130). :func:`recorders_for` names the
recorders of the backends in use (``"cpu:gloo,cuda:nccl"``: both); a dump of several is
merged into one file (:func:`merge_dumps`). A recorder whose dump function this build lacks
is named in a :class:`RuntimeWarning` and in the dump's ``"dmuon"`` block (``"missing"``).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import warnings
from pathlib import Path

from tracer.backends import backend_names

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


#: Recorder -> (JSON dump function, pickle dump function) in ``torch._C._distributed_c10d``.
DUMP_FUNCTIONS: dict[str, tuple[str, str]] = {
    "cpu": ("_dump_fr_trace_json", "_dump_fr_trace"),
    "nccl": ("_dump_nccl_trace_json", "_dump_nccl_trace"),
}
#: Backend -> the recorder its process groups write into.
RECORDER_OF_BACKEND: dict[str, str] = {"nccl": "nccl", "gloo": "cpu"}


def recorders_for(backend: str) -> list[str]:
    """The recorders that hold the collectives of a group with this backend string, in
    :data:`DUMP_FUNCTIONS` order: ``"nccl"`` -> ``["nccl"]``, ``"gloo"`` -> ``["cpu"]``,
    ``"cpu:gloo,cuda:nccl"`` -> ``["cpu", "nccl"]`` (a backend without a recorder of its own
    is left out).

    Raises:
        ValueError: a malformed backend string (:func:`tracer.backends.parse_backend`).
    """
    used = {RECORDER_OF_BACKEND[b] for b in backend_names(backend) if b in RECORDER_OF_BACKEND}
    return [r for r in DUMP_FUNCTIONS if r in used]


def _dump_function(recorder: str, fmt: str):
    """The bound dump function, or ``None`` where this torch build lacks it."""
    import torch._C._distributed_c10d as c10d

    return getattr(c10d, DUMP_FUNCTIONS[recorder][0 if fmt == "json" else 1], None)


def _missing(recorders: list[str], fmt: str = "json", *, warn: bool = True) -> list[str]:
    """Those of ``recorders`` whose ``fmt`` dump function this build lacks (each warned)."""
    missing = [r for r in recorders if _dump_function(r, fmt) is None]
    for r in missing if warn else ():
        warnings.warn(
            f"Flight Recorder: this torch build has no torch._C._distributed_c10d."
            f"{DUMP_FUNCTIONS[r][0 if fmt == 'json' else 1]} (the {r!r} recorder, needed for "
            f"backend {_current_backend()!r}); its collectives are not in the dump. Use a torch "
            "built with NCCL (a CUDA wheel) to record NCCL groups.", RuntimeWarning, stacklevel=3)
    return missing


def _current_backend() -> str:
    import torch.distributed as dist

    return str(dist.get_backend())


def _dump_json_raw(include_collectives: bool = True, recorders: list[str] | None = None) -> dict:
    """The JSON dump of ``recorders`` (default: those of the default group's backend that
    this build has), merged when there are several."""
    recorders = recorders_for(_current_backend()) if recorders is None else recorders
    dumps = {}
    for r in recorders:
        fn = _dump_function(r, "json")
        if fn is not None:
            dumps[r] = json.loads(fn(includeCollectives=include_collectives))
    return merge_dumps(dumps)


def merge_dumps(dumps: dict[str, dict]) -> dict:
    """One dump of several recorders' dumps (recorder name -> parsed dump).

    One recorder: its dump unchanged. Several: the top-level keys of each (later recorders
    win, so ``nccl_comm_state`` / ``comm_lib_version`` come from NCCL's), ``pg_config`` and
    ``pg_status`` joined (a group registered by two backends keeps the entry with ranks), and
    ``entries`` in issue order: by ``time_created_ns`` (both recorders read the same system
    clock), ties in recorder order, renumbered ``record_id`` 0.. (the parser orders by it);
    each entry keeps its recorder's id as ``recorder_record_id`` and its recorder as
    ``recorder``, which :mod:`tracer.fr.parse` puts into the event's ``comm``
    (``"<pg name>@<recorder>"``): each backend numbers ``collective_seq_id`` on its own
    counter, so one pg name carries two sequences.
    """
    if len(dumps) <= 1:
        return next(iter(dumps.values()), {"entries": [], "pg_config": {}})
    merged: dict = {}
    entries = []
    for order, (name, dump) in enumerate(dumps.items()):
        for key, value in dump.items():
            if key in ("pg_config", "pg_status") and isinstance(value, dict):
                into = merged.setdefault(key, {})
                for pg, cfg in value.items():
                    if pg not in into or (isinstance(cfg, dict) and cfg.get("ranks") not in
                                          (None, "", "[]", [])):
                        into[pg] = cfg
            elif key != "entries":
                merged[key] = value
        for i, entry in enumerate(dump.get("entries") or []):
            t = entry.get("time_created_ns") if isinstance(entry, dict) else None
            entries.append(((t if isinstance(t, int) else 0), order, i, name, entry))
    out = []
    for new_id, (_, _, _, name, entry) in enumerate(sorted(entries, key=lambda e: e[:3])):
        if isinstance(entry, dict):
            entry = {**entry, "recorder": name, "recorder_record_id": entry.get("record_id"),
                     "record_id": new_id}
        out.append(entry)
    merged["entries"] = out
    return merged


def flight_recorder_enabled() -> bool:
    """Whether FR records this process's collectives.

    With a live process group the recorders of its backend are asked (:func:`recorders_for`;
    an enabled recorder registers each group in ``pg_config``; a disabled one dumps
    ``pg_config: {}``); ``False``, with a :class:`RuntimeWarning` naming the function, where
    this torch build has none of their dump functions. Without a group, the answer comes from
    the environment: ``TORCH_FR_BUFFER_SIZE`` (else ``TORCH_NCCL_TRACE_BUFFER_SIZE``) other
    than ``"0"``; unset counts as on (torch 2.13's default, measured on gloo).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        recorders = recorders_for(_current_backend())
        present = [r for r in recorders if r not in _missing(recorders)]
        return bool(present) and bool(
            _dump_json_raw(include_collectives=False, recorders=present).get("pg_config"))
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

    The file is FR's own dump of the recorders the default group's backend writes into
    (:func:`recorders_for`; merged by :func:`merge_dumps` under a ``cpu:gloo,cuda:nccl`` group):
    ``_dump_fr_trace_json()`` / ``_dump_nccl_trace_json()`` for ``fmt="json"``, which has no
    stack frames; the unpickled ``_dump_fr_trace()`` / ``_dump_nccl_trace()`` for
    ``fmt="pickle"``, with Python ``frames`` per
    entry only if ``include_stack_traces``: symbolising them took ~10 s per rank on the first
    dump, measured on torch 2.13 CPU with 4 ranks on 2 cores) plus one extra top-level
    key, ``"dmuon"``: ``{rank, world_size, backend, torch_version, pid, host, pg_ranks,
    recorders, missing}`` (``recorders``: those dumped; ``missing``: dump functions of needed
    recorders this build lacks, each also warned about) where
    ``pg_ranks`` maps every process group's name (as FR records it in ``process_group[0]``) to
    its sorted world ranks, because gloo's ``pg_config`` cannot be trusted for that (see the
    module docstring).

    Raises:
        ValueError: no default process group, ``rank`` is not this process's rank, ``fmt`` is
            unknown, or FR is disabled (``TORCH_FR_BUFFER_SIZE=0`` when the group was made, or
            no dump function of the backend's recorders in this build).
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
        backend = _current_backend()
        names = [DUMP_FUNCTIONS[r][0] for r in recorders_for(backend)]
        raise ValueError(
            f"Invalid Flight Recorder state: nothing recorded for backend {backend!r} in this "
            f"process ({ENV_BUFFER_SIZE}={os.environ.get(ENV_BUFFER_SIZE)!r}; dump functions "
            f"{names}, missing from this build: {_missing(recorders_for(backend), warn=False)}). "
            "Must be enabled before init_process_group (os.environ.update("
            "flight_recorder_env())) on a torch build that has the backend's recorder."
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    context = _process_group_context(rank)
    recorders = recorders_for(context["backend"])
    missing = _missing(recorders, fmt, warn=fmt != "json")  # json: warned just above
    present = [r for r in recorders if r not in missing]
    context.update(recorders=present, missing=[DUMP_FUNCTIONS[r][fmt != "json"] for r in missing])
    if fmt == "json":
        dump = _dump_json_raw(recorders=present)
        dump[CONTEXT_KEY] = context
        path = out_dir / f"fr_rank{rank}.json"
        path.write_text(json.dumps(dump))
    else:
        dump = merge_dumps({r: pickle.loads(_dump_function(r, fmt)(
            includeStackTraces=include_stack_traces)) for r in present})
        dump[CONTEXT_KEY] = context
        path = out_dir / f"fr_rank{rank}.pkl"
        path.write_bytes(pickle.dumps(dump))
    return path
