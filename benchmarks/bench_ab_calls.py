"""Load-independent A/B of two source trees: what one training step *does*, counted per rank.

Wall-clock ratios on a shared 2-core machine move by 30-60 % between invocations; counts do
not. For each mode of ``bench_step.py`` (``verify/modes/build.py``) on one of its models (default
``latency``: 12 x 64², 8 rows per rank), after ``--warmup`` steps this runs ``--steps`` steps
three times, each under one recorder, and reports per rank-step (mean over ranks):

- ``py_calls``: Python function calls (``cProfile``'s total, C builtins included;
  deterministic: the same on every run of a tree), and per function ``(file, name)`` its calls
  and own time (``tottime`` on the training thread's CPU clock, ``time.thread_time_ns``, with
  the profiler's own cost in it: still moved 10-40 % by the machine's load, so compare counts
  first and own times only within one invocation);
- ``ops``: aten ops dispatched at the Python dispatch level (a ``TorchDispatchMode`` counting
  ``func`` names; ops a tensor subclass runs inside its own dispatch are not seen again);
- ``collectives`` by op and ``waits`` (``tracer.interposer.Interposer``: calls issued, and
  calls whose handle was waited from Python);
- ``cpu_ms`` / ``thread_cpu_ms``: ``time.process_time`` (every thread of the rank, gloo's
  included) / ``time.thread_time`` (the training thread) per step with no recorder, median of
  ``--cpu-rounds`` blocks: load-dependent, shown for scale only.

One invocation measures the tree it imports from (``--tree``, default this script's own
repository); run it once per tree and compare the two JSON files::

    python benchmarks/bench_ab_calls.py --tree /work/ab-before --json before.json
    python benchmarks/bench_ab_calls.py --tree /work/ab-now --json now.json
    python benchmarks/bench_ab_calls.py --compare before.json now.json [--top 15]
    python benchmarks/bench_ab_calls.py --split now.json   # per package: dmuon, FSDP2, DDP, ...

Files are keyed by their path inside the tree (or inside ``torch/``), names without line
numbers, so a function that moved within its file still matches.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

DEFAULT_MODES = ("zero1-muon", "dmuon-ddp", "dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")


def _func_key(filename: str, name: str, tree: str) -> str:
    """``"<file>:<name>"`` with the file relative to the tree or to torch's package."""
    if filename.startswith(tree):
        filename = filename[len(tree):].lstrip("/")
    elif "/site-packages/" in filename:
        filename = filename.split("/site-packages/", 1)[1]
    elif "/lib/python" in filename:
        filename = "stdlib/" + filename.rsplit("/", 1)[-1]
    return f"{filename}:{name}"


