"""Every collective DMuon issues, in one place (the seam to audit for traffic), and the
process groups and devices they use.

Sizes in NCCL's convention: a broadcast, reduce or all_reduce of a tensor of ``numel``
elements has ``count = numel`` on every member. Roots are *group* ranks (``group_src`` /
``group_dst``).

**DMuon's own process groups** (:class:`DMuonGroups`). DMuon does not issue collectives on
the mesh's groups (which FSDP2 uses) or on the default group (which DDP uses): a
communicator's calls pair up in issue order, so sharing one with another library would make
the pairing depend on how the two interleave on each rank, which differs as soon as a module
runs on some ranks only. Each channel below carries a call sequence that is fixed per step on
every rank, independent of the other channels:

- ``broadcast``: this rank's shard axis (N ranks): forward broadcasts, Z3 backward
  re-broadcasts, checkpoint syncs;
- ``reduce``: the shard axis again: backward reduces (grads and usage elements);
- ``replicate``: this rank's replicate axis (R ranks, HSDP only): replicate reduces and the
  owner's replicate broadcasts;
- ``world``: all W ranks (HSDP only; on a 1-D mesh ``reduce`` spans the world): once, at
  the end of the first step, the block-order agreement (:func:`all_gather_order_digests`);
  when the user clips, ``DMuon.clip_grad_norm_``'s one-element all_reduce (``clip.py``);
  with ``rest="replicate"``, the rest's broadcast from rank 0 at the first forward and its
  grads' all_reduce at the end of each backward (``rest.py``; on the ``reduce`` stream).

Over the same ranks as the mesh's groups, so a trace names them the same way (sorted ranks).
Which call travels on which channel, when, and under TP (the ``tp`` channel) and EP (each
column's own groups): ``docs/protocol.md``, "Channels".

Why not fewer. ``broadcast`` and ``reduce`` span the same ranks but cannot share a
communicator: in backward, Z3's re-broadcasts are issued by pre-backward hooks and the
reduces by grad hooks as grads arrive, and which comes first depends on the modules that ran
on each rank, so one communicator would pair a re-broadcast with a reduce. The mesh's groups
carry FSDP2's all_gathers and reduce-scatters (issued from FSDP2's own hooks, possibly on
some ranks only), the default group DDP's bucket all_reduces: sharing either would make the
pairing depend on how the two libraries interleave on each rank. ``world`` could be the
default group when the mesh covers it (one communicator less under HSDP; not taken: a mesh
may be a sub-mesh of the default group, and DMuon's world call would then need a check).

Cost, per :class:`~dmuon.DedicatedParams`, on each rank: a 1-D mesh makes this rank a member
of **2** groups (``broadcast``, ``reduce``; ``world`` is ``reduce``), an HSDP mesh of **4**
(``broadcast``, ``reduce``, ``replicate``, ``world``); :func:`make_groups` also creates the
other rows' and columns' groups, of which this rank is not a member (no backend). Under NCCL
each membership is one communicator: created at the group's first collective (or with the
group, split from the default one, when ``init_process_group`` got ``device_id``), with its
own device buffers (``NCCL_BUFFSIZE`` per channel and peer, 4 MiB by default) and proxy
thread. Under gloo (measured, ``tests/distributed/runtime/test_dmuon_lifecycle.py``) each group holds
3 threads and 5 file descriptors on this rank: +6 threads / +10 fds per 1-D DedicatedParams,
+12 / +22 per 2x2 HSDP one. :func:`destroy_groups` (``DedicatedParams.close()``) releases
them: ``dist.destroy_process_group`` shuts each backend down, and gloo's threads and sockets
go when the last reference to the group does (``close()`` drops DMuon's).

**Device.** Every tensor a collective sends lives on the device the group's backend needs:
:func:`collective_device` (``cuda:<current>`` for NCCL, ``cpu`` for gloo).

**Asynchrony** (:class:`Launcher`, one per DedicatedParams). Forward broadcasts, Z3
re-broadcasts, backward reduces and the HSDP replicate calls are issued
without blocking the training thread and waited where their result is needed:

- CPU tensors (gloo): ``async_op=True``; :meth:`Pending.wait` is ``Work.wait()`` (blocks the
  calling thread until the transfer is done).
- CUDA tensors (NCCL): the FSDP2 scheme (``torch/distributed/fsdp/_fully_shard/
  _fsdp_param_group.py``: all_gather / reduce_scatter streams and events). Each channel kind
  (``broadcast``, ``reduce``, ``replicate``) has its own high-priority side stream. Issuing
  makes the side stream wait for the current (compute) stream, so the data the call reads
  (the step's update, the backward's grads) are written, then runs the collective inside the
  side stream with ``async_op=False`` (NCCL enqueues it and orders the side stream after it;
  the CPU does not block) and records an event on the side stream. :meth:`Pending.wait` makes
  the *current stream* wait for that event, again without blocking the CPU. Memory: no
  ``record_stream``. Every buffer a call touches was allocated on the compute stream and is
  freed or reused only by the compute stream after it waited the call's event (DMuon frees
  at known points: a Z3 copy after its block's forward/backward, a non-holder's grad buffer
  after the reduce wait), so the caching allocator never hands out memory a collective is
  still using; the :class:`Pending` keeps its tensors alive until it is waited.

The choice is made by the tensors' device (:meth:`Launcher.for_device`); the CUDA branch
cannot run on the project's CPU machines, so its order of stream operations is tested with
stand-in stream objects (``tests/dmuon/test_collectives_streams.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dmuon import annotate
from dmuon.errors import invariant

#: Backends that take CPU tensors (a "cpu:gloo,cuda:nccl" backend takes both).
_CPU_BACKENDS = ("gloo", "mpi", "ucc")
#: Backends that take only accelerator tensors, and which accelerator.
_ACCEL_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu"}


def device_for_backend(backend: str, accel_index: int | None = None) -> torch.device:
    """The device for collective tensors of a process group with backend name ``backend``.

    Args:
        backend: ``dist.get_backend(group)``: ``"gloo"``, ``"nccl"``, or a per-device list
            such as ``"cpu:gloo,cuda:nccl"`` (CPU wins when it is served: no copy needed).
        accel_index: the current accelerator index (``torch.cuda.current_device()``).

    Raises:
        ValueError: the backend is unknown, or an accelerator backend without ``accel_index``.
    """
    parts = [p.strip() for p in str(backend).lower().split(",") if p.strip()]
    names = []
    for part in parts:
        dev, _, name = part.rpartition(":")
        if dev == "cpu":
            return torch.device("cpu")
        names.append(name)
    if any(n in _CPU_BACKENDS for n in names):
        return torch.device("cpu")
    for n in names:
        if n in _ACCEL_BACKENDS:
            if accel_index is None:
                raise ValueError(
                    f"Invalid accel_index=None for backend={backend!r}. Must be the current "
                    f"{_ACCEL_BACKENDS[n]} device index (call torch.{_ACCEL_BACKENDS[n]}."
                    "set_device(local_rank) before dmuon.dedicate_params)."
                )
            return torch.device(_ACCEL_BACKENDS[n], accel_index)
    raise ValueError(
        f"Invalid backend={backend!r}. Must be one of {_CPU_BACKENDS + tuple(_ACCEL_BACKENDS)} "
        "(or a 'cpu:gloo,cuda:nccl' list)."
    )


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """:func:`device_for_backend` of ``group`` (default: the default group) in this process."""
    backend = dist.get_backend(group)
    index = None
    if any(n in str(backend).lower() for n in _ACCEL_BACKENDS):
        mod = getattr(torch, _ACCEL_BACKENDS[next(n for n in _ACCEL_BACKENDS if n in str(backend).lower())])
        index = mod.current_device() if mod.is_available() else None
    return device_for_backend(backend, index)


def served_device_types(backend: str) -> set[str]:
    """Device types whose tensors a backend named ``backend`` takes (pure; see
    :func:`device_for_backend` for the name forms)."""
    out = set()
    for part in str(backend).lower().split(","):
        dev, _, name = part.strip().rpartition(":")
        if dev:
            out.add(dev)
        elif name in _CPU_BACKENDS:
            out.add("cpu")
        elif name in _ACCEL_BACKENDS:
            out.add(_ACCEL_BACKENDS[name])
    return out


def link_backend(backend: str, device_types: set[str]) -> str:
    """The backend DMuon's collectives of params on ``device_types`` run on, under a process
    group whose backend is named ``backend`` (pure): the key of the link policy
    (``buckets.LINK_COSTS``: coalescing target, reduce by gather, flat HSDP).

    A one-backend name (``"nccl"``, ``"gloo"``) is the answer whatever the params' device: a
    model built on ``meta`` gets the policy of the backend it will run on. A per-device list
    (``"cpu:gloo,cuda:nccl"``, torch's default group on a GPU node) runs each collective on
    the backend of its tensors' device, which is the params' (``Launcher`` per device): the
    accelerator's entry for accelerator params **and for meta params** (the meta-init flow
    materialises them on the accelerator: ``to_empty(device="cuda")``), the CPU entry only
    when every dedicated param is on the CPU. (A meta model materialised on the CPU of such a
    group then runs NCCL's policy on gloo: the same results and bytes, calls sized for NCCL.)

    Args:
        backend: ``dist.get_backend(group)`` (case-insensitive).
        device_types: the dedicated params' device types (``{"meta"}``, ``{"cuda"}``, ...;
            empty: nothing dedicated).

    Raises:
        ValueError: a per-device list without an entry for the params' device.
    """
    entries = [p.strip().rpartition(":") for p in str(backend).lower().split(",") if p.strip()]
    if len(entries) == 1 or all(not dev for dev, _, _ in entries):
        return entries[0][2] if entries else str(backend).lower()
    by_device = {dev: name for dev, _, name in entries}
    placed = sorted(set(device_types) - {"meta"})  # meta: the group's accelerator entry
    wanted = placed[-1] if placed else next((dev for dev in by_device if dev != "cpu"), None)
    if wanted not in by_device:
        raise ValueError(
            f"Invalid backend={backend!r} for dedicated params on {sorted(device_types)}. Must "
            f"have an entry for {wanted!r} (e.g. 'cpu:gloo,cuda:nccl'), or move the model to a "
            "device the process group serves before dmuon.dedicate_params."
        )
    return by_device[wanted]


def default_backend() -> str:
    """The default group's backend name (``dist.get_backend()``): DMuon's own groups are
    created from it (``dist.new_group`` without a backend), so it is theirs too."""
    return str(dist.get_backend())


def check_param_device(device: torch.device, group: dist.ProcessGroup, what: str) -> None:
    """Raise if the backend of ``group`` cannot take tensors on ``device`` (before any call).

    Raises:
        ValueError: e.g. CPU params with an NCCL-only process group.
    """
    backend = str(dist.get_backend(group))
    served = served_device_types(backend)
    if device.type != "meta" and device.type not in served:
        raise ValueError(
            f"Invalid device {device} of {what} for the {backend!r} process group. Must be "
            f"one of {sorted(served)}: move the model there (model.to(...)) before "
            "dmuon.dedicate_params, or build it on the meta device and call to_empty "
            "(docs/user-guide.md, 'Meta-device init')."
        )


@dataclass(frozen=True)
class DMuonGroups:
    """DMuon's own process groups of this rank (module docstring: which call uses which)."""

    broadcast: dist.ProcessGroup
    reduce: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    world: dist.ProcessGroup
    #: model-parallel dim -> this rank's group along it (a sharded matrix's step: gather, scatter)
    model_parallel: Mapping[str, dist.ProcessGroup] = field(default_factory=dict)
    #: mesh key -> the groups of this rank's column of the params sharded on some data-parallel
    #: dims (``dmuon/placement/layout.py``)
    columns: Mapping[str, DMuonGroups] = field(default_factory=dict)


