"""Overhead of tracer.interposer.Interposer: the same calls with and without it, one session.

Runs ``--world-size`` forked gloo ranks (file rendezvous). For each case it times blocks of
``--iters`` calls alternately without and with the interposer (``--repeats`` times each, after a
warm-up block) and reports the median per-call time of each and their ratio. Cases:

- collectives: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast of a small
  (1 Ki float32 = 4 KiB) and a medium (256 Ki float32 = 1 MiB) message;
- ``aten add_``: a non-collective op, because a ``TorchDispatchMode`` sees *every* op issued
  while it is active, so its cost on compute shows here.

Usage: ``python benchmarks/bench_interposer.py [--world-size 2] [--iters 200] [--json OUT]``.
Times are wall-clock on rank 0 (ranks are synchronised by a barrier before each block).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tracer.interposer import Interposer  # noqa: E402

SIZES = {"small": 1024, "medium": 256 * 1024}  # float32 elements


def _case_fn(case: str, numel: int, world_size: int):
    """A zero-argument function issuing one call of ``case``."""
    x = torch.ones(numel)
    if case == "all_reduce":
        return lambda: dist.all_reduce(x)
    if case == "all_gather_into_tensor":
        out = torch.empty(numel * world_size)
        return lambda: dist.all_gather_into_tensor(out, x)
    if case == "reduce_scatter_tensor":
        big = torch.ones(numel * world_size)
        return lambda: dist.reduce_scatter_tensor(x, big)
    if case == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if case == "aten add_":
        y = torch.ones(1)
        return lambda: y.add_(1)
    raise ValueError(f"Invalid {case=}.")


def _time_block(fn, iters: int, interposed: bool) -> float:
    """Seconds per call of ``iters`` calls of ``fn``, with or without an Interposer."""
    dist.barrier()
    if interposed:
        with Interposer() as ip:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            dt = time.perf_counter() - t0
        assert len(ip.events) in (0, iters), "interposer missed or double-counted calls"
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        dt = time.perf_counter() - t0
    return dt / iters


def _worker(rank: int, world_size: int, init_method: str, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    rows = []
    cases = [(c, s) for c in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                              "broadcast") for s in SIZES] + [("aten add_", "1 elem")]
    for case, size in cases:
        numel = SIZES.get(size, 1)
        iters = args.iters if size != "medium" else max(1, args.iters // 4)
        if case == "aten add_":
            iters = args.iters * 50
        fn = _case_fn(case, numel, world_size)
        _time_block(fn, max(1, iters // 4), False)  # warm-up
        plain, interposed = [], []
        for _ in range(args.repeats):
            plain.append(_time_block(fn, iters, False))
            interposed.append(_time_block(fn, iters, True))
        rows.append({"case": case, "size": size, "msg_bytes": numel * 4, "calls": iters,
                     "plain_us": statistics.median(plain) * 1e6,
                     "interposed_us": statistics.median(interposed) * 1e6})
        rows[-1]["ratio"] = rows[-1]["interposed_us"] / rows[-1]["plain_us"]
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200, help="calls per timed block (small)")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per variant")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.iters < 1 or args.repeats < 1:
        parser.error(f"Invalid {args.world_size=}, {args.iters=} or {args.repeats=}. Must be "
                     ">= 2, >= 1, >= 1.")
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, args.world_size, init_method, args, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    if any(p.exitcode != 0 for p in procs):
        print(f"worker exit codes: {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    rows = queue.get()
    print(f"Interposer overhead, {args.world_size} gloo ranks, torch {torch.__version__}, "
          f"median of {args.repeats} blocks, rank 0 wall clock")
    print(tabulate([[r["case"], r["size"], r["msg_bytes"], r["calls"], r["plain_us"],
                     r["interposed_us"], r["ratio"]] for r in rows],
                   headers=["case", "size", "msg_bytes", "calls/block", "plain_us/call",
                            "interposed_us/call", "ratio"], floatfmt=".2f"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
