"""Cost of DMuon's NVTX ranges with no profiler attached, next to a real DMuon training step.

Two parts, each comparing NVTX on and off (:func:`dmuon.annotate.set_nvtx_enabled`) in the
same session, blocks alternating, ``--repeats`` blocks per variant after a warm-up block:

- **per range** (this process, no span listener registered, as in a run without the tracer):
  ``--iters`` enter + exit of ``span("dmuon.broadcast", module=..., owner=...)`` and of
  ``phase("forward")``; the median ns per call of each variant and their difference, the cost
  of one range. "No profiler attached" means ``nvtx.get_domain`` returned its no-op domain
  (printed): that is what every run outside Nsight Systems gets.
- **per step** (``--world-size`` forked gloo ranks, ``tests/distributed/harness.py``): mode
  ``--mode`` of the harness (``verify/modes/build.py``) on the default TinyGPT (``verify/workload/model.py``).
  After ``--warmup`` steps one step is counted: DMuon spans by name through a span listener,
  and every NVTX push / pop through a counting stand-in for the NVTX domain (spans + phase
  ranges). Then blocks of ``--steps`` steps, NVTX on / off alternately (on-off, off-on, ...);
  step time is rank 0's wall clock (a barrier before each block), median over blocks.

Printed: ranges per step (spans by name, with whether each carries module and owner), the
estimated share ``(spans x span cost + phases x phase cost) / step time``, and the measured
on / off step-time ratio (whose noise on a shared CPU machine is far above that share).

Usage: ``python benchmarks/bench_nvtx.py [--world-size 4] [--mode dmuon-hsdp-z3] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dmuon import annotate  # noqa: E402
from tests.distributed.harness import DistributedPool  # noqa: E402
from verify.workload.data import ByteCorpus, local_slice  # noqa: E402
from verify.workload.model import GPTConfig, TinyGPT  # noqa: E402
from verify.modes.build import build  # noqa: E402
from verify.run.runner import train_step  # noqa: E402

GLOBAL_BATCH = 8  # sequences per step over all ranks (verify.run.runner.RunConfig's default)
CORPUS_BYTES = 200_000


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


# ------------------------------------------------------------------------------ per range
def _time_calls(enter, iters: int, nvtx_on: bool) -> float:
    """ns per enter + exit of the context manager ``enter()``, NVTX on or off."""
    annotate.set_nvtx_enabled(nvtx_on)
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        with enter():
            pass
    return (time.perf_counter_ns() - t0) / iters


def range_costs(iters: int, repeats: int) -> list[dict]:
    """Median ns per call of span() and phase(), NVTX on and off, alternating blocks."""
    cases = {
        "span(name, module, owner)": lambda: annotate.span(
            "dmuon.broadcast", module="blocks.0.mlp.fc1", owner=2),
        "phase(name)": lambda: annotate.phase("forward"),
    }
    was_on = annotate.nvtx_enabled()
    rows = []
    try:
        for case, enter in cases.items():
            _time_calls(enter, max(1, iters // 4), True)  # warm-up
            on, off = [], []
            for _ in range(repeats):
                on.append(_time_calls(enter, iters, True))
                off.append(_time_calls(enter, iters, False))
            rows.append({"case": case, "calls": iters, "on_ns": statistics.median(on),
                         "off_ns": statistics.median(off)})
            rows[-1]["nvtx_cost_ns"] = rows[-1]["on_ns"] - rows[-1]["off_ns"]
    finally:
        annotate.set_nvtx_enabled(was_on)
    return rows


# ------------------------------------------------------------------------------- per step
class CountingDomain:
    """Stands in for the NVTX domain while one step is counted: every push and pop."""

    def __init__(self) -> None:
        self.pushes: Counter = Counter()
        self.pops = 0

    def get_event_attributes(self, message=None):
        return message

    def push_range(self, attributes=None):
        self.pushes["phase" if attributes.startswith("dmuon.phase ") else "span"] += 1

    def pop_range(self):
        self.pops += 1


def _step(built, corpus: ByteCorpus, step: int, seq_len: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = corpus.global_batch(step, GLOBAL_BATCH, seq_len)
    train_step(built.model, built.optimizer, local_slice(x, rank, world), local_slice(y, rank, world))


def _rank_task(mode: str, warmup: int, steps: int, repeats: int) -> dict:
    """On each rank: build ``mode``, count one step's ranges, time NVTX on / off blocks."""
    cfg = GPTConfig()
    corpus = ByteCorpus.from_stdlib(CORPUS_BYTES)
    built = build(mode, lambda: TinyGPT(cfg))
    step = 0
    for _ in range(warmup):
        _step(built, corpus, step, cfg.seq_len)
        step += 1
    spans, counter = [], CountingDomain()
    saved_domain, was_on = annotate._NVTX_DOMAIN, annotate.nvtx_enabled()
    annotate.add_span_listener(spans.append)
    annotate._NVTX_DOMAIN = counter  # measurement device: count what NVTX would receive
    annotate.set_nvtx_enabled(True)
    try:
        _step(built, corpus, step, cfg.seq_len)
        step += 1
    finally:
        annotate._NVTX_DOMAIN = saved_domain
        annotate.remove_span_listener(spans.append)
    times = {True: [], False: []}
    try:
        for i in range(repeats):
            for nvtx_on in ((True, False) if i % 2 == 0 else (False, True)):  # no order bias
                annotate.set_nvtx_enabled(nvtx_on)
                dist.barrier()
                t0 = time.perf_counter_ns()
                for _ in range(steps):
                    _step(built, corpus, step, cfg.seq_len)
                    step += 1
                times[nvtx_on].append((time.perf_counter_ns() - t0) / steps)
    finally:
        annotate.set_nvtx_enabled(was_on)
    if built.dedicated is not None:
        built.dedicated.wait_pending()
    by_name = Counter(s.name for s in spans)
    labelled = {n: all(s.module is not None and s.owner is not None for s in spans if s.name == n)
                for n in by_name}
    return {"spans_by_name": dict(by_name), "labelled": labelled,
            "nvtx_pushes": dict(counter.pushes), "nvtx_pops": counter.pops,
            "step_ns_on": times[True], "step_ns_off": times[False]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20000, help="calls per timed block")
    parser.add_argument("--repeats", type=int, default=7, help="timed blocks per variant")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mode", default="dmuon-hsdp-z3", help="a DMuon mode of verify/modes/build.py")
    parser.add_argument("--warmup", type=int, default=3, help="steps before counting")
    parser.add_argument("--steps", type=int, default=2, help="steps per timed block")
    parser.add_argument("--step-repeats", type=int, default=10, help="step blocks per variant")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    if min(args.iters, args.repeats, args.steps, args.step_repeats) < 1 or args.warmup < 2:
        parser.error(f"Invalid {args.iters=}, {args.repeats=}, {args.steps=}, "
                     f"{args.step_repeats=} or {args.warmup=}. Must be >= 1 (warmup >= 2: an "
                     "HSDP step waits for the previous step's replicate broadcast).")
    if not args.mode.startswith("dmuon-"):
        parser.error(f"Invalid {args.mode=}. Must be a DMuon mode (dmuon-ddp, dmuon-z2, "
                     "dmuon-z3, dmuon-hsdp-z2, dmuon-hsdp-z3).")
    torch.set_num_threads(1)
    ranges = range_costs(args.iters, args.repeats)
    with DistributedPool(args.world_size, timeout_s=600) as pool:
        per_rank = pool.run(_rank_task, args.mode, args.warmup, args.steps, args.step_repeats)
    r0 = per_rank[0]
    cost = {r["case"].split("(")[0]: r["nvtx_cost_ns"] for r in ranges}
    step_on, step_off = statistics.median(r0["step_ns_on"]), statistics.median(r0["step_ns_off"])
    pushes = [r["nvtx_pushes"] for r in per_rank]
    est_ns = [p.get("span", 0) * cost["span"] + p.get("phase", 0) * cost["phase"] for p in pushes]

    print(f"NVTX range cost, no profiler attached (domain: {type(annotate._NVTX_DOMAIN).__name__}, "
          f"nvtx {_version('nvtx')}), torch "
          f"{torch.__version__}, median of {args.repeats} blocks, this process")
    print(tabulate([[r["case"], r["calls"], r["on_ns"], r["off_ns"], r["nvtx_cost_ns"]]
                    for r in ranges],
                   headers=["call (enter + exit)", "calls/block", "nvtx on ns/call",
                            "nvtx off ns/call", "nvtx cost ns"], floatfmt=".0f"))
    print(f"\nRanges in one {args.mode} step on {args.world_size} gloo ranks (TinyGPT defaults), "
          "per rank")
    names = sorted({n for r in per_rank for n in r["spans_by_name"]})
    print(tabulate(
        [[n, *[r["spans_by_name"].get(n, 0) for r in per_rank],
          all(r["labelled"].get(n, True) for r in per_rank)] for n in names]
        + [["all spans (NVTX pushes)", *[p.get("span", 0) for p in pushes], ""],
           ["phase ranges (NVTX pushes)", *[p.get("phase", 0) for p in pushes], ""]],
        headers=["range", *[f"rank {r}" for r in range(args.world_size)], "module+owner"]))
    print(f"\nStep time, rank 0 wall clock, median of {args.step_repeats} blocks of {args.steps} "
          f"steps: NVTX on {step_on / 1e6:.2f} ms, off {step_off / 1e6:.2f} ms, on/off ratio "
          f"{step_on / step_off:.4f} (blocks on: "
          f"{', '.join(f'{t / 1e6:.1f}' for t in r0['step_ns_on'])} ms; off: "
          f"{', '.join(f'{t / 1e6:.1f}' for t in r0['step_ns_off'])} ms)")
    print(f"Estimated NVTX share of a step (ranges x cost / step time, busiest rank): "
          f"{max(est_ns) / 1e3:.1f} us / {step_off / 1e6:.2f} ms = "
          f"{max(est_ns) / step_off:.2e}")
    if any(r["nvtx_pops"] != sum(p.values()) for r, p in zip(per_rank, pushes)):
        print("error: NVTX pushes and pops differ on some rank", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps({"ranges": ranges, "per_rank": per_rank,
                                         "estimated_share": max(est_ns) / step_off,
                                         "step_ratio_on_off": step_on / step_off}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