def new_group(ranks: list[int], local: bool = False) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the default group's timeout: without one, torch gives a
    new gloo group 30 minutes whatever ``init_process_group(timeout=...)`` said (measured on
    torch 2.13), so a collective DMuon's groups never complete (a rank that dropped a
    backward) would outwait the user's limit. Read from the default group's backend options
    (``options._timeout``; torch's own default where a backend has none).

    ``local``: a pipeline stage's group (``topology.stage_ranks``): only the members call it
    (``use_local_synchronization=True``: torch names the group from its ranks and the number
    of groups each member holds, so the stage's ranks must have created the same groups
    before, as ``init_device_mesh`` and DMuon do); non-members get ``None``. Otherwise every
    rank of the world calls it (torch's default)."""
    default, timeout = dist.group.WORLD, None
    for device in default._device_types:
        try:
            timeout = default._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):  # no backend for this device type, or no options
            continue
    if local:
        return _stage_group(sorted(ranks), timeout)
    return dist.new_group(ranks, timeout=timeout)


#: Names of the locally synchronized groups this process created (:func:`_stage_group`).
_USED_STAGE_NAMES: set[str] = set()
#: id(a stage group) -> the one-rank placeholder groups made before it (:func:`_stage_group`),
#: destroyed with it (:func:`destroy_groups`).
_PLACEHOLDERS: dict[int, list[dist.ProcessGroup]] = {}


def _stage_group(ranks: list[int], timeout) -> dist.ProcessGroup:
    """A pipeline stage's group over ``ranks`` (sorted), made by its members only.

    torch names a locally synchronized group from its ranks and the number of groups the
    process holds (``_hash_ranks_to_str``), so after groups were destroyed a new group over the
    same ranks can get the name of an old one, whose rendezvous keys are still in the store: a
    member may then read its peer's old address (gloo: "connectFullMesh failed ... Connection
    refused", seen in the tests), or the name of a live group (torch refuses it). Where the
    name would be one this process used or holds, one-rank placeholder groups are made first
    (each moves the count by one; no peer, no rendezvous) until it is new; they live as long as
    the group (destroyed with it), so the count only grows while DMuon's groups are made. Every
    member has made the same DMuon calls over these ranks, so they skip the same names and meet
    on one."""
    c10d = dist.distributed_c10d
    name_of = getattr(c10d, "_hash_ranks_to_str", None)
    placeholders = []

    def taken(name: str) -> bool:
        return name in _USED_STAGE_NAMES or name in c10d._world.pg_names.values()

    while name_of is not None and taken(name_of(ranks)):
        placeholders.append(dist.new_group([dist.get_rank()], timeout=timeout,
                                           use_local_synchronization=True))
    name = name_of(ranks) if name_of is not None else None
    g = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    if name is not None:
        _USED_STAGE_NAMES.add(name)
    if placeholders:
        _PLACEHOLDERS[id(g)] = placeholders
    return g


def make_groups(rows: list[list[int]], local: bool = False) -> DMuonGroups:
    """Create DMuon's groups from the mesh layout (a collective: every rank, same order; with
    ``local``, every rank of the stage: :func:`new_group`).

    Args:
        rows: world ranks of every shard group, row ``r`` = replicate index ``r``
            (``mesh.mesh.tolist()`` of a 2-D mesh, ``[mesh.mesh.tolist()]`` of a 1-D one).
        local: the rows are a pipeline stage's mesh (:func:`new_group`).
    """
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for kind in ("broadcast", "reduce"):
        for row in rows:
            if local and me not in row:
                continue
            g = new_group(row, local)
            if me in row:
                mine[kind] = g
    replicate = world = None
    if len(rows) > 1:
        for col in zip(*rows):
            if local and me not in col:
                continue
            g = new_group(list(col), local)
            if me in col:
                replicate = g
        world = new_group(sorted(r for row in rows for r in row), local)
    return DMuonGroups(mine["broadcast"], mine["reduce"], replicate, world or mine["reduce"])


def synchronize(device: torch.device) -> None:
    """Block until every call issued on ``device``'s streams has finished (accelerators; a
    no-op for CPU tensors, whose calls were waited by their work handles). Waits on CUDA are
    stream waits (module docstring, "Asynchrony"), so a group is destroyed only after this."""
    if device.type not in ("cpu", "meta"):
        getattr(torch, device.type).synchronize(device)


def destroy_groups(groups: DMuonGroups) -> None:
    """Destroy DMuon's groups of this rank (``dist.destroy_process_group``, which shuts each
    backend down: gloo's threads and sockets, NCCL's communicator). Every rank, the same
    order (broadcast, reduce, replicate, world, the model-parallel groups, then each column's):
    NCCL's abort was a collective in some versions, which is why torch shuts groups down in a
    fixed order too."""
    seen: list[dist.ProcessGroup] = []
    columns = [groups.columns[k] for k in sorted(groups.columns)]
    for g in (groups.broadcast, groups.reduce, groups.replicate, groups.world,
              *(groups.model_parallel[k] for k in sorted(groups.model_parallel)),
              *(g for c in columns for g in (c.broadcast, c.reduce, c.replicate))):
        if g is not None and all(g is not s for s in seen):
            seen.append(g)
            dist.destroy_process_group(g)
            for p in _PLACEHOLDERS.pop(id(g), ()):  # a stage group's placeholders go with it
                dist.destroy_process_group(p)


def broadcast_(buf: torch.Tensor, src: int, group: dist.ProcessGroup, *, async_op: bool = False):
    """Broadcast ``buf`` in place from group rank ``src`` to every member of ``group``.

    Returns the ``Work`` handle when ``async_op`` (the caller must keep ``buf`` alive and
    wait before reading it), else ``None``.
    """
    return dist.broadcast(buf, group_src=src, group=group, async_op=async_op)


def reduce_sum_(buf: torch.Tensor, dst: int, group: dist.ProcessGroup, *, async_op: bool = False):
    """Sum ``buf`` over ``group`` into group rank ``dst`` (others' ``buf`` is left undefined).

    Returns the ``Work`` handle when ``async_op``, else ``None``.
    """
    return dist.reduce(buf, group_dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


#: ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` where torch has them (2.13 on,
#: which deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` with a FutureWarning
#: per call site and rank); the older names on torch 2.11, which lacks the new ones. Both pairs
#: dispatch the same ``c10d::_allgather_base_`` / ``c10d::_reduce_scatter_base_`` op (the
#: deprecated names are wrappers of the new ones in 2.13): same calls, same traces.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, *,
                async_op: bool = False):
    """``out`` (n * inp.numel(),) <- every member's ``inp`` in group-rank order
    (``all_gather_single``, ``all_gather_into_tensor`` before torch 2.13; count =
    ``inp.numel()``). Returns the ``Work`` when ``async_op``."""
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


def reduce_scatter_sum_(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *,
                        async_op: bool = False):
    """``out`` (inp.numel() / n,) <- the sum over ``group`` of this member's chunk of ``inp``
    (``reduce_scatter_single``, ``reduce_scatter_tensor`` before torch 2.13; count =
    ``out.numel()``). Returns the ``Work`` when ``async_op``."""
    return _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def gather_(buf: torch.Tensor, rows: torch.Tensor | None, dst: int, group: dist.ProcessGroup, *,
            async_op: bool = False):
    """Every member's ``buf`` into row ``i`` (its group rank) of ``rows`` (n, buf.numel()) on
    group rank ``dst`` (``dist.gather``; count = ``buf.numel()``; ``rows`` None elsewhere).
    Returns the ``Work`` when ``async_op``."""
    out = list(rows.unbind(0)) if rows is not None else None
    return dist.gather(buf, out, group_dst=dst, group=group, async_op=async_op)


def all_to_all_(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *,
                out_splits: list[int] | None = None, in_splits: list[int] | None = None,
                async_op: bool = False):
    """Chunk ``j`` of ``inp`` to group rank ``j``; ``out``'s chunk ``i`` from group rank ``i``
    (``all_to_all_single``). Chunks are equal (count = ``inp.numel() / n``) unless
    ``in_splits`` / ``out_splits`` give their sizes (elements per group rank; what rank ``i``
    sends ``j`` must be what ``j`` expects from ``i``). Returns the ``Work`` when ``async_op``."""
    return dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=async_op)