def _bench_step(tree: str):
    """``<tree>/benchmarks/bench_step.py`` as a module (its models and mode builder), loaded
    by path: a pool's workers were forked before any ``sys.path`` change of the caller."""
    import importlib.util

    path = Path(tree) / "benchmarks" / "bench_step.py"
    spec = importlib.util.spec_from_file_location("_ab_bench_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(built, batch, step: int, steps: int, train_step) -> int:
    for _ in range(steps):
        train_step(built.model, built.optimizer, *batch(step))
        step += 1
    if built.dedicated is not None:
        built.dedicated.wait_pending()
    return step


def _rank_task(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from tracer.interposer import Interposer
    from verify.run.runner import train_step

    class OpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, f_args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*f_args, **(kwargs or {}))

    tree = str(Path(args.tree).resolve())
    bench_step = _bench_step(tree)
    make_model, batch = bench_step._batches(args.model, args)
    out, step = {}, 0
    for mode in args.modes.split(","):
        torch.manual_seed(0)
        built = bench_step._build(mode, make_model)
        step = _run(built, batch, step, args.warmup, train_step)
        cpu, thread_cpu = [], []
        for _ in range(args.cpu_rounds):
            dist.barrier()
            c0, t0 = time.process_time_ns(), time.thread_time_ns()
            step = _run(built, batch, step, args.steps, train_step)
            cpu.append((time.process_time_ns() - c0) / args.steps / 1e6)
            thread_cpu.append((time.thread_time_ns() - t0) / args.steps / 1e6)
        dist.barrier()
        # the training thread's CPU clock: own times do not count waiting for a core or a peer
        prof = cProfile.Profile(time.thread_time_ns, 1e-9)
        prof.enable()
        step = _run(built, batch, step, args.steps, train_step)
        prof.disable()
        st = pstats.Stats(prof)
        funcs: dict[str, list[float]] = {}
        for (filename, _line, name), (_cc, ncalls, tottime, _ct, _callers) in st.stats.items():
            entry = funcs.setdefault(_func_key(filename, name, tree), [0, 0.0])
            entry[0] += ncalls / args.steps
            entry[1] += tottime * 1e6 / args.steps
        dist.barrier()
        with OpCounter() as counter:
            step = _run(built, batch, step, args.steps, train_step)
        dist.barrier()
        with Interposer() as rec:
            step = _run(built, batch, step, args.steps, train_step)
        calls = Counter(e.op for e in rec.events)
        waited = {(e.t_wait_start_ns, e.t_waited_ns) for e in rec.events if e.t_waited_ns is not None}
        out[mode] = {
            "py_calls": st.total_calls / args.steps,
            "py_own_us": st.total_tt * 1e6 / args.steps,
            "funcs": funcs,
            "ops": sum(counter.ops.values()) / args.steps,
            "op_counts": {k: v / args.steps for k, v in counter.ops.items()},
            "collectives": len(rec.events) / args.steps,
            "collective_ops": {k: v / args.steps for k, v in calls.items()},
            "waits": len(waited) / args.steps,
            "cpu_ms": statistics.median(cpu),
            "thread_cpu_ms": statistics.median(thread_cpu),
        }
        del built
    return out


def _mean(per_rank: list[dict], mode: str, key: str) -> float:
    return statistics.mean(r[mode][key] for r in per_rank)


def _merge(per_rank: list[dict], mode: str, key: str) -> dict:
    """Per-item mean over ranks of a ``{name: value or [calls, us]}`` dict."""
    total: dict = {}
    for r in per_rank:
        for k, v in r[mode][key].items():
            vals = v if isinstance(v, list) else [v]
            acc = total.setdefault(k, [0.0] * len(vals))
            for i, x in enumerate(vals):
                acc[i] += x / len(per_rank)
    return total


def summarise(per_rank: list[dict]) -> dict:
    """Mean over ranks per mode, plus each rank's totals (``per_rank``)."""
    out = {}
    for mode in per_rank[0]:
        out[mode] = {k: _mean(per_rank, mode, k)
                     for k in ("py_calls", "py_own_us", "ops", "collectives", "waits", "cpu_ms", "thread_cpu_ms")}
        out[mode]["per_rank"] = [{k: r[mode][k] for k in ("py_calls", "ops", "collectives", "waits", "cpu_ms",
                                                             "thread_cpu_ms")}
                                 for r in per_rank]
        out[mode]["funcs"] = _merge(per_rank, mode, "funcs")
        out[mode]["op_counts"] = {k: v[0] for k, v in _merge(per_rank, mode, "op_counts").items()}
        out[mode]["collective_ops"] = {k: v[0] for k, v in _merge(per_rank, mode, "collective_ops").items()}
    return out


#: Where a profiled function lives, first match wins (keys of ``funcs``: ``_func_key``).
PACKAGES = (("dmuon", ("dmuon/",)),
            ("torch FSDP2", ("torch/distributed/fsdp/",)),
            ("torch DDP", ("torch/nn/parallel/",)),
            ("torch distributed (other)", ("torch/distributed/",)),
            ("torch (other)", ("torch/",)),
            ("harness", ("verify/", "tracer/", "benchmarks/", "tests/")))


def package_of(key: str) -> str:
    """The :data:`PACKAGES` name of a ``"<file>:<name>"`` key; ``"builtins, stdlib, other"``
    when none matches (C builtins show as ``~`` files). A venv inside the tree keeps its
    ``site-packages`` prefix in the key: cut here."""
    key = key.split("site-packages/", 1)[-1]
    for name, prefixes in PACKAGES:
        if key.startswith(prefixes):
            return name
    return "builtins, stdlib, other"


def split(summary: dict) -> str:
    """Per mode, Python calls and profiled own time (thread CPU us) per rank-step grouped by
    package (:func:`package_of`): where a mode's extra Python goes, FSDP2's own or DMuon's.
    Calls are load-independent; own times compare only within one invocation."""
    lines = []
    names = [n for n, _ in PACKAGES] + ["builtins, stdlib, other"]
    lines.append("mode | " + " | ".join(f"{n}: calls (own us)" for n in names))
    for mode, row in summary.items():
        acc = {n: [0.0, 0.0] for n in names}
        for key, (calls, own_us) in row["funcs"].items():
            acc[package_of(key)][0] += calls
            acc[package_of(key)][1] += own_us
        lines.append(f"{mode} | " + " | ".join(f"{acc[n][0]:.0f} ({acc[n][1]:.0f})" for n in names))
    return "\n".join(lines)


def compare(a: dict, b: dict, top: int) -> str:
    """Text report of B against A: totals per mode, then per mode the functions whose calls and
    own time per rank-step grew most, and the aten ops and collectives whose counts changed."""
    lines = ["mode | py calls A -> B | profiled thread-CPU us A -> B | ops A -> B | collectives A -> B | "
             "waits A -> B | process CPU ms A -> B | thread CPU ms A -> B"]
    for mode in a:
        if mode not in b:
            continue
        lines.append(f"{mode} | " + " | ".join(
            f"{a[mode][k]:.1f} -> {b[mode][k]:.1f}"
            for k in ("py_calls", "py_own_us", "ops", "collectives", "waits", "cpu_ms", "thread_cpu_ms")))
    for mode in a:
        if mode not in b:
            continue
        fa, fb = a[mode]["funcs"], b[mode]["funcs"]
        keys = set(fa) | set(fb)
        d = {k: (fb.get(k, [0, 0])[0] - fa.get(k, [0, 0])[0], fb.get(k, [0, 0])[1] - fa.get(k, [0, 0])[1])
             for k in keys}
        lines.append(f"\n{mode}: functions, calls per rank-step A -> B (own us A -> B), by growth in calls")
        for k in sorted(keys, key=lambda k: -d[k][0])[:top]:
            if d[k][0] <= 0:
                break
            lines.append(f"  {fa.get(k, [0, 0])[0]:8.1f} -> {fb.get(k, [0, 0])[0]:8.1f}  "
                         f"({fa.get(k, [0, 0])[1]:7.0f} -> {fb.get(k, [0, 0])[1]:7.0f} us)  {k}")
        lines.append(f"{mode}: by growth in own time")
        for k in sorted(keys, key=lambda k: -d[k][1])[:top]:
            if d[k][1] <= 0:
                break
            lines.append(f"  {fa.get(k, [0, 0])[0]:8.1f} -> {fb.get(k, [0, 0])[0]:8.1f}  "
                         f"({fa.get(k, [0, 0])[1]:7.0f} -> {fb.get(k, [0, 0])[1]:7.0f} us)  {k}")
        for key in ("op_counts", "collective_ops"):
            oa, ob = a[mode][key], b[mode][key]
            changed = sorted((k for k in set(oa) | set(ob) if abs(oa.get(k, 0) - ob.get(k, 0)) > 1e-9),
                             key=lambda k: -abs(ob.get(k, 0) - oa.get(k, 0)))
            if changed:
                lines.append(f"{mode}: {key} changed: " + ", ".join(
                    f"{k} {oa.get(k, 0):.1f}->{ob.get(k, 0):.1f}" for k in changed[:top]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository root to import dmuon, verify, tracer and bench_step from")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A_JSON", "B_JSON"),
                        help="print B against A from two earlier --json files and exit")
    parser.add_argument("--top", type=int, default=15, help="functions listed per mode with --compare")
    parser.add_argument("--split", type=Path, metavar="JSON",
                        help="print an earlier --json file's Python calls and own time per package and exit")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--model", default="latency", choices=("latency", "mlp", "tinygpt"))
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps under each recorder")
    parser.add_argument("--cpu-rounds", type=int, default=3, help="unrecorded blocks of --steps for cpu_ms")
    for name, default in (("mlp-dim", 256), ("mlp-layers", 4), ("mlp-batch", 32), ("latency-dim", 64),
                          ("latency-layers", 12), ("latency-batch", 8)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", type=Path, help="write the per-mode summary here")
    args = parser.parse_args(argv)
    if args.split:
        print(split(json.loads(args.split.read_text())))
        return 0
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        print(compare(a, b, args.top))
        return 0
    if min(args.steps, args.cpu_rounds, args.world_size - 1) < 1 or args.warmup < 2:
        parser.error(f"Invalid {args.steps=}, {args.cpu_rounds=}, {args.world_size=} or {args.warmup=}. "
                     "Must be steps, cpu rounds >= 1, world size >= 2, warmup >= 2.")
    tree = args.tree.resolve()
    if not (tree / "dmuon").is_dir() or not (tree / "benchmarks" / "bench_step.py").is_file():
        parser.error(f"Invalid --tree {tree}: no dmuon/ or benchmarks/bench_step.py there. "
                     "Must be a DMuon repository root.")
    sys.path.insert(0, str(tree))
    import dmuon
    from tests.distributed.harness import DistributedPool

    if not Path(dmuon.__file__).resolve().is_relative_to(tree):
        parser.error(f"dmuon imports from {dmuon.__file__}, not from --tree {tree}: clear PYTHONPATH.")
    with DistributedPool(args.world_size, timeout_s=1800) as pool:
        out = summarise(pool.run(_rank_task, args))
    for mode, row in out.items():
        print(f"{mode}: py_calls {row['py_calls']:.0f}, ops {row['ops']:.0f}, collectives "
              f"{row['collectives']:.2f}, waits {row['waits']:.2f}, cpu_ms {row['cpu_ms']:.1f} per rank-step")
    print(split(out))
    if args.json:
        args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
