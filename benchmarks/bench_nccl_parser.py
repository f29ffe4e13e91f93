"""Throughput and memory of the NCCL_DEBUG=INFO parser (tracer.nccl.log) on a large log.

A script, not a test::

    python benchmarks/bench_nccl_parser.py [--lines 2000000] [--ranks 8] [--repeats 5]
        [--passes read,regex,table,parquet] [--no-memory] [--logs DIR]
    python benchmarks/bench_nccl_parser.py --line-mb 50 [--shapes markers,records]

Generates one log per rank in a temp dir (an INIT line, then COLL lines rendered by the test
tool tests/tools/nccl_render.py in NCCL 2.21 format), in two cases: ``plain`` (``host:pid:tid
[dev] NCCL INFO ...``) and ``timestamps`` (the same with NCCL 2.26+'s ``[YYYY-mm-dd
HH:MM:SS.ffffff] `` prefix). The process is pinned to one CPU (``--cpu``) and Arrow to one
thread. Per case it times, in this process, ``--repeats`` rounds of (after one warm-up):

- ``read``: ``for line in f: pass`` (the I/O floor);
- ``regex``: one ``re.search`` per line for ``NCCL INFO <Op>: opCount`` (a minimal parser);
- ``table``: :func:`tracer.nccl.log.nccl_logs_to_table` (files -> Arrow table of events);
- ``parquet``: :func:`tracer.nccl.log.write_nccl_parquet` (files -> Parquet, what
  ``dmuon-trace nccl PATH... --out`` runs);
- with ``--layers``: :func:`~tracer.nccl.log.iter_nccl_records` and
  :func:`~tracer.nccl.log.iter_nccl_events` (Python objects per line; slower).

``--passes`` times a subset (``read`` always: the ratios need it), ``--no-memory`` skips the
memory section, ``--logs DIR`` generates the logs there and reuses them in later runs with the
same ``--lines`` / ``--ranks`` (each pass checks the line count it reads), for a loaded
machine where generating 5M lines takes minutes.

Hostile single lines (``--line-mb 50``): instead of the throughput run, one
line of that many MB per shape of ``tests/tools/nccl_hostile.py`` (repeated markers, op
heads, records, look-alike op names, INIT lines, colours, non-ASCII text, invalid UTF-8, ...;
``--shapes`` picks some), each parsed by ``write_nccl_parquet`` (what ``dmuon-trace nccl``
runs) in a fresh child process after a warm-up on a small log (this process writes the
line a MB at a time and never holds it: a child's ``ru_maxrss`` starts from its parent's);
it prints the growth of the child's peak RSS (``ru_maxrss`` from ``resource.getrusage``, and
``VmHWM``, which starts afresh at ``exec``) and its CPU seconds, and the larger growth as a
multiple of the line's size. The bound it checks (exit status
1 when a shape exceeds it): RSS growth <= 3x the line size + 64 MiB (the interpreter's
allocator and Arrow's pool keep freed memory, and a Parquet row group of rows is held)
+ 1.5 KiB per distinct communicator (state kept for the whole parse, as in any log);
``tests/nccl/test_nccl_memory.py`` asserts the tighter traced bound (tracemalloc) on 2-3 MB lines.

It prints COLL lines per second of CPU time (``time.process_time``: all threads of this
process) and of wall time, median and best of the rounds, and each path's ratio to ``read``
and ``regex`` of the same round. The machine is shared: read the medians, and the ratios.

Memory, measured first (``plain`` case, at ``--lines`` and a quarter of it, to show it does
not grow): the growth of ``ru_maxrss`` and of ``VmHWM`` over one streaming ``parquet`` pass
and Arrow's pool peak (``pyarrow.default_memory_pool().max_memory()``), each in a fresh
subprocess after a warm-up pass on a small log (Linux keeps ``ru_maxrss`` across ``exec``,
so the children start before this process has held any table); and the ``tracemalloc`` peak
(Python objects and numpy arrays) of the same pass in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
from tabulate import tabulate  # noqa: E402

from tests.tools import nccl_render as R  # noqa: E402
from tracer.events import CollectiveEvent  # noqa: E402
from tracer.nccl.log import (  # noqa: E402
    iter_nccl_events,
    iter_nccl_records,
    nccl_logs_to_table,
    write_nccl_parquet,
)

OPS = [("all_gather", "bfloat16"), ("reduce_scatter", "float32"), ("all_reduce", "float32"),
       ("broadcast", "bfloat16"), ("reduce", "bfloat16")]
T0_NS = 1_777_961_807_000_000_000  # 2026-05-05 06:16:47 UTC
STEP_NS = 7_000  # between two lines of one rank


def generate(folder: Path, n_lines: int, ranks: int, timestamps: bool) -> list[Path]:
    """One log per rank: an INIT line, then ``n_lines // ranks`` COLL lines."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    per_rank = n_lines // ranks
    for rank in range(ranks):
        host, pid, dev, comm = f"node{rank // 8}", 10_000 + rank, rank % 8, f"0x55aa{rank:04x}0"
        # the messages of the five calls as rendered by the test tool, with holes for the
        # opCount and count fields that change from line to line
        holes = []
        for op, dtype in OPS:
            ev = CollectiveEvent(source="nccl_log", op=op, count=4096, dtype=dtype,
                                 root=rank % ranks, comm=comm, group_size=ranks)
            msg = R.coll_line(ev, opcount=0xABC)
            assert msg.count("opCount abc ") == 1 and msg.count(" count 4096 ") == 1
            holes.append(msg.replace("{", "{{").replace("}", "}}")
                         .replace("opCount abc ", "opCount {:x} ").replace(" count 4096 ",
                                                                           " count {} "))
        path = folder / f"nccl.{host}.{pid}"
        with open(path, "w") as f:
            f.write(R.prefix(host, pid, pid, dev) + R.init_line(
                version="2.21", comm=comm, rank=rank, nranks=ranks, cuda_dev=dev,
                comm_id="0x5ae77eb5ea4ec1ee") + "\n")
            plain = R.prefix(host, pid, pid, dev)
            for i in range(per_rank):
                pre = R.prefix(host, pid, pid, dev, T0_NS + i * STEP_NS) if timestamps else plain
                f.write(pre + holes[i % len(holes)].format(i, 4096 + i % 977) + "\n")
        paths.append(path)
    return paths


