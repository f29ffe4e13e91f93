"""What an NCCL_DEBUG=INFO log shows for each call torch's ProcessGroupNCCL issues.

The interposer records calls as torch.distributed sees them; NCCL logs the ``ncclXxx`` calls
ProcessGroupNCCL makes for them, which differ. :func:`expected_nccl_log` turns reference
(interposer) events into the events an NCCL log must hold, one per COLL line, so that
:func:`tracer.crosscheck.crosscheck` can compare them one to one. Rules (citations in
``docs/tracer.md``, "NCCL log: what torch's calls become"):

- datatype (``getNcclDataType`` in ``ProcessGroupNCCL.cpp``, ``to_nccl_data_type`` in
  ``torch/csrc/cuda/nccl.cpp``): ``bool`` is logged as uint8 (``datatype 1``), same count.
  A complex tensor goes as ``torch.view_as_real``: float32 / float64 / float16 for complex64
  / complex128 / complex32, twice the count.
- ``barrier``: an AllReduce of one float32 element on the group's communicator
  (``ProcessGroupNCCL::barrier``: ``at::zeros({1}, kFloat)``, then all-reduce).
- ``send`` / ``recv`` issued alone: on a two-rank communicator of the pair
  (``ProcessGroupNCCL::pointToPoint``: "for single P2P, preserve the old two-rank behavior";
  the lower group rank is rank 0 there), so the logged ``root`` (the peer) is 0 or 1 and the
  group is the two ranks. Inside ``batch_isend_irecv`` they use the group's communicator
  instead; the interposer does not mark that, so such calls are expected on the pair's
  communicator and a log of them fails the check with both sides named.
- ``gather`` / ``scatter`` (``torch::cuda::nccl::gather`` / ``scatter``): inside one group
  the root receives (sends) ``count`` elements from (to) every other rank, one Recv (Send)
  line per peer in rank order, and copies its own part locally; every other rank logs one
  Send (Recv) to the root. A group of one rank logs nothing. ``Lowering.gather_native``
  expects one Gather / Scatter line instead (a build that calls ``ncclGather``).
- ``all_to_all`` with equal parts (``all2all_single_equal_split``): one ``AlltoAll`` line
  from NCCL 2.28.0, else a Send and a Recv of ``count`` to and from every rank of the group,
  itself included, in rank order (2·n lines). Uneven parts (``all2all_single_unequal_split``,
  the splits the interposer notes in ``source_ref``): Send ``in_split[p]`` and Recv
  ``out_split[p]`` rows' elements per peer ``p`` on every NCCL version (NCCL has no
  all-to-all-v).
- every other op: one line of the same op, count, root and group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tracer.events import CollectiveEvent, group_id_from_ranks

#: torch dtype -> (dtype NCCL logs, count factor) where they differ.
NCCL_VIEW_DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("uint8", 1),
    "complex64": ("float32", 2),
    "complex128": ("float64", 2),
    "complex32": ("float16", 2),
}

_SPLITS = re.compile(r"in_splits=\[([\d, ]*)\] out_splits=\[([\d, ]*)\] row_elems=(\d+)")
_LIST_SPLITS = re.compile(r"uneven all_to_all in=\[([\d, ]*)\] out=\[([\d, ]*)\]")


@dataclass(frozen=True)
class Lowering:
    """How the NCCL in use runs the calls that changed with NCCL versions.

    Attributes:
        alltoall_native: an equal all_to_all is one ``ncclAlltoAll`` (NCCL >= 2.28.0,
            ``all2all_single_equal_split``), else Send/Recv pairs.
        gather_native: gather / scatter are one ``ncclGather`` / ``ncclScatter`` (not what
            ``torch/csrc/cuda/nccl.cpp`` calls in the torch read; for builds that do).
    """

    alltoall_native: bool
    gather_native: bool = False

    @classmethod
    def for_version(cls, nccl_version: Sequence[int] | None) -> Lowering:
        """The lowering of ``nccl_version`` (``torch.cuda.nccl.version()``, e.g. ``(2, 27, 5)``);
        ``None`` (unknown) assumes NCCL < 2.28.

        Raises:
            ValueError: a version that is not 3 non-negative ints.
        """
        if nccl_version is None:
            return cls(alltoall_native=False)
        version = tuple(nccl_version)
        if len(version) != 3 or not all(isinstance(v, int) and v >= 0 for v in version):
            raise ValueError(f"Invalid {nccl_version=}. Must be (major, minor, patch) ints, as "
                             "torch.cuda.nccl.version() returns.")
        return cls(alltoall_native=version >= (2, 28, 0))


@dataclass
class NcclExpectation:
    """:func:`expected_nccl_log`'s result.

    Attributes:
        events: the expected log events (``source="interposer"``, ``source_ref`` naming the
            reference call and the line), ``seq`` numbered per (rank, group_id).
        problems: reference calls no rule can expand (named; they fail the check).
        lowered: how many reference calls became something else than one line of their op.
    """

    events: list[CollectiveEvent] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    lowered: int = 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _uneven_counts(ev: CollectiveEvent, factor: int) -> tuple[list[int], list[int]] | None:
    """Per-peer send and receive counts of an uneven all_to_all, from the interposer's note."""
    m = _SPLITS.search(ev.source_ref)
    if m:
        row = int(m.group(3)) * factor
        return [s * row for s in _ints(m.group(1))], [s * row for s in _ints(m.group(2))]
    m = _LIST_SPLITS.search(ev.source_ref)
    if m:
        return [s * factor for s in _ints(m.group(1))], [s * factor for s in _ints(m.group(2))]
    return None


