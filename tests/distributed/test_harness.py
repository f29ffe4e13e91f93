"""The distributed test harness itself: rank order, errors, timeouts, reuse."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

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
