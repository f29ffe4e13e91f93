"""Communicator resolution for NCCL logs: comm pointer -> rank, group_id, group_rank, size.

One :class:`Resolver` per parse (all inputs of one job). It learns from INIT / DESTROY and
PyTorch ``created ncclComm_`` records (:meth:`Resolver.init`, :meth:`Resolver.torch`) and
resolves COLL rows in *segments*: runs of COLL rows with no INIT / PyTorch record between them
(:meth:`Resolver.resolve_segment`, numpy-vectorised; within a segment nothing that decides an
identity changes). The rules are those of :mod:`tracer.nccl.log`'s module docstring.

An *epoch* (:class:`_Comm`) is one life of a comm pointer in one process: a pointer reused
after ``Destroy COMPLETE`` (or a second INIT after COLL lines) starts a new epoch with its own
``seq`` numbering. Every row carries its epoch index, so the end-of-parse correction
(:meth:`Resolver.final_fixes`: an INIT line after its COLL lines, a wider communicator created
later) is applied per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracer.nccl.columns import NULL
from tracer.nccl.records import InitRecord, ParseIssue, TorchCommRecord


@dataclass(frozen=True, slots=True)
class CommInfo:
    """One communicator as seen by one process (one epoch of a comm pointer).

    ``rank`` is the resolved world rank, ``group_rank`` the rank inside the communicator,
    ``nranks`` its size; ``init_ref`` is ``file:line`` of its INIT line (``None``: no INIT
    line was logged). ``calls`` counts its COLL lines.
    """

    comm: str
    host: str | None
    pid: int | None
    cuda_dev: int | None
    rank: int | None
    group_rank: int | None
    nranks: int | None
    group_id: str
    comm_id: str | None
    parent: str | None
    color: int | None
    split_count: int | None
    init_ref: str | None
    torch_pg: str | None
    calls: int


@dataclass(slots=True)
class _Comm:
    proc: tuple
    comm: str
    file: str
    idx: int  # epoch index: position in Resolver.epochs
    cuda_dev: int | None = None
    init: InitRecord | None = None
    init_ref: str | None = None
    calls: int = 0
    nranks_seen: int | None = None
    destroyed: bool = False
    used: tuple | None = None  # resolution its latest rows were built with
    used_version: int = -1  # resolver version `used` was computed at
    stale: bool = False  # rows were built with more than one resolution


def proc_key(host: str | None, pid: int | None, file: str) -> tuple:
    """The process a line belongs to: ``(host, pid)``, or ``("file:<file>", None)`` when its
    prefix names no pid."""
    return (host, pid) if pid is not None else (f"file:{file}", None)


@dataclass(slots=True)
class Segment:
    """Resolution of the COLL rows of one segment (arrays of length rows, in row order).

    ``rank``, ``group_rank``, ``group_size``: int64, :data:`tracer.nccl.columns.NULL` where
    unknown; ``group_id``: one string per distinct communicator, indexed by ``key``; ``seq``:
    0-based call index per epoch; ``epoch``: epoch index; ``bad``: rows that are issues
    (``issues``, same order), not events.
    """

    key: np.ndarray
    group_id: list[str]
    rank: np.ndarray
    group_rank: np.ndarray
    group_size: np.ndarray
    seq: np.ndarray
    epoch: np.ndarray
    bad: np.ndarray
    issues: list[ParseIssue]


def nranks_issue(file: str, line_no: int, nranks: int, c: _Comm, known: int) -> ParseIssue:
    """A COLL line whose ``[nranks=]`` disagrees with the size known for its comm."""
    where = (f"the INIT line {c.init_ref}" if c.init_ref is not None
             else "its earlier COLL lines (no INIT line)")
    return ParseIssue(file, line_no, f"nranks={nranks} disagrees with the size {known} of "
                      f"comm {c.comm} from {where}; line skipped", c.comm)


def _int(value: int | None) -> int:
    return NULL if value is None else value


class Resolver:
    """Comm pointer -> communicator state across all inputs of one parse."""

    def __init__(self):
        self.comms: dict[tuple, _Comm] = {}  # (proc, comm) -> current epoch
        self.history: list[_Comm] = []  # replaced epochs (pointer reuse)
        self.epochs: list[_Comm] = []  # every epoch, by index
        self.torch_by_file: dict[tuple, TorchCommRecord] = {}
        self.torch_by_tid: dict[tuple, TorchCommRecord] = {}
        self.widest: dict[tuple, tuple[int, int]] = {}  # (proc, dev) -> (nranks, rank)
        self.version = 0  # bumped by every INIT / PyTorch record: cached resolutions expire

    def _new(self, proc: tuple, comm: str, file: str, cuda_dev: int | None = None) -> _Comm:
        c = _Comm(proc, comm, file, len(self.epochs), cuda_dev=cuda_dev)
        self.epochs.append(c)
        self.comms[(proc, comm)] = c
        return c

    def torch(self, rec: TorchCommRecord) -> None:
        """Learn a PyTorch ``created ncclComm_`` line."""
        self.version += 1
        self.torch_by_file[(rec.file, rec.comm)] = rec
        if rec.tid is not None:
            self.torch_by_tid[(rec.tid, rec.comm)] = rec

    def init(self, rec: InitRecord) -> None:
        """Learn an INIT (START / COMPLETE) or DESTROY line."""
        self.version += 1
        proc = proc_key(rec.host, rec.pid, rec.file)
        key = (proc, rec.comm)
        c = self.comms.get(key)
        if rec.state == "DESTROY":
            if c is not None:
                c.destroyed = True
            return
        if c is None or (c.init is not None and (c.calls or c.destroyed)):
            if c is not None:
                self.history.append(c)
            c = self._new(proc, rec.comm, rec.file)
        elif c.calls:
            c.stale = True  # INIT after its COLL lines: rows so far need correcting
        c.init = rec
        c.init_ref = f"{rec.file}:{rec.line_no}"
        c.cuda_dev = rec.cuda_dev
        wk = (proc, rec.cuda_dev)
        if rec.nranks > self.widest.get(wk, (0, 0))[0]:
            self.widest[wk] = (rec.nranks, rec.rank)

    def resolve_segment(self, file: str, keys: list[tuple], key: np.ndarray,
                        coll_nranks: np.ndarray, line_no: np.ndarray) -> Segment:
        """Resolve the COLL rows of one segment of ``file``.

        Args:
            keys: distinct ``(proc, comm, cuda_dev of its first row)`` in order of first
                appearance.
            key: int array (rows,), the row's index into ``keys``.
            coll_nranks: int64 (rows,), the line's ``[nranks=]`` or
                :data:`tracer.nccl.columns.NULL`.
            line_no: int64 (rows,), 1-based line numbers (for issues).
        """
        nkeys, rows = len(keys), len(key)
        used: list[tuple] = []
        cs: list[_Comm] = []
        for proc, ptr, dev in keys:  # in first-appearance order, as line-by-line would
            c = self.comms.get((proc, ptr))
            if c is None:
                c = self._new(proc, ptr, file, cuda_dev=dev)
            if c.used_version != self.version:
                res = self.resolve(c)
                if c.used != res:
                    if c.used is not None:
                        c.stale = True
                    c.used = res
                c.used_version = self.version
            cs.append(c)
            used.append(c.used)
        base = np.array([c.calls for c in cs], np.int64)
        if nkeys == 1:
            seq = base[0] + np.arange(rows, dtype=np.int64)
            counts = [rows]
        else:
            order = np.argsort(key, kind="stable")
            counts_arr = np.bincount(key, minlength=nkeys)
            first = np.cumsum(counts_arr) - counts_arr
            sorted_key = key[order]
            seq = np.empty(rows, np.int64)
            seq[order] = np.arange(rows, dtype=np.int64) - first[sorted_key] + base[sorted_key]
            counts = counts_arr.tolist()
        for c, n in zip(cs, counts):
            c.calls += n
        used_n = np.array([_int(u[3]) for u in used], np.int64)[key]
        has_n = coll_nranks != NULL
        bad = has_n & (used_n != NULL) & (coll_nranks != used_n)
        issues = [nranks_issue(file, int(line_no[i]), int(coll_nranks[i]), cs[key[i]],
                               int(used_n[i])) for i in np.flatnonzero(bad).tolist()]
        seen = has_n & ~bad
        if seen.any():  # nranks_seen: the last [nranks=] of each comm's event rows
            idx = np.flatnonzero(seen)[::-1]
            uniq, first_rev = np.unique(key[idx], return_index=True)
            for k, i in zip(uniq.tolist(), idx[first_rev].tolist()):
                cs[k].nranks_seen = int(coll_nranks[i])
        per_key = np.array([(_int(u[0]), _int(u[2])) for u in used], np.int64).reshape(-1, 2)
        return Segment(
            key=key, group_id=[u[1] for u in used], rank=per_key[key, 0],
            group_rank=per_key[key, 1], group_size=np.where(has_n, coll_nranks, used_n),
            seq=seq, epoch=np.array([c.idx for c in cs], np.int64)[key], bad=bad,
            issues=issues)

    def final_fixes(self) -> dict[int, tuple]:
        """Epochs whose rows were built with a resolution other than the final one:
        ``{epoch: (rank, group_id, group_rank, nranks)}`` as resolved now."""
        out = {}
        for c in self.epochs:
            res = self.resolve(c)
            if c.stale or (c.used is not None and c.used != res):
                out[c.idx] = res
        return out

    def _torch(self, c: _Comm) -> TorchCommRecord | None:
        t = self.torch_by_tid.get((c.proc[1], c.comm)) if c.proc[1] is not None else None
        return t or self.torch_by_file.get((c.file, c.comm))

    def group_id(self, c: _Comm, depth: int = 0) -> str:
        init = c.init
        if init is not None and init.comm_id:
            return init.comm_id
        if init is not None and init.parent and depth < 16:
            parent = self.comms.get((c.proc, init.parent))
            pgid = (self.group_id(parent, depth + 1) if parent is not None
                    else self._local(c.proc, init.parent))
            split = f"/split{init.split_count}" if init.split_count is not None else ""
            return f"{pgid}{split}/color{init.color}"
        t = self._torch(c)
        if t is not None:
            return f"torch_pg:{t.pg}"
        return self._local(c.proc, c.comm)

    @staticmethod
    def _local(proc: tuple, comm: str) -> str:
        where = proc[0] if proc[1] is None else f"{proc[0]}:{proc[1]}"
        return f"local:{where}:{comm}"

    def resolve(self, c: _Comm) -> tuple:
        """``(rank, group_id, group_rank, nranks)`` of a communicator from what is known now."""
        t = self._torch(c)
        group_rank = c.init.rank if c.init is not None else (t.group_rank if t else None)
        nranks = c.init.nranks if c.init is not None else c.nranks_seen
        rank = None
        if t is not None and t.pg_name == "default_pg":
            rank = t.group_rank
        elif c.init is not None:
            rank = self.widest.get((c.proc, c.cuda_dev), (0, None))[1]
        return (rank, self.group_id(c), group_rank, nranks)

    def all_comms(self) -> list[_Comm]:
        return self.history + list(self.comms.values())

    def info(self, c: _Comm) -> CommInfo:
        rank, gid, group_rank, nranks = self.resolve(c)
        init, t = c.init, self._torch(c)
        return CommInfo(
            comm=c.comm, host=c.proc[0] if c.proc[1] is not None else None, pid=c.proc[1],
            cuda_dev=c.cuda_dev, rank=rank, group_rank=group_rank, nranks=nranks, group_id=gid,
            comm_id=init.comm_id if init else None, parent=init.parent if init else None,
            color=init.color if init else None, split_count=init.split_count if init else None,
            init_ref=c.init_ref, torch_pg=t.pg if t else None, calls=c.calls)

    def comm_infos(self) -> list[CommInfo]:
        """Every epoch seen, then PyTorch comm lines whose pointer no process used."""
        comms = [self.info(c) for c in self.all_comms()]
        seen = {c.comm for c in self.epochs}
        for (file, ptr), t in self.torch_by_file.items():
            if ptr not in seen:
                comms.append(CommInfo(
                    comm=ptr, host=None, pid=None, cuda_dev=t.cuda_dev,
                    rank=t.group_rank if t.pg_name == "default_pg" else None,
                    group_rank=t.group_rank, nranks=None, group_id=f"torch_pg:{t.pg}",
                    comm_id=None, parent=None, color=None, split_count=None,
                    init_ref=f"{file}:{t.line_no}", torch_pg=t.pg, calls=0))
        return comms