def _lines(ev: CollectiveEvent, low: Lowering) -> list[dict]:
    """The lines of one reference call, as CollectiveEvent fields (raises ValueError)."""
    dtype, factor = NCCL_VIEW_DTYPES.get(ev.dtype, (ev.dtype, 1))
    count = None if ev.count is None else ev.count * factor
    same = dict(op=ev.op, count=count, dtype=dtype, root=ev.root)
    n, me = ev.group_size, ev.group_rank
    if ev.op == "barrier":
        return [dict(op="all_reduce", count=1, dtype="float32", root=None)]
    if ev.op in ("send", "recv"):
        if ev.root is None or ev.group_id is None or me is None:
            raise ValueError("a point-to-point call without its peer, group or group rank")
        ranks = [int(r) for r in ev.group_id.split(",")]
        pair = sorted({ranks[me], ranks[ev.root]})
        target = 0 if me == ev.root else (1 if me <= ev.root else 0)
        return [dict(same, root=target, group_id=group_id_from_ranks(pair), group_size=len(pair),
                     group_rank=pair.index(ranks[me]))]
    if ev.op in ("gather", "scatter") and not low.gather_native:
        if n is None or me is None or ev.root is None:
            raise ValueError("a gather / scatter without group size, group rank or root")
        to_root = "send" if ev.op == "gather" else "recv"
        from_peer = "recv" if ev.op == "gather" else "send"
        if me != ev.root:
            return [dict(same, op=to_root)]
        return [dict(same, op=from_peer, root=p) for p in range(n) if p != ev.root]
    if ev.op == "all_to_all":
        if n is None:
            raise ValueError("an all_to_all without group size")
        if ev.count is None:
            counts = _uneven_counts(ev, factor)
            if counts is None or len(counts[0]) != n or len(counts[1]) != n:
                raise ValueError("an uneven all_to_all without its per-peer splits")
            return [dict(same, op=o, count=c[p], root=p)
                    for p in range(n) for o, c in (("send", counts[0]), ("recv", counts[1]))]
        if low.alltoall_native:
            return [dict(same, in_elems=ev.in_elems and ev.in_elems * factor,
                         out_elems=ev.out_elems and ev.out_elems * factor)]
        return [dict(same, op=o, root=p) for p in range(n) for o in ("send", "recv")]
    return [same]


def expected_nccl_log(reference: Sequence[CollectiveEvent], lowering: Lowering) -> NcclExpectation:
    """The events an NCCL log must hold for ``reference`` (module docstring).

    Args:
        reference: interposer events of one window (every rank's).
        lowering: the NCCL version's behaviour (:meth:`Lowering.for_version`).

    Returns:
        An :class:`NcclExpectation`; a call no rule expands is named in ``problems``.
    """
    out = NcclExpectation()
    seq: dict = defaultdict(int)
    for ev in reference:
        try:
            lines = _lines(ev, lowering)
        except ValueError as exc:
            out.problems.append(f"{ev.source_ref or ev.op} (rank {ev.rank}): {exc}; no NCCL "
                                "line can be expected for it")
            continue
        if len(lines) != 1 or lines[0]["op"] != ev.op or lines[0]["count"] != ev.count:
            out.lowered += 1
        for i, line in enumerate(lines):
            fields = {**dict(rank=ev.rank, group_id=ev.group_id, group_size=ev.group_size,
                             group_rank=ev.group_rank, phase=ev.phase, module=ev.module,
                             t_start_ns=ev.t_start_ns, t_end_ns=ev.t_end_ns, pid=ev.pid,
                             host=ev.host), **line}
            key = (fields["rank"], fields["group_id"])
            ref = ev.source_ref if len(lines) == 1 else f"{ev.source_ref} [line {i + 1}/{len(lines)}]"
            out.events.append(CollectiveEvent(source="interposer", seq=seq[key], source_ref=ref,
                                              **fields))
            seq[key] += 1
    return out