_RE = re.compile(r"NCCL INFO ([A-Za-z]+): opCount")


def read_pass(paths, out):
    n = 0
    for p in paths:
        with open(p) as f:
            for _ in f:
                n += 1
    return n


def regex_pass(paths, out):
    n = 0
    for p in paths:
        with open(p) as f:
            for line in f:
                if _RE.search(line):
                    n += 1
    return n


def table_pass(paths, out):
    return nccl_logs_to_table(paths).table.num_rows


def parquet_pass(paths, out):
    return write_nccl_parquet(paths, out).rows


def records_pass(paths, out):
    n = 0
    for p in paths:
        with open(p) as f:
            n += sum(1 for _ in iter_nccl_records(f, file=str(p)))
    return n


def events_pass(paths, out):
    return sum(1 for _ in iter_nccl_events(paths))


PASSES = {"read": read_pass, "regex": regex_pass, "table": table_pass, "parquet": parquet_pass,
          "records": records_pass, "events": events_pass}


def time_case(paths: list[Path], out: Path, repeats: int, names: list[str]) -> dict:
    """``{name: [(lines, cpu_s, wall_s) per round]}``; one warm-up round first."""
    passes = {name: PASSES[name] for name in names}
    times: dict[str, list] = {name: [] for name in passes}
    for rnd in range(repeats + 1):
        for name, fn in passes.items():
            c0, w0 = time.process_time(), time.perf_counter()
            n = fn(paths, out)
            if rnd:
                times[name].append((n, time.process_time() - c0, time.perf_counter() - w0))
    return times


