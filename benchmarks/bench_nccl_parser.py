"""Throughput and memory of the NCCL_DEBUG=INFO parser (tracer.nccl_log) on a large log.

A script, not a test::

    python benchmarks/bench_nccl_parser.py [--lines 2000000] [--ranks 8]

Generates one log per rank in a temp dir (INIT lines, then COLL lines rendered by the test
tool tests/tools/nccl_render.py in NCCL 2.21 format), then times, in this process:

- ``read``: ``for line in f: pass`` (the I/O floor);
- ``regex``: one ``re.search`` per line for ``NCCL INFO <Op>: opCount`` (a minimal parser);
- ``records``: :func:`tracer.nccl_log.iter_nccl_records` (every field, no resolution);
- ``events``: :func:`tracer.nccl_log.iter_nccl_events` (resolved CollectiveEvents, streaming).

Memory: ``ru_maxrss`` before and after the full streaming ``events`` pass (a delta near 0 means
the parser held no per-line state), and the tracemalloc peak of the same path on the first
20,000 and 200,000 lines of one file (equal peaks: memory does not grow with the log).
Prints lines/s, ratios vs the baselines, and the memory figures.
"""

from __future__ import annotations

import argparse
import itertools
import re
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tools import nccl_render as R  # noqa: E402
from tracer.events import CollectiveEvent  # noqa: E402
from tracer.nccl_log import iter_nccl_events, iter_nccl_records  # noqa: E402

OPS = [("all_gather", "bfloat16"), ("reduce_scatter", "float32"), ("all_reduce", "float32"),
       ("broadcast", "bfloat16"), ("reduce", "bfloat16")]


def generate(folder: Path, n_lines: int, ranks: int) -> list[Path]:
    paths = []
    per_rank = n_lines // ranks
    for rank in range(ranks):
        host, pid, dev, comm = f"node{rank // 8}", 10_000 + rank, rank % 8, f"0x55aa{rank:04x}0"
        path = folder / f"nccl.{host}.{pid}"
        with open(path, "w") as f:
            f.write(R.prefix(host, pid, pid, dev) + R.init_line(
                version="2.21", comm=comm, rank=rank, nranks=ranks, cuda_dev=dev,
                comm_id="0x5ae77eb5ea4ec1ee") + "\n")
            for i in range(per_rank):
                op, dtype = OPS[i % len(OPS)]
                ev = CollectiveEvent(source="nccl_log", op=op, count=4096 + i % 977, dtype=dtype,
                                     root=i % ranks, comm=comm, group_size=ranks, host=host,
                                     pid=pid, cuda_dev=dev)
                f.write(R.event_line(ev, opcount=i) + "\n")
        paths.append(path)
    return paths


def timed(label: str, fn, paths: list[Path]) -> float:
    t0 = time.perf_counter()
    n = fn(paths)
    dt = time.perf_counter() - t0
    print(f"{label:8s} {n:>10,d} lines in {dt:7.2f} s = {n / dt:>12,.0f} lines/s")
    return n / dt


def read_pass(paths):
    n = 0
    for p in paths:
        with open(p) as f:
            for _ in f:
                n += 1
    return n


_RE = re.compile(r"NCCL INFO ([A-Za-z]+): opCount")


def regex_pass(paths):
    n = 0
    for p in paths:
        with open(p) as f:
            for line in f:
                if _RE.search(line):
                    n += 1
    return n


def records_pass(paths):
    n = 0
    for p in paths:
        with open(p) as f:
            for _ in iter_nccl_records(f, file=str(p)):
                n += 1
    return n


def events_pass(paths):
    return sum(1 for _ in iter_nccl_events(paths))


def peak_bytes(path: Path, n_lines: int) -> int:
    with open(path) as f:
        tracemalloc.start()
        n = sum(1 for _ in iter_nccl_events([(str(path), itertools.islice(f, n_lines))]))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert n == n_lines - 1  # the first line is the INIT line
    return peak


def maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=2_000_000, help="COLL lines in total")
    ap.add_argument("--ranks", type=int, default=8, help="processes (one file each)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        paths = generate(Path(tmp), args.lines, args.ranks)
        size = sum(p.stat().st_size for p in paths)
        print(f"generated {len(paths)} files, {size / 2**20:.0f} MiB in "
              f"{time.perf_counter() - t0:.1f} s")
        read = timed("read", read_pass, paths)
        regex = timed("regex", regex_pass, paths)
        records = timed("records", records_pass, paths)
        rss0 = maxrss_kib()
        events = timed("events", events_pass, paths)
        rss1 = maxrss_kib()
        print(f"records: {records / read:.3f} x read, {records / regex:.3f} x regex; "
              f"events: {events / read:.3f} x read, {events / regex:.3f} x regex")
        print(f"ru_maxrss: {rss0 / 1024:.1f} MiB before the events pass, {rss1 / 1024:.1f} MiB "
              f"after ({(rss1 - rss0) / 1024:+.1f} MiB over {args.lines:,d} lines)")
        lines = [n for n in (20_000, 200_000) if n <= args.lines // args.ranks]
        peaks = [peak_bytes(paths[0], n) for n in lines]
        print("tracemalloc peak, streaming events: " + ", ".join(
            f"{n:,d} lines {p / 1024:.0f} KiB" for n, p in zip(lines, peaks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
