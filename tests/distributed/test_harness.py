"""The distributed test harness itself: rank order, errors, timeouts, reuse."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _world
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.distributed.harness import DistributedPool, RankError, run_distributed

pytestmark = pytest.mark.distributed


def _rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.getpid()


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise KeyError(f"boom from rank {bad_rank}")
    return dist.get_rank()


def _sleep_on_rank(slow_rank, sleep_s):
    if dist.get_rank() == slow_rank:
        time.sleep(sleep_s)
    return dist.get_rank()


def _seeded_draw():
    return torch.rand(3)


def _new_group_sum():
    group = dist.new_group([0, 1])
    t = torch.ones(2) * (dist.get_rank() + 1)
    if dist.get_rank() in (0, 1):
        dist.all_reduce(t, group=group)
    return t.tolist()


def _thread_names():
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]


def _gloo_threads():
    """This process's threads named by gloo (pt_gloo_runloop; gloo_tcp_loop where the release
    names its TCP loop thread: torch 2.13 does, 2.11 leaves it unnamed)."""
    return sum(n in ("pt_gloo_runloop", "gloo_tcp_loop") for n in _thread_names())


def _gloo_threads_per_group():
    """Named gloo threads one process group has on this rank: ProcessGroupGloo's runloops (its
    Options' thread count) and the TCP loop where the release names it (torch 2.13: 2 + 1;
    2.11: 2). Read off the default group, whose threads named themselves long ago (a group
    created a moment before may not have yet)."""
    return dist.ProcessGroupGloo._Options()._threads + ("gloo_tcp_loop" in _thread_names())


def _per_group(pool):
    per_group = pool.run(_gloo_threads_per_group)
    assert len(set(per_group)) == 1 and per_group[0] >= 2, per_group
    return per_group[0]


def _census(default_group_threads):
    """(threads, open fds, live process groups, gloo threads) of this rank, once the gloo
    threads are down to ``default_group_threads`` (a joined thread leaves /proc a moment later;
    at most 2 s)."""
    deadline = time.monotonic() + 2
    while _gloo_threads() > default_group_threads and time.monotonic() < deadline:
        time.sleep(0.01)
    return (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")),
            len(_world.pg_map), _gloo_threads())


def _groups_and_meshes(destroy_some):
    """What an HSDP DMuon task creates (a 2-D mesh, DMuon-like groups), each used once; with
    ``destroy_some``, destroys two of its groups itself, out of order (DedicatedParams.close()
    does that), and the harness must skip those."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Replicate(), Shard(0)])
    total = (x + 1).redistribute(mesh, [Replicate(), Replicate()]).to_local().sum().item()
    mine = []
    for ranks in ([0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2, 3]):
        group = dist.new_group(ranks)
        if rank in ranks:
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            total += t.item()
            mine.append(group)
    if destroy_some:
        dist.destroy_process_group(mine[2])
        dist.destroy_process_group(mine[0])
    return total, _gloo_threads(), len(_world.pg_map)


def _leaked_mesh():
    """A 2-D mesh, used once, then given one reference nothing will ever return (ctypes'
    Py_IncRef): a stand-in for torch 2.11, whose DTensor fast path leaks references to a
    DTensorSpec (so to its mesh) on every ``fully_shard`` (verify/run/groups.py,
    drop_destroyed_groups_from_meshes); on 2.13 only this stand-in shows it."""
    import ctypes

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(0)])
    x.redistribute(mesh, [Replicate(), Replicate()])
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(mesh))
    return len(_world.pg_map)


def _dedicated_hsdp_step():
    """One DMuon HSDP-Z3 step (its own groups plus the 2-D mesh's)."""
    from tests.distributed.parity import dmuon_tasks as T

    model, _, _, opt = T.build("hsdp-z3")
    x, y = T.corpus().global_batch(0, T.GLOBAL_BATCH, T.SMALL.seq_len)
    T._loss(model, x, y).backward()
    opt.step()
    return len(_world.pg_map)


def _change_globals():
    os.environ["DMUON_HARNESS_PROBE"] = "1"
    os.environ.pop("WORLD_SIZE")
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    torch.set_grad_enabled(False)
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.nn.modules.module.register_module_forward_hook(lambda *a: None)


def _globals():
    return (os.environ.get("DMUON_HARNESS_PROBE"), os.environ.get("WORLD_SIZE"),
            torch.get_default_dtype(), torch.empty(1).device.type, torch.is_grad_enabled(),
            torch.__future__.get_swap_module_params_on_conversion(),
            len(torch.nn.modules.module._global_forward_hooks))


def _destroy_default_group():
    dist.destroy_process_group()


def test_results_in_rank_order(pool4):
    results = pool4.run(_rank_and_sum, 10)
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert all(r[1] == 4 for r in results)
    assert all(r[2] == 10 * 4 + 0 + 1 + 2 + 3 for r in results)
    assert len({r[3] for r in results}) == 4  # four distinct processes


def test_reuse_across_calls_keeps_workers(pool2):
    first = pool2.run(_rank_and_sum, 0)
    generation = pool2.generation
    second = pool2.run(_rank_and_sum, 1)
    assert pool2.generation == generation
    assert [r[3] for r in first] == [r[3] for r in second]  # same processes
    assert [r[2] for r in second] == [3.0, 3.0]