def sum_rows_(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out`` <- the sum of ``rows`` (n, out.numel()) over dim 0, in a fixed order: adjacent
    pairs, level by level (n = 4: (r0 + r1) + (r2 + r3)). On a 2 x 2 HSDP mesh (shard groups
    of consecutive ranks) that is the order of the shard sum then the replicate sum, so the
    1-D and the 2-D reductions of the same grads round alike; other shapes (e.g. 2 x 3) may
    round differently in the last bit, as any two reduction orders do."""
    while rows.shape[0] > 1:
        even = rows.shape[0] // 2 * 2
        summed = rows[0:even:2] + rows[1:even:2]
        rows = torch.cat([summed, rows[even:]]) if even < rows.shape[0] else summed
    out.copy_(rows[0].view_as(out))


def all_reduce_max_(buf: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Elementwise maximum of ``buf`` over ``group``, in place on every member (synchronous)."""
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)


def all_reduce_sum_(buf: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False):
    """Sum ``buf`` over ``group`` in place on every member.

    Returns the ``Work`` handle when ``async_op``, else ``None``.
    """
    return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class Pending:
    """One issued asynchronous collective (module docstring, "Asynchrony").

    ``wait()`` makes its result usable by the training thread (gloo) or the current stream
    (CUDA); calling it again is a no-op.
    """

    __slots__ = ("_work", "_event", "_wait_stream", "_keep")

    def __init__(self, work=None, event=None, wait_stream: Callable[[], Any] | None = None,
                 keep: tuple[torch.Tensor, ...] = ()) -> None:
        self._work, self._event, self._wait_stream, self._keep = work, event, wait_stream, keep

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            self._wait_stream().wait_event(self._event)
            self._event = None
        self._keep = ()


