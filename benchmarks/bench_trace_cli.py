"""Start-up time and peak memory of the ``dmuon-trace`` command line, against a baseline tree.

A script, not a test::

    python benchmarks/bench_trace_cli.py [--lines 5000000] [--ranks 8] [--repeats 5]
                                         [--baseline /path/to/other/checkout]

Every figure is a fresh ``python -m tracer.cli ...`` process, run with the ``PYTHONPATH`` of
this checkout and, when ``--baseline`` is given, of the other checkout, interleaved round by
round (this, baseline, this, baseline, ...):

- ``help``: ``dmuon-trace --help``;
- ``nccl small``: ``dmuon-trace nccl`` on the first 2,000 lines of the generated logs;
- ``nccl big``: ``dmuon-trace nccl`` on ``--lines`` COLL lines (the 2.21-format logs of
  ``benchmarks/bench_nccl_parser.py``'s ``generate``), once per tree (it is long).

Per command it reports the child's CPU seconds (user + system, ``resource.RUSAGE_CHILDREN``),
wall seconds and peak RSS (``ru_maxrss`` of the child, MiB, measured from a stdlib-only
interpreter because Linux carries ``ru_maxrss`` across fork + exec), medians over the rounds; for
``nccl big``, the single run. The machine may be shared: read the medians and the ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(tree: Path, args: list[str]) -> dict:
    """One ``python -m tracer.cli ARGS`` in a fresh process; its CPU s, wall s, peak RSS MiB."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tracer.cli", *args], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: dmuon-trace {' '.join(args)} exited {proc.returncode}: "
                         f"{proc.stderr.decode()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: start each probe fresh below.
    return {"cpu_s": cpu, "wall_s": wall, "rss_mib": after.ru_maxrss / 1024}


def probe(tree: Path, args: list[str]) -> dict:
    """:func:`run` inside a fresh interpreter, so ``ru_maxrss`` is this command's alone."""
    code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); "
            f"from bench_trace_cli import run; from pathlib import Path; "
            f"print(json.dumps(run(Path({str(tree)!r}), {args!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    # Imported here, not at the top: probe() imports this module in the interpreter that forks
    # each measured command, and Linux carries ru_maxrss across fork + exec, so that
    # interpreter must stay small (stdlib only) or its size would be the child's peak.
    sys.path.insert(0, str(REPO))
    from tabulate import tabulate

    from benchmarks.bench_nccl_parser import generate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=5_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    args = parser.parse_args(argv)
    trees = {"this": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        big = generate(tmp / "big", args.lines, args.ranks, timestamps=False)
        small = tmp / "small.log"
        with open(big[0]) as src, open(small, "w") as dst:
            for _, line in zip(range(2000), src):
                dst.write(line)
        commands = {"help": ["--help"],
                    "nccl small": ["nccl", str(small), "--out", str(tmp / "s.parquet")]}
        results: dict[tuple, list] = {}
        for _ in range(args.repeats):
            for name, cmd in commands.items():
                for label, tree in trees.items():
                    results.setdefault((name, label), []).append(probe(tree, cmd))
        for label, tree in trees.items():
            results[("nccl big", label)] = [probe(tree, ["nccl", *map(str, big), "--out",
                                                         str(tmp / f"b_{label}.parquet")])]
    rows = []
    for (name, label), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append([name, label, len(runs), f"{med['cpu_s']:.2f}", f"{med['wall_s']:.2f}",
                     f"{med['rss_mib']:.0f}"])
    print(f"dmuon-trace start-up and peak RSS; big log: {args.lines:,} COLL lines in "
          f"{args.ranks} files (NCCL 2.21 format)")
    print(tabulate(rows, headers=["command", "tree", "runs", "CPU s (median)", "wall s (median)",
                                  "peak RSS MiB (median)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
