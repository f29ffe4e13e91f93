"""gloo's reductions as gathers (``collectives.Launcher(reduce_by_gather=True)``,
``docs/protocol.md`` step 4): a reduce is a gather to the root plus a local sum, a
reduce_scatter an all_to_all plus a local sum, with the results of the backend's own calls
(exactly, for values whose sums are exact in any order) and the counts of the calls they
replace."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dmuon.runtime import collectives
from tracer.interposer import Interposer

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60


def _both_ways(dtype_name: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    group = dist.new_group(list(range(world)))
    # small integers: every summation order gives the same bits, in bf16 too
    g = torch.Generator().manual_seed(rank)
    buf = torch.randint(-8, 8, (10,), generator=g).to(dtype)
    flat = torch.randint(-8, 8, (world * 3,), generator=g).to(dtype)
    out = {}
    for by_gather in (False, True):
        launcher = collectives.Launcher(torch.device("cpu"), reduce_by_gather=by_gather)
        b, chunk = buf.clone(), torch.empty(3, dtype=dtype)
        with Interposer() as rec:
            works = [launcher.reduce(b, 2, group), launcher.reduce_scatter(chunk, flat, group, "reduce")]
            for w in works:
                w.wait()
        out[by_gather] = {"reduced": b if rank == 2 else None, "chunk": chunk,
                          "calls": [(e.op, e.count, e.root) for e in rec.events]}
    dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_and_all_to_all_sum_like_reduce_and_reduce_scatter(pool4, dtype):
    for rank, r in enumerate(pool4.run_with_timeout(TIMEOUT_S, _both_ways, dtype)):
        plain, gathered = r[False], r[True]
        assert plain["calls"] == [("reduce", 10, 2), ("reduce_scatter", 3, None)]
        assert gathered["calls"] == [("gather", 10, 2), ("all_to_all", 3, None)]  # same counts
        assert torch.equal(plain["chunk"], gathered["chunk"])
        if rank == 2:
            assert torch.equal(plain["reduced"], gathered["reduced"])


def test_sum_rows_adds_adjacent_pairs_level_by_level():
    """The order of a 2 x 2 HSDP reduction ((r0 + r1) + (r2 + r3)), and odd counts carried."""
    rows = torch.tensor([[1e8], [1.0], [-1e8], [1.0]], dtype=torch.float32)
    out = torch.empty(1)
    collectives.sum_rows_(out, rows)
    assert out.item() == 0.0  # fp32: (1e8 + 1) + (-1e8 + 1) = 1e8 - 1e8; in sequence: 1.0
    collectives.sum_rows_(out, torch.tensor([[1.0], [2.0], [4.0]]))
    assert out.item() == 7.0