class Fused:
    """One issued call shared by several buckets (an aligned group's ``all_gather`` /
    ``reduce_scatter``): :meth:`wait` waits it once, then copies each ``(dst, src)`` pair's
    result out of the call's staging buffer (on the current stream, after the wait), so
    every bucket of the group holds its part; calling it again is a no-op."""

    __slots__ = ("_pending", "_copies")

    def __init__(self, pending: Pending, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._pending, self._copies = pending, copies

    def wait(self) -> None:
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None
        with torch.no_grad():
            for dst, src in self._copies:
                # a collective writing ``dst`` in place does not bump its version counter; this
                # copy must not either: backward saved the compute params (views of ``dst``)
                # and a Z3 re-broadcast refills them in backward (FSDP2 does the same in its
                # all_gather copy-out)
                with torch.autograd._unsafe_preserve_version_counter(dst):
                    dst.copy_(src)
        self._copies = []


class Summed:
    """A sum over a group run as a gather / all_to_all of the members' buffers (``rows``, one
    per group rank) and a local :func:`sum_rows_` into ``dst`` at :meth:`wait`, after the
    call's own wait (on the current stream); a member that receives nothing has ``rows``
    None. Calling it again is a no-op."""

    __slots__ = ("_pending", "_dst", "_rows")

    def __init__(self, pending: Pending, dst: torch.Tensor, rows: torch.Tensor | None) -> None:
        self._pending, self._dst, self._rows = pending, dst, rows

    def wait(self) -> None:
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None
        if self._rows is not None:
            with torch.no_grad():
                sum_rows_(self._dst, self._rows)
            self._rows = None


class Launcher:
    """Issues DMuon's asynchronous collectives on one device (module docstring, "Asynchrony").

    Args:
        device: the device of the tensors the calls move (:func:`collective_device`).
        accel: the accelerator module whose streams to use (``torch.cuda``) or ``None`` for
            work handles; default: ``torch.cuda`` for a CUDA device. Tests pass a stand-in.
        reduce_by_gather: run :meth:`reduce` as a gather to the root and :meth:`reduce_scatter`
            as an all_to_all, each followed by a local sum (:class:`Summed`): the same
            elements sent and received on the W-average, in one message round instead of the
            backend's multi-round reduction (``buckets.LinkCost.reduce_by_gather``: gloo).
            Memory: the receiver holds n rows of the buffer until the wait (an owner, n times
            the buckets it owns between the backward's issue and ``finish_reduces``).

    Raises:
        ValueError: ``accel`` given for a CPU device.
    """

    #: Side-stream priority (FSDP2 gives its all_gather stream high priority too).
    STREAM_PRIORITY = -1

    def __init__(self, device: torch.device, accel: Any = None, reduce_by_gather: bool = False) -> None:
        device = torch.device(device)
        self.reduce_by_gather = reduce_by_gather
        if accel is None and device.type == "cuda":
            accel = torch.cuda
        if accel is not None and device.type == "cpu":
            raise ValueError(f"Invalid accel={accel!r} for device {device}. Must be None for CPU tensors.")
        self.device = device
        self._accel = accel
        self._streams: dict[str, Any] = {}

    def stream(self, channel: str):
        """The side stream of ``channel`` (created on first use); CUDA only."""
        invariant(self._accel is not None, "Launcher: a stream asked of a launcher with work handles only")
        s = self._streams.get(channel)
        if s is None:
            s = self._streams[channel] = self._accel.Stream(device=self.device, priority=self.STREAM_PRIORITY)
        return s

    def _current(self):
        return self._accel.current_stream(self.device)

    def launch(self, channel: str, call: Callable[..., Any], *tensors: torch.Tensor) -> Pending:
        """Issue ``call(async_op=...)`` (one of this module's collective functions bound to
        its tensors) on ``channel``; ``tensors`` are kept alive until the wait."""
        if self._accel is None:
            return Pending(work=call(async_op=True))
        side = self.stream(channel)
        side.wait_stream(self._current())
        with self._accel.stream(side):
            call(async_op=False)
            event = side.record_event()
        return Pending(event=event, wait_stream=self._current, keep=tensors)

    def broadcast(self, buf: torch.Tensor, src: int, group: dist.ProcessGroup, channel: str = "broadcast") -> Pending:
        """:func:`broadcast_` issued asynchronously."""
        return self.launch(channel, lambda async_op: broadcast_(buf, src, group, async_op=async_op), buf)

    def reduce(self, buf: torch.Tensor, dst: int, group: dist.ProcessGroup,
               channel: str = "reduce") -> Pending | Summed:
        """:func:`reduce_sum_` issued asynchronously (``reduce_by_gather``: :func:`gather_`
        to ``dst``, summed into ``buf`` there at the wait)."""
        if not self.reduce_by_gather:
            return self.launch(channel, lambda async_op: reduce_sum_(buf, dst, group, async_op=async_op), buf)
        rows = None
        if dist.get_rank(group) == dst:
            rows = torch.empty((dist.get_world_size(group), buf.numel()), dtype=buf.dtype, device=buf.device)
        pending = self.launch(channel, lambda async_op: gather_(buf, rows, dst, group, async_op=async_op),
                              buf, *([] if rows is None else [rows]))
        return Summed(pending, buf, rows)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, channel: str,
                   parts: list[int] | None = None) -> Pending:
        """:func:`all_gather_` issued asynchronously. ``parts``: every member's ``inp.numel()``
        in group-rank order; where they differ (an uneven group, ``buckets.py``) the call is an
        :func:`all_to_all_` of ``inp`` repeated n times (each member's part to every member,
        itself included: n times ``inp`` in staging memory until the wait)."""
        if parts is None or len(set(parts)) == 1:
            return self.launch(channel, lambda async_op: all_gather_(out, inp, group, async_op=async_op), out, inp)
        copies = inp.repeat(len(parts))
        return self.launch(channel, lambda async_op: all_to_all_(
            out, copies, group, out_splits=parts, in_splits=[inp.numel()] * len(parts), async_op=async_op),
            out, copies)

    def all_reduce(self, buf: torch.Tensor, group: dist.ProcessGroup, channel: str) -> Pending:
        """:func:`all_reduce_sum_` issued asynchronously."""
        return self.launch(channel, lambda async_op: all_reduce_sum_(buf, group, async_op=async_op), buf)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                       channel: str, parts: list[int] | None = None) -> Pending | Summed:
        """:func:`reduce_scatter_sum_` issued asynchronously (``reduce_by_gather``:
        :func:`all_to_all_`, this rank's n chunks summed into ``out`` at the wait). ``parts``:
        every member's chunk of ``inp`` in group-rank order (``out.numel()`` for this rank);
        chunks that differ (an uneven group) need ``reduce_by_gather``, which sends chunk
        ``j`` to member ``j`` as it is.

        Raises:
            ValueError: unequal ``parts`` without ``reduce_by_gather``.
        """
        uneven = parts is not None and len(set(parts)) > 1
        if uneven and not self.reduce_by_gather:
            raise ValueError(f"Invalid parts={parts} for a reduce_scatter: unequal chunks need "
                             "reduce_by_gather (an all_to_all); buckets.py forms uneven groups only there.")
        if not self.reduce_by_gather:
            return self.launch(channel, lambda async_op: reduce_scatter_sum_(out, inp, group, async_op=async_op),
                               out, inp)
        n = dist.get_world_size(group)
        rows = torch.empty((n, out.numel()), dtype=inp.dtype, device=inp.device)
        splits = dict(out_splits=[out.numel()] * n, in_splits=parts) if uneven else {}
        pending = self.launch(channel, lambda async_op: all_to_all_(rows.view(-1), inp, group, **splits,
                                                                    async_op=async_op), rows, inp)
        return Summed(pending, out, rows)


