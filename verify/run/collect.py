"""Collect every rank's trace files into rank 0's output folder when the nodes share no filesystem.

What rank 0's report needs already travels through the process group (each mode's events,
Flight Recorder, profiler and NCCL-log windows, ``verify.run.runner``); what stays on a node's
local disk are the files behind them, which ``dmuon-verify check`` and a person debugging
read: per rank and mode ``events_rank<r>.parquet``, ``profiler_rank<r>.json``,
``fr_rank<r>.json`` (and ``fr_before/``), ``error_rank<r>.txt``, and the process's NCCL log
``nccl/nccl.<host>.<pid>.log``. Why over the process group rather than bundles merged
offline: the job then leaves one complete folder on one machine, with nothing for the user to
copy, and the same code runs on a shared filesystem (where it moves nothing).

After the last mode, on every rank (:func:`collect_to_rank0`):

1. rank 0 writes a marker with a random token in its ``--out-dir``; every rank that reads the
   same token in its own ``--out-dir`` shares rank 0's filesystem and sends nothing;
2. the others list their own files (:func:`own_files`); every rank gets every list
   (``all_gather_object``) and checks the total against ``max_bytes``. Past it, nothing
   moves and every rank says so (the report's ``nodes.collected.error`` names the total, the
   limit, the flag and the fix);
3. each file goes to rank 0 as one uint8 tensor (``send`` / ``recv``, on a gloo group under
   NCCL, the files being host memory) and is written at the same path under rank 0's folder.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from tracer.backends import parse_backend

#: Default limit of the bytes collected over the process group (``--collect-max-mb``).
DEFAULT_MAX_MB = 512
MARKER = ".rank0-marker"


def own_files(out_dir: str | Path, rank: int, pid: int | None = None) -> list[str]:
    """This rank's files under ``out_dir`` (paths relative to it, sorted): every file whose
    name ends in ``rank<r>.<ext>`` (``events_rank3.parquet``, ``fr_before/fr_rank3.json``),
    and the NCCL log of process ``pid`` (``nccl/*.<pid>.log``, NCCL's ``%p``)."""
    root = Path(out_dir)
    mine = re.compile(rf"(^|[_.-])rank{rank}\.[A-Za-z0-9]+$")
    found = [p for p in root.rglob("*") if p.is_file() and mine.search(p.name)]
    if pid is not None:
        found += [p for p in root.glob(f"nccl/*.{pid}.log") if p.is_file()]
    return sorted(str(p.relative_to(root)) for p in set(found))


def limit_problem(manifests: list[dict], max_bytes: int) -> str | None:
    """The error when the files to collect exceed ``max_bytes``, else ``None``."""
    total = sum(size for m in manifests for _, size in m["files"])
    if total <= max_bytes:
        return None
    senders = [m["rank"] for m in manifests if m["files"]]
    return (f"not collected: ranks {senders} hold {total / 2**20:.1f} MiB of trace files, over "
            f"--collect-max-mb {max_bytes / 2**20:g}. Raise --collect-max-mb, or copy each node's "
            "--out-dir to rank 0's machine (the report itself is complete).")


def needs_gloo_group(backend: str) -> bool:
    """Whether a group with ``backend`` (a ``dist.get_backend()`` string) lacks gloo for CPU
    tensors, so the files need a gloo group of their own: ``"nccl"`` yes; ``"gloo"`` and torch's
    default on a GPU node, ``"cpu:gloo,cuda:nccl"``, no (``tracer.backends``).

    Raises:
        ValueError: a malformed backend string (``tracer.backends.parse_backend``).
    """
    return parse_backend(backend).get("cpu") != "gloo"


def collect_to_rank0(out_dir: str | Path, max_bytes: int = DEFAULT_MAX_MB * 2**20,
                     group=None) -> dict | None:
    """Bring the files of ranks that do not share rank 0's filesystem into rank 0's
    ``out_dir`` (module docstring); every rank calls it, after the last mode.

    Args:
        out_dir: this rank's ``--out-dir`` (each node's may differ).
        max_bytes: the most bytes moved in all; 0 moves nothing and says so.
        group: the group to move them on (default: the default group where it has gloo for
            CPU tensors, else a new gloo group; :func:`needs_gloo_group`).

    Returns:
        On rank 0 ``{"ranks": [senders], "files", "bytes", "error"}`` (``error`` ``None``
        where all moved); ``None`` on the other ranks.
    """
    root = Path(out_dir)
    rank = dist.get_rank()
    token = [secrets.token_hex(8) if rank == 0 else None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text(token[0])
    dist.broadcast_object_list(token, src=0)
    marker = root / MARKER
    shared = marker.is_file() and marker.read_text() == token[0]
    files = [] if shared else own_files(root, rank, os.getpid())
    mine = {"rank": rank, "files": [(f, (root / f).stat().st_size) for f in files]}
    manifests: list = [None] * dist.get_world_size()
    dist.all_gather_object(manifests, mine)
    if rank == 0:
        marker.unlink(missing_ok=True)
    senders = [m for m in manifests if m["files"]]
    summary = {"ranks": [m["rank"] for m in senders],
               "files": sum(len(m["files"]) for m in senders),
               "bytes": sum(s for m in senders for _, s in m["files"]), "error": None}
    problem = limit_problem(manifests, max_bytes) if senders else None
    if max_bytes <= 0 and senders:
        problem = "not collected: --collect-max-mb 0"
    if problem:
        summary["error"] = problem
        return summary if rank == 0 else None
    if senders and group is None and needs_gloo_group(dist.get_backend()):
        group = dist.new_group(backend="gloo")  # every rank: host tensors under NCCL
    for m in senders:
        for rel, size in m["files"]:
            if rank == m["rank"]:
                # the size listed (an NCCL log grows until the process ends), at least 1 byte
                payload = (root / rel).read_bytes()[:size].ljust(max(size, 1), b"\0")
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.send(data, dst=0, group=group)
            elif rank == 0:
                buf = torch.empty(max(size, 1), dtype=torch.uint8)
                dist.recv(buf, src=m["rank"], group=group)
                dest = root / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(buf.numpy().tobytes()[:size])
    return summary if rank == 0 else None
