"""The process groups the harness creates: how it joins the default group, and how each mode's
groups (and DMuon's hooks) are released before the next mode.

Joining (:func:`init_kwargs`): on NCCL the default group gets ``device_id`` (the rank's CUDA
device), so torch creates its communicator inside ``init_process_group`` and splits every
later ``new_group`` from it eagerly (torch's ``init_process_group`` docstring, ``device_id``:
"eager initialization"); without it each communicator is created lazily by its first
collective, which in DMuon's case is inside a forward or backward hook, so the first measured
step would also pay and hide ``ncclCommInitRank``. Gloo is left as it is (no device to bind).

Releasing (:class:`ModeScope`): a mode builds a mesh (``init_device_mesh``: its groups) and
on the DMuon modes a ``DedicatedParams`` (DMuon's own groups, hooks on the model). Nothing
frees them when the mode ends: the hooks keep the model in a reference cycle through C++
autograd metadata that ``gc`` cannot see, and every group stays registered in
``torch.distributed``. On NCCL each group holds a communicator (0.5-1.6 GB of device memory
each), so ten modes pile them up. The scope closes the DMuon handles and destroys
every group created since it opened, in creation order, on every rank.
"""

from __future__ import annotations

import datetime
import gc

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world


def init_kwargs(backend: str, local_rank: int, timeout_s: float) -> dict:
    """Keyword arguments of ``dist.init_process_group`` for this rank (a pure function, tested).

    Args:
        backend: ``"nccl"`` or ``"gloo"``.
        local_rank: this process's CUDA device index on its node (``LOCAL_RANK``).
        timeout_s: the groups' collective timeout, seconds.

    Returns:
        ``{"backend", "timeout"}``, plus ``device_id=torch.device("cuda", local_rank)`` on NCCL
        (eager communicator creation; module docstring).

    Raises:
        ValueError: another backend, a negative ``local_rank`` or ``timeout_s <= 0``.
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"Invalid backend={backend!r}. Must be 'nccl' or 'gloo'.")
    if local_rank < 0:
        raise ValueError(f"Invalid local_rank={local_rank}. Must be >= 0 (LOCAL_RANK).")
    if not timeout_s > 0:
        raise ValueError(f"Invalid timeout_s={timeout_s}. Must be > 0 seconds.")
    kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", local_rank)
    return kwargs


def live_groups() -> list[dist.ProcessGroup]:
    """This rank's registered process groups (the default one included), in creation order."""
    return [pg for pg in _world.pg_names if pg in _world.pg_map]


def clear_mesh_caches() -> None:
    """Forget the DeviceMeshes that torch's DTensor caches keep.

    A DeviceMesh compares and hashes by its layout only, so a cached sharding decision or
    redistribute plan made with an earlier mode's mesh is a hit for a new mesh of the same
    shape, and hands back the old mesh, whose groups were destroyed ("Could not resolve the
    process group registered under the name ..."). Also drops their references to those groups.
    Private torch helpers; a name a release lacks is skipped (the harness's repeated-mesh test
    in tests/distributed/test_harness.py then fails if a cache is left). Then
    :func:`drop_destroyed_groups_from_meshes` (a mesh torch leaked must not keep its groups).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # Python LRU of the sharding propagator + the C++ fast path
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (getattr(_redistribute, "_gen_transform_infos", None),
                   MeshTopoInfo.build_from_mesh,
                   getattr(propagator, "_propagate_tensor_meta_cached", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    # keyed by a weak reference to the mesh, but each planner holds the mesh itself
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    torch.distributed.device_mesh._mesh_resources.mesh_stack.clear()
    drop_destroyed_groups_from_meshes()


def drop_destroyed_groups_from_meshes() -> int:
    """Remove destroyed process groups from the group registry of every DeviceMesh still alive.

    A DeviceMesh holds its groups (``_pg_registry``: name -> ProcessGroup), and a gloo group's
    threads (and an NCCL group's host objects) stop only when the group object is freed. On
    torch 2.11 a mesh can outlive every Python reference: DTensor's C++ dispatch fast path leaks
    three references to the input ``DTensorSpec`` (hence its mesh) each time it misses its cache
    on ``aten.detach``, which ``nn.Parameter(dtensor)`` calls (so every ``fully_shard``), and
    ``torch._C._clear_DTensor_sharding_propagator_cache()`` does not return them (measured:
    ``sys.getrefcount`` of the spec +3 per miss after a clear; 2.13: +0). After one HSDP mode the
    two mesh groups' 4 gloo threads kept running although no group was registered. Dropping
    the destroyed groups from the leaked mesh frees them; the mesh itself (a few small objects)
    stays. Correct on any release (a live group is never touched); on 2.13 nothing is found.

    Finds the meshes as the referrers of their classes (an instance of a Python class refers to
    its type in the collector's traversal): one scan in C, ~0.02 s over 430k objects, against
    0.14 s for a Python loop over ``gc.get_objects()`` (it runs after every test task on every
    rank). Objects frozen by ``gc.freeze()`` are not scanned.

    Returns:
        How many registry entries were dropped.
    """
    from torch.distributed.device_mesh import DeviceMesh

    live = set(_world.pg_map)
    dropped = 0
    classes, todo = set(), [DeviceMesh]
    while todo:  # DeviceMesh and every subclass of it
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    for obj in gc.get_referrers(*classes):
        # type(), not isinstance(): isinstance reads __class__, which some torch objects warn on
        if type(obj) not in classes:
            continue
        registry = getattr(obj, "_pg_registry", None)
        if not isinstance(registry, dict):
            continue
        for name in [n for n, pg in registry.items()
                     if isinstance(pg, dist.ProcessGroup) and pg not in live]:
            del registry[name]
            dropped += 1
    return dropped


class ModeScope:
    """What one mode leaves behind on this rank, released by :meth:`close` on every rank.

    Open it before the mode is built; hand it the mode's ``DedicatedParams`` with
    :meth:`adopt`; call :meth:`close` once every rank is done with the mode (after the
    gather of its results, so no rank still runs a collective on a group being destroyed),
    whether the mode passed or raised.
    """

    def __init__(self) -> None:
        self._before = set(live_groups())
        self._dedicated: list = []

    def adopt(self, dedicated) -> None:
        """Close ``dedicated`` (a ``dmuon.DedicatedParams``) at :meth:`close`."""
        self._dedicated.append(dedicated)

    def close(self) -> list[str]:
        """Close the adopted ``DedicatedParams`` (``sync=False``: no collective, so ranks whose
        mode raised and ranks whose mode passed make the same calls; the harness drops the
        model anyway), destroy every group created since the scope opened, in creation order
        (the same on every rank), clear the DTensor mesh caches and collect the mode's garbage.

        Returns:
            What could not be released, one line each (empty: all of it was).
        """
        problems = []
        for dm in self._dedicated:
            try:
                dm.close(sync=False)
            except Exception as exc:  # noqa: BLE001 - reported; the groups still go below
                problems.append(f"DedicatedParams.close() raised {type(exc).__name__}: {exc}")
        self._dedicated = []
        for pg in live_groups():
            if pg not in self._before:
                try:
                    dist.destroy_process_group(pg)
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"destroy_process_group raised {type(exc).__name__}: {exc}")
        clear_mesh_caches()
        gc.collect()
        return problems