def report(case: str, times: dict, coll_lines: int) -> list[list]:
    rows = []
    for name, rounds in times.items():
        cpu = [coll_lines / c for _, c, _ in rounds]
        wall = [coll_lines / w for _, _, w in rounds]
        ratios = []
        for base in ("read", "regex"):
            vs = [c_b / c for (_, c, _), (_, c_b, _) in zip(rounds, times.get(base, []))]
            ratios.append(f"{statistics.median(vs):.3f}" if vs else "n/a")
        rows.append([case, name, f"{statistics.median(cpu):,.0f}", f"{min(cpu):,.0f}",
                     f"{max(cpu):,.0f}", f"{statistics.median(wall):,.0f}", *ratios])
    return rows


def _hwm_kib() -> int | None:
    """Peak resident set of this address space (``VmHWM``, Linux), which unlike
    ``ru_maxrss`` starts afresh at ``exec``; ``None`` where ``/proc`` lacks it."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def memory_probe(paths: list[str], out: str, warm: list[str]) -> dict:
    """One streaming Parquet pass in this (fresh) process, after a warm-up pass."""
    write_nccl_parquet(warm, out)
    pool = pa.default_memory_pool()
    rss0, hwm0, arrow0 = maxrss_kib(), _hwm_kib(), pool.max_memory()
    rows = write_nccl_parquet(paths, out).rows
    hwm1 = _hwm_kib()
    return {"rows": rows, "rss_before_kib": rss0, "rss_growth_kib": maxrss_kib() - rss0,
            "hwm_before_kib": hwm0, "hwm_growth_kib": None if hwm0 is None else hwm1 - hwm0,
            "arrow_peak_before": arrow0, "arrow_peak": pool.max_memory(),
            "arrow_allocated_after": pa.total_allocated_bytes()}


def maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def tracemalloc_peak(paths: list[Path], out: Path) -> int:
    tracemalloc.start()
    write_nccl_parquet(paths, out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def pin(cpu: int | None) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[0] if cpu is None else cpu
    os.sched_setaffinity(0, {cpu})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    return cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=2_000_000, help="COLL lines in total per case")
    ap.add_argument("--ranks", type=int, default=8, help="processes (one file each)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per case")
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the first "
                    "this process may use)")
    ap.add_argument("--layers", action="store_true", help="also time iter_nccl_records and "
                    "iter_nccl_events")
    ap.add_argument("--passes", default="read,regex,table,parquet",
                    help="comma-separated passes to time (read is always timed)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory section")
    ap.add_argument("--logs", default=None, help="folder to generate the logs in and reuse "
                    "them from (default: a temporary folder)")
    ap.add_argument("--line-mb", type=float, default=None, help="measure the peak RSS of "
                    "parsing one hostile line of this many MB per shape instead (e.g. 50)")
    ap.add_argument("--shapes", default=None, help="comma-separated shapes for --line-mb "
                    "(default: all of tests/tools/nccl_hostile.py)")
    ap.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)  # internal: memory_probe
    ap.add_argument("--probe-line", nargs=3, help=argparse.SUPPRESS)  # internal: line_probe
    args = ap.parse_args(argv)
    if args.probe_line:
        print(json.dumps(line_probe(*args.probe_line)))
        return 0
    if args.line_mb is not None:
        return line_section(args.line_mb, args.shapes, pin(args.cpu))
    names = ["read"] + [n for n in args.passes.split(",") if n and n != "read"]
    names += ["records", "events"] if args.layers else []
    if any(n not in PASSES for n in names):
        ap.error(f"Invalid --passes {args.passes!r}. Must name passes of {sorted(PASSES)}.")
    if args.probe:
        out, warm, *paths = args.probe
        print(json.dumps(memory_probe(paths, out, [warm])))
        return 0
    cpu = pin(args.cpu)
    print(f"pinned to CPU {cpu}; Arrow {pa.__version__}, 1 thread; Python {sys.version.split()[0]}")
    rows = []
    coll = args.lines // args.ranks * args.ranks
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        where = Path(args.logs) if args.logs else tmp
        logs = {}
        for case in ("plain", "timestamps"):
            t0 = time.perf_counter()
            logs[case] = _logs(where / case, args.lines, args.ranks, case == "timestamps")
            size = sum(p.stat().st_size for p in logs[case])
            print(f"{case}: {len(logs[case])} files, {coll:,d} COLL lines, {size / 2**20:.0f} "
                  f"MiB, ready in {time.perf_counter() - t0:.1f} s", flush=True)
        if not args.no_memory:  # first, while this process is small: a child inherits its
            print(memory_section(logs["plain"], tmp, args.lines, args.ranks, cpu), flush=True)
        for case, paths in logs.items():
            times = time_case(paths, tmp / "events.parquet", args.repeats, names)
            for name, rounds in times.items():
                assert all(n in (coll, coll + args.ranks) for n, _, _ in rounds), (name, rounds)
            rows += report(case, times, coll)
        print(tabulate(rows, headers=["case", "path", "COLL lines/s (CPU, median)", "worst",
                                      "best", "lines/s (wall, median)", "x read", "x regex"],
                       disable_numparse=True))
    return 0


def _logs(folder: Path, n_lines: int, ranks: int, timestamps: bool) -> list[Path]:
    """The logs of :func:`generate` in ``folder``, generated unless all of them are there
    (their line counts are checked by every timed pass)."""
    expected = [folder / f"nccl.node{rank // 8}.{10_000 + rank}" for rank in range(ranks)]
    if all(p.is_file() for p in expected):
        return expected
    paths = generate(folder, n_lines, ranks, timestamps)
    assert paths == expected, (paths, expected)
    return paths


def memory_section(paths: list[Path], tmp: Path, n_lines: int, ranks: int, cpu: int) -> str:
    """The memory table; steady once a pass is past its first row group (ROW_GROUP_ROWS rows)
    and full blocks, so compare sizes beyond that (the default's 500,000 and 2,000,000)."""
    small = generate(tmp / "quarter", n_lines // 4, ranks, False)
    warm = generate(tmp / "warm", 8 * ranks, ranks, False)[0]
    sizes = ((f"{n_lines // 4:,d} lines", small), (f"{n_lines:,d} lines", paths))
    cmd = ["taskset", "-c", str(cpu)] if _has_taskset() else []
    probes = [json.loads(subprocess.run(
        cmd + [sys.executable, __file__, "--probe", str(tmp / "probe.parquet"), str(warm),
               *map(str, ps)], check=True, capture_output=True, text=True).stdout)
        for _, ps in sizes]  # before any tracemalloc pass grows this process
    rows = []
    for (label, ps), probe in zip(sizes, probes):
        hwm = probe["hwm_growth_kib"]
        rows.append([label, probe["rows"], f"{probe['rss_before_kib'] / 1024:.0f}",
                     f"{probe['rss_growth_kib'] / 1024:+.1f}",
                     "n/a" if hwm is None else f"{hwm / 1024:+.1f}",
                     f"{probe['arrow_peak'] / 2**20:.1f}",
                     f"{probe['arrow_allocated_after'] / 2**20:.1f}",
                     f"{tracemalloc_peak(ps, tmp / 'tm.parquet') / 2**20:.1f}"])
    return "memory of one streaming parquet pass:\n" + tabulate(
        rows, headers=["log", "events", "ru_maxrss before (MiB)", "ru_maxrss growth (MiB)",
                       "VmHWM growth (MiB)", "Arrow pool peak (MiB)", "Arrow held after (MiB)",
                       "tracemalloc peak (MiB)"], disable_numparse=True)


#: The RSS bound ``--line-mb`` checks: growth <= LINE_RSS_FACTOR x line + LINE_RSS_FIXED
#: + LINE_RSS_PER_COMM x distinct communicators (their state is kept for the whole parse).
LINE_RSS_FACTOR, LINE_RSS_FIXED, LINE_RSS_PER_COMM = 3.0, 64 * 2**20, 1536


def line_probe(path: str, out: str, warm: str) -> dict:
    """One ``write_nccl_parquet`` of the one-line file ``path`` in this (fresh) process,
    after a warm-up pass on ``warm``: peak RSS growth and CPU seconds."""
    write_nccl_parquet([warm], out)
    rss0, hwm0 = maxrss_kib(), _hwm_kib()
    c0 = time.process_time()
    res = write_nccl_parquet([path], out, max_issues=10)
    cpu = time.process_time() - c0
    hwm1 = _hwm_kib()
    return {"rss_growth_kib": maxrss_kib() - rss0, "rss_before_kib": rss0,
            "hwm_growth_kib": None if hwm0 is None else hwm1 - hwm0, "cpu_s": cpu,
            "rows": res.rows, "issues": res.issue_count, "comms": len(res.comms)}


def line_section(line_mb: float, shapes: str | None, cpu: int) -> int:
    """The hostile-line table (module docstring); 1 when a shape exceeds the RSS bound."""
    from tests.tools import nccl_hostile as H

    names = H.NAMES if not shapes else [n.strip() for n in shapes.split(",")]
    unknown = [n for n in names if n not in H.NAMES]
    if unknown:
        raise SystemExit(f"Invalid --shapes {unknown}. Must be among {H.NAMES}.")
    size = int(line_mb * 1e6)
    cmd = ["taskset", "-c", str(cpu)] if _has_taskset() else []
    rows, over = [], []
    print(f"pinned to CPU {cpu}; one line of {line_mb:g} MB per shape, a child process each",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm = generate(tmp / "warm", 64, 1, False)[0]
        for name in names:
            path = tmp / "line.log"
            n = H.write_line(path, name, size)  # this process never holds the line
            probe = json.loads(subprocess.run(
                cmd + [sys.executable, __file__, "--probe-line", str(path),
                       str(tmp / "out.parquet"), str(warm)],
                check=True, capture_output=True, text=True).stdout)
            rss = probe["rss_growth_kib"] * 1024
            hwm = probe["hwm_growth_kib"]
            growth = max(rss, hwm * 1024 if hwm is not None else 0)
            bound = LINE_RSS_FACTOR * n + LINE_RSS_FIXED + LINE_RSS_PER_COMM * probe["comms"]
            if growth > bound:
                over.append(name)
            rows.append([name, f"{n / 2**20:.1f}", f"{rss / 2**20:.1f}",
                         "n/a" if hwm is None else f"{hwm / 1024:.1f}", f"{growth / n:.2f}",
                         f"{probe['cpu_s']:.1f}", probe["rows"], probe["issues"],
                         probe["comms"], "ok" if growth <= bound else "OVER"])
            print(f"  {name}: {growth / 2**20:.1f} MiB peak RSS growth ({growth / n:.2f}x), "
                  f"{probe['cpu_s']:.1f} CPU-s", flush=True)
    print(tabulate(rows, headers=["shape", "line MiB", "ru_maxrss growth MiB",
                                  "VmHWM growth MiB", "x line (larger)", "CPU s", "events",
                                  "issues", "comms",
                                  f"<= {LINE_RSS_FACTOR:g}x + {LINE_RSS_FIXED >> 20} MiB "
                                  f"+ {LINE_RSS_PER_COMM / 1024:g} KiB/comm"],
                   disable_numparse=True))
    if over:
        print(f"over the bound: {over}")
    return 1 if over else 0


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


if __name__ == "__main__":
    sys.exit(main())