def all_gather_digests(digest: str, group: dist.ProcessGroup | None, span: str) -> list[str]:
    """Every member's sha256 digest, in group-rank order: one all_gather of 32 bytes per rank
    on ``group`` (``None``: the default group), phase ``"setup"``, span ``span``, on the
    device its backend needs (:func:`collective_device`).

    Raises:
        ValueError: ``digest`` is not 64 hex characters (before the collective).
    """
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"Invalid digest={digest!r}. Must be a sha256 hex digest (64 chars).")
    device = collective_device(group)
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    size = dist.get_world_size(group)
    gathered = torch.empty(size * 32, dtype=torch.uint8, device=device)
    with annotate.phase("setup"), annotate.span(span):
        all_gather_(gathered, mine, group)
    gathered = gathered.cpu()
    return [bytes(gathered[i * 32 : (i + 1) * 32].tolist()).hex() for i in range(size)]


def ranks_by_digest(digests: list[str], ranks: list[int] | None = None) -> str:
    """``"ranks [0, 2]: 1a2b3c4d5e6f…; ranks [1]: …"`` for a message; ``ranks[i]`` names the
    member whose digest is ``digests[i]`` (default: ``i``)."""
    by_digest: dict[str, list[int]] = {}
    for i, d in enumerate(digests):
        by_digest.setdefault(d, []).append(i if ranks is None else ranks[i])
    return "; ".join(f"ranks {ranks}: {d[:12]}…" for d, ranks in by_digest.items())


