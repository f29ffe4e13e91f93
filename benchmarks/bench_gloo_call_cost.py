"""CPU and wall time of one gloo collective per kind, at W ranks on this machine
(why DMuon's step time follows its number of calls on a CPU machine).

Each kind DMuon or a baseline issues per step is timed back to back, ``--iters`` calls per
round, in ``--rounds`` interleaved rounds (odd rounds reversed), within one invocation:
``broadcast`` and ``reduce`` of ``--numel`` fp32 elements (DMuon's per-bucket calls),
``all_gather_single`` of ``--numel`` per rank and ``reduce_scatter_single`` of W x
``--numel`` (zero1-muon's and FSDP2's calls), and an ``all_reduce`` of 12 int32 (the size of
the usage all_reduce DMuon used to issue). Every call is ``async_op=True`` then waited, as
DMuon issues them. Printed per kind (medians over rounds): wall ms per call on rank 0, and
CPU ms per call summed over the W processes (``time.process_time``: every thread, gloo's
included). With W processes on fewer cores, the CPU sum is what a call costs the step.

``--aligned``: instead, for each bucket size of ``--sizes-kib``, what an aligned group of
W buckets costs per way of moving it (docs/traffic-model.md, "Coalescing"): W broadcasts
(one per owner, all issued then waited) against one ``all_gather``, and W reduces against
one ``reduce_scatter``, beside DMuon's gloo reductions (``collectives.Launcher`` with
``reduce_by_gather``: W gathers, one all_to_all, each with its local sum) and one
``all_reduce`` of the W buckets (DDP's way: on NCCL's ring twice the bytes per rank of the
reduce_scatter, docs/traffic-model.md); wall ms on rank 0, medians over interleaved rounds.

Usage: ``python benchmarks/bench_gloo_call_cost.py [--world-size 4] [--rounds 5] [--aligned]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dmuon.runtime import collectives  # noqa: E402
from tests.distributed.harness import DistributedPool  # noqa: E402

KINDS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce_12xint32")


def _call(kind: str, numel: int, world: int, group):
    if kind == "broadcast":
        return lambda t=torch.ones(numel): dist.broadcast(t, group_src=1, group=group, async_op=True)
    if kind == "reduce":
        return lambda t=torch.ones(numel): dist.reduce(t, group_dst=1, group=group, async_op=True)
    if kind == "all_gather":
        out, inp = torch.empty(world * numel), torch.ones(numel)
        return lambda: dist.all_gather_single(out, inp, group=group, async_op=True)
    if kind == "reduce_scatter":
        out, inp = torch.empty(numel), torch.ones(world * numel)
        return lambda: dist.reduce_scatter_single(out, inp, group=group, async_op=True)
    t = torch.ones(12, dtype=torch.int32)
    return lambda: dist.all_reduce(t, group=group, async_op=True)


def _rank_task(args) -> dict:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    calls = {k: _call(k, args.numel, world, group) for k in KINDS}
    for call in calls.values():  # warm-up: connections, allocations
        for _ in range(3):
            call().wait()
    out = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            dist.barrier(group=group)
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.iters):
                calls[kind]().wait()
            out[kind].append(((time.process_time() - c0) / args.iters * 1e3,
                              (time.perf_counter() - w0) / args.iters * 1e3))
    dist.destroy_process_group(group)
    return out


ALIGNED = ("W x broadcast", "all_gather", "W x reduce", "W x gather+sum", "reduce_scatter",
           "all_to_all+sum", "all_reduce")


def _aligned_task(args) -> dict:
    """Rank task of ``--aligned``: wall ms per way of moving W buckets, per bucket size."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    out = {}
    for kib in args.sizes_kib:
        numel = kib * 256  # fp32
        bufs = [torch.ones(numel) for _ in range(world)]
        gathered, flat, mine = torch.empty(world * numel), torch.ones(world * numel), torch.empty(numel)
        gather_launcher = collectives.Launcher(torch.device("cpu"), reduce_by_gather=True)
        ways = {
            ALIGNED[0]: lambda: [w.wait() for w in [dist.broadcast(bufs[i], group_src=i, group=group,
                                                                   async_op=True) for i in range(world)]],
            ALIGNED[1]: lambda: dist.all_gather_single(gathered, bufs[rank], group=group, async_op=True).wait(),
            ALIGNED[2]: lambda: [w.wait() for w in [dist.reduce(bufs[i], group_dst=i, group=group,
                                                                async_op=True) for i in range(world)]],
            # DMuon's gloo reductions (collectives.Launcher(reduce_by_gather=True))
            ALIGNED[3]: lambda: [w.wait() for w in [gather_launcher.reduce(bufs[i], i, group)
                                                    for i in range(world)]],
            ALIGNED[4]: lambda: dist.reduce_scatter_single(mine, flat, group=group, async_op=True).wait(),
            ALIGNED[5]: lambda: gather_launcher.reduce_scatter(mine, flat, group, "reduce").wait(),
            # what DDP moves the same grads with: twice the bytes per rank on NCCL's ring
            ALIGNED[6]: lambda: dist.all_reduce(flat, group=group, async_op=True).wait(),
        }
        for way in ways.values():  # warm-up
            way()
        times = {k: [] for k in ways}
        for r in range(args.rounds):
            for k in (ALIGNED if r % 2 == 0 else ALIGNED[::-1]):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    ways[k]()
                times[k].append((time.perf_counter() - t0) / args.iters * 1e3)
        out[kib] = {k: statistics.median(v) for k, v in times.items()}
    dist.destroy_process_group(group)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30, help="calls per kind per round")
    parser.add_argument("--numel", type=int, default=65536, help="fp32 elements per bucket")
    parser.add_argument("--aligned", action="store_true",
                        help="compare W broadcasts / reduces with one all_gather / reduce_scatter")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 16, 64, 256, 1024],
                        help="bucket sizes for --aligned, KiB of fp32")
    args = parser.parse_args(argv)
    if args.aligned:
        if min(args.rounds, args.iters, args.world_size - 1, *args.sizes_kib) < 1:
            parser.error("Invalid --rounds, --iters, --world-size or --sizes-kib. Must be >= 1 "
                         "(world size >= 2).")
        with DistributedPool(args.world_size, timeout_s=900) as pool:
            rank0 = pool.run(_aligned_task, args)[0]
        print(f"gloo, W={args.world_size}, an aligned group of W buckets, wall ms on rank 0, "
              f"{args.rounds} rounds x {args.iters}, torch {torch.__version__}")
        print(tabulate([[kib, *(rank0[kib][k] for k in ALIGNED)] for kib in args.sizes_kib],
                       headers=["KiB per bucket", *ALIGNED], floatfmt=".2f"))
        return 0
    if min(args.rounds, args.iters, args.numel, args.world_size - 1) < 1:
        parser.error(f"Invalid {args.rounds=}, {args.iters=}, {args.numel=} or {args.world_size=}. "
                     "Must be >= 1 (world size >= 2).")
    with DistributedPool(args.world_size, timeout_s=900) as pool:
        per_rank = pool.run(_rank_task, args)
    rows = []
    for kind in KINDS:
        cpu = statistics.median(sum(r[kind][i][0] for r in per_rank) for i in range(args.rounds))
        wall = statistics.median(per_rank[0][kind][i][1] for i in range(args.rounds))
        rows.append([kind, wall, cpu])
    print(f"gloo, W={args.world_size}, {args.numel} fp32 per bucket, {args.rounds} rounds x "
          f"{args.iters} calls, torch {torch.__version__}")
    print(tabulate(rows, headers=["call", "wall ms/call (rank 0)", "CPU ms/call (sum over ranks)"],
                   floatfmt=".2f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
