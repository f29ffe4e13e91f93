"""One block's DMuon traffic as per-owner calls vs one owner-aligned call.

For one block whose dedicated matrices are owned by several ranks of a W-rank gloo group,
compare, in interleaved rounds within one invocation (odd rounds reversed):

- ``broadcasts``: one ``broadcast`` per owner of its bucket (what DMuon issues), against
  ``all_gather``: one ``all_gather_into_tensor`` of owner-aligned slots, every slot padded to
  the largest owner's bucket (the padding is sent too);
- ``reduces``: one ``reduce`` (sum) per owner, against ``reduce_scatter``: one
  ``reduce_scatter_tensor`` of the same padded slots.

Blocks: the verify-traffic TinyGPT block (qkv 96x32, proj 32x32, fc1 128x32, fc2 32x128 at
the harness's default d_model=32, one matrix per owner at W=4) and the same shapes at
d_model=256. Prints median microseconds per block over rounds, the ratio, and the padding
bytes per rank of the owner-aligned form.

Usage: ``python benchmarks/bench_block_collectives.py [--rounds 7] [--iters 20]``.
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
from tests.distributed.harness import DistributedPool  # noqa: E402


def _block_numels(d: int) -> list[int]:
    """One TinyGPT block's matrices (qkv, proj, fc1, fc2), one per owner."""
    return [3 * d * d, d * d, 4 * d * d, 4 * d * d]


def _rank_task(d: int, rounds: int, iters: int) -> dict:
    world, me = dist.get_world_size(), dist.get_rank()
    numels = _block_numels(d)[:world]
    slot = max(numels)
    mine = [torch.randn(n) for n in numels]
    padded = torch.zeros(world * slot)
    my_slot = torch.zeros(slot)
    my_slot[: numels[me]] = mine[me] if me < len(numels) else 0

    def broadcasts():
        for owner, t in enumerate(mine):
            dist.broadcast(t, src=owner)

    def all_gather():
        dist.all_gather_into_tensor(padded, my_slot)

    def reduces():
        works = [dist.reduce(t, dst=owner, async_op=True) for owner, t in enumerate(mine)]
        for w in works:
            w.wait()

    def reduce_scatter():
        dist.reduce_scatter_tensor(my_slot, padded)

    impls = {"broadcasts": broadcasts, "all_gather": all_gather, "reduces": reduces,
             "reduce_scatter": reduce_scatter}
    for fn in impls.values():  # warm-up
        fn()
    times = {k: [] for k in impls}
    for r in range(rounds):
        order = list(impls) if r % 2 == 0 else list(impls)[::-1]
        for k in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                impls[k]()
            times[k].append((time.perf_counter() - t0) / iters * 1e6)
    pad_bytes = sum(slot - n for n in numels) * 4 // world  # per rank, fp32
    return {"us": {k: statistics.median(v) for k, v in times.items()}, "pad_bytes": pad_bytes,
            "payload_bytes": sum(numels) * 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    rows = []
    with DistributedPool(args.world_size, timeout_s=600) as pool:
        for d in (32, 256):
            r = pool.run(_rank_task, d, args.rounds, args.iters)[0]
            us = r["us"]
            rows.append([d, r["payload_bytes"], r["pad_bytes"], f"{us['broadcasts']:.0f}",
                         f"{us['all_gather']:.0f}", f"{us['all_gather'] / us['broadcasts']:.2f}",
                         f"{us['reduces']:.0f}", f"{us['reduce_scatter']:.0f}",
                         f"{us['reduce_scatter'] / us['reduces']:.2f}"])
    print(f"W={args.world_size} gloo, {args.rounds} interleaved rounds x {args.iters} calls, "
          f"torch {torch.__version__}, rank 0 medians (us per block)")
    print(tabulate(rows, headers=["d_model", "block bytes", "padding bytes/rank", "broadcasts",
                                  "all_gather", "ratio", "reduces", "reduce_scatter", "ratio"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