#: The digest a rank contributes to the setup agreement when its own checks raised (a fixed
#: marker, not a sha256 of any setup): the others then raise too instead of waiting for it.
INVALID_SETUP = "0bad" * 16


#: What a rank contributes to a round of :func:`gather_stage_digests` when the ranks it has
#: heard from so far do not all hold one digest (a fixed marker, not a sha256 of any setup).
MIXED_SETUP = "0ddd" * 16


def gather_stage_digests(digest: str, mesh, span: str) -> tuple[list[int], list[str]]:
    """Every rank's digest on a pipeline stage's mesh (``topology.stage_ranks``), inside it
    only: one round per mesh dim on that dim's group of the mesh (the groups
    ``init_device_mesh`` made on every rank: none is created here, a setup call before any
    other DMuon call on them), each one all_gather of 32 bytes per rank
    (:func:`all_gather_digests`, span ``span``). Where a round's members do not all hold one
    digest, its members also all_gather what they know (``all_gather_object``), so every rank
    of the stage ends with every rank's digest. Returns ``(world ranks, digests)``."""
    me = dist.get_rank()
    known = {me: digest}
    mixed = False
    coord = mesh.get_coordinate()
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        values = set(known.values())
        uniform = not mixed and len(values) == 1 and INVALID_SETUP not in values
        gathered = all_gather_digests(next(iter(values)) if uniform else MIXED_SETUP, group, span)
        if len(set(gathered)) == 1 and gathered[0] != MIXED_SETUP:
            index = (slice(None),) * (d + 1) + tuple(coord[d + 1:])
            known = {int(r): gathered[0] for r in mesh.mesh[index].reshape(-1).tolist()}
            continue
        mixed = True
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, known, group=group)
        known = {int(r): v for part in everyone for r, v in part.items()}
    ranks = sorted(known)
    return ranks, [known[r] for r in ranks]