def test_seed_is_reset_before_every_task(pool2):
    a = pool2.run(_seeded_draw)
    b = pool2.run(_seeded_draw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], a[1])


def test_subgroups_inside_tasks(pool4):
    results = pool4.run(_new_group_sum)
    assert results[:2] == [[3.0, 3.0], [3.0, 3.0]]
    assert results[2:] == [[3.0, 3.0], [4.0, 4.0]]


def test_tasks_leave_no_groups_threads_or_fds_behind(pool4):
    # Every task's groups are destroyed after it (in creation order, the same on every rank),
    # the DTensor caches forget its meshes (a repeated identical mesh must not get the old,
    # destroyed groups back), and groups a task destroyed itself are skipped.
    per_group = _per_group(pool4)
    generation = pool4.generation
    pool4.run(_groups_and_meshes, False)  # the first task: lazily started non-gloo threads
    base = pool4.run(_census, per_group)
    # nothing of the first task left either: only the default group and its gloo threads
    # (a cache that kept the task's mesh would keep its 2 groups' threads)
    assert all(r[2:] == (1, per_group) for r in base), base
    for i in range(4):
        results = pool4.run(_groups_and_meshes, destroy_some=i % 2 == 1)
        # sum(1..16) replicated, plus each rank's 3 all_reduces of ones (group sizes 2, 2, 4)
        assert [r[0] for r in results] == [136.0 + 8] * 4
        # while the task ran: the 2-D mesh's 2 groups + the 3 of its own this rank is in (less
        # the 2 it destroyed), per_group gloo threads each
        live = 2 + (1 if i % 2 else 3)
        assert all(r[2] == 1 + live for r in results), results
        assert all(r[1] >= per_group * live for r in results), results
    after = pool4.run(_census, per_group)
    assert after == base, f"per rank (threads, fds, groups, gloo threads): {base} -> {after}"
    assert pool4.generation == generation  # the same workers all along


def test_dmuon_groups_are_destroyed_after_the_task(pool4):
    per_group = _per_group(pool4)
    assert pool4.run(_dedicated_hsdp_step) == [1 + 6] * 4  # mesh 2 + DMuon's 4 (HSDP)
    base = pool4.run(_census, per_group)
    # torch 2.11 leaks the HSDP mesh (fully_shard): its 2 groups' threads ran on without
    # drop_destroyed_groups_from_meshes
    assert all(r[2:] == (1, per_group) for r in base), base
    for _ in range(2):
        pool4.run(_dedicated_hsdp_step)
    assert pool4.run(_census, per_group) == base


def test_groups_of_a_mesh_that_outlives_its_task_are_freed(pool4):
    # Fails without verify/run/groups.py drop_destroyed_groups_from_meshes on any torch: the
    # leaked mesh's 2 groups keep 2 * per_group gloo threads (and their fds) running.
    per_group = _per_group(pool4)
    base = pool4.run(_census, per_group)
    assert pool4.run(_leaked_mesh) == [1 + 2] * 4
    assert pool4.run(_census, per_group) == base


def test_global_state_is_restored_after_a_task(pool2):
    before = pool2.run(_globals)
    pool2.run(_change_globals)
    assert pool2.run(_globals) == before
    assert before[0][:4] == (None, "2", torch.float32, "cpu")


def test_task_destroying_the_default_group_replaces_the_workers(pool2):
    generation = pool2.generation
    with pytest.raises(RankError, match="the task destroyed the default process group"):
        pool2.run(_destroy_default_group)
    assert pool2.run(_census, _per_group(pool2))[0][2] == 1 and pool2.generation == generation + 1


def test_exception_carries_rank_traceback_and_pool_recovers(pool2):
    pool2.run(_rank_and_sum, 0)
    generation = pool2.generation
    with pytest.raises(RankError) as info:
        pool2.run(_raise_on_rank, 1)
    assert info.value.rank == 1
    assert "KeyError: 'boom from rank 1'" in str(info.value)
    assert "_raise_on_rank" in info.value.tracebacks[1]  # the frame, not just the message
    assert not pool2.started
    # Next use re-creates the workers with a fresh process group.
    assert [r[2] for r in pool2.run(_rank_and_sum, 0)] == [1.0, 1.0]
    assert pool2.generation == generation + 1


def test_timeout_names_silent_ranks():
    with DistributedPool(2, timeout_s=3) as pool:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of world_size=2 did not answer"):
            pool.run(_sleep_on_rank, 1, 60)
        assert time.monotonic() - t0 < 15
        assert not pool.started


def test_unpicklable_fn_is_a_value_error(pool2):
    with pytest.raises(ValueError, match="Must be a module-level function"):
        pool2.run(lambda: 1)


def test_invalid_world_size():
    with pytest.raises(ValueError, match="world_size=0"):
        DistributedPool(0)


def test_run_distributed_one_shot():
    assert [r[0] for r in run_distributed(_rank_and_sum, 2, 0)] == [0, 1]