def check_plan_agreement(digest: str | None, what: str, mesh=None) -> None:
    """Raise on every rank if the ranks' plan digests differ (before any DMuon collective).

    One all_gather of 32 bytes per rank on the default group (phase ``"setup"``, span
    ``dmuon.plan_agreement``: :func:`all_gather_digests`), so a plan computed differently on
    some rank (different model shapes, predicate, or mesh) fails here with a message instead
    of hanging later in mismatched collectives. A rank whose own checks raised passes
    ``digest=None`` (it takes part, contributing :data:`INVALID_SETUP`, then re-raises its
    error; this returns): the others raise instead of waiting for it in their first collective.
    On a pipeline stage's ``mesh`` (``topology.stage_ranks``) the agreement stays inside the
    stage (:func:`gather_stage_digests`): the other stages are not waited for.

    Args:
        digest: 64 hex characters (sha256) of this rank's plan, or ``None`` (this rank raised).
        what: what the digest describes, for the error message.
        mesh: the mesh given to ``dedicate_params`` (only a stage's mesh changes the scope).

    Raises:
        ValueError: ``digest`` is not 64 hex characters.
        RuntimeError: another rank raised in its own checks (names those ranks), or the digests
            differ (lists which ranks hold which digest).
    """
    ranks, digests = agree_digests(INVALID_SETUP if digest is None else digest, mesh,
                                   "dmuon.plan_agreement")
    if digest is None:
        return
    invalid = [rank for rank, d in zip(ranks, digests) if d == INVALID_SETUP]
    if invalid:
        raise RuntimeError(
            f"DMuon setup failed on ranks {invalid}: dmuon.dedicate_params raised an error there "
            "(see those ranks' output: an invalid argument, model or mesh), so no rank goes on. "
            "Pass every rank the same valid arguments."
        )
    if len(set(digests)) != 1:
        from dmuon.placement.dims import STAGE_SLICE

        raise RuntimeError(
            f"DMuon {what} differs across ranks ({ranks_by_digest(digests, ranks)}). Every rank must "
            "build the same model (same parameter names, shapes and dtypes), use the same "
            "predicate and the same mesh before dmuon.dedicate_params, and pass it the same "
            "keyword arguments (reshard_after_forward, mp_policy, bucket_cap_mb, coalesce, rest, "
            "hierarchy)." + ("" if ranks == list(range(dist.get_world_size())) else
                            " This is a pipeline stage's mesh: every rank of it must hold the same "
                            "stage module (a mesh across stages mixes them: pass the stage's "
                            f"data-parallel slice, {STAGE_SLICE}).")
        )


def agree_digests(digest: str, mesh, span: str) -> tuple[list[int], list[str]]:
    """``(world ranks, digests)`` of the setup scope: a pipeline stage's mesh
    (:func:`gather_stage_digests`), else every rank on the default group."""
    from dmuon.ownership.topology import stage_ranks

    if stage_ranks(mesh) is not None:
        return gather_stage_digests(digest, mesh, span)
    digests = all_gather_digests(digest, None, span)
    return list(range(len(digests))), digests


def all_gather_order_digests(digest: str, world: dist.ProcessGroup) -> list[str]:
    """The block-order agreement (``docs/protocol.md``, step 7, in the first ``step()``):
    every rank's digest of its proposed bucket order, one all_gather of 32 bytes per rank on
    DMuon's ``world`` channel (phase ``"setup"``, span ``dmuon.order_agreement``), once per
    :class:`~dmuon.runtime.dedicated_params.DedicatedParams`.

    Raises:
        ValueError: ``digest`` is not 64 hex characters.
    """
    return all_gather_digests(digest, world, "dmuon.order_agreement")
