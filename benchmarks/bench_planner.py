"""Planner, predictor and dmuon-plan times on the presets, each beside its baseline.

- **planner**: :func:`dmuon.ownership.plan.plan_ownership` (heap LPT on FLOPs, MULTIFIT on small sets)
  against the retired PLAN_VERSION 1 planner (a Python ``min`` over all W owners per matrix,
  cost rows*cols*min, kept below as the baseline, O(M*W)); rounds interleaved, medians.
  ``--baseline-max-matrices`` skips the baseline on larger sets (DeepSeek-V3-like: ~46 s
  per plan at W=1024 on the dev machine).
- **predictor**: :func:`verify.traffic.scale.step_traffic` (aggregate, one plan) against
  :func:`verify.traffic.predict.predict_step` (every call of every rank) on Llama-3-8B, DMuon-Z3, at
  ``--predict-worlds``; the aggregate alone for Llama-3-70B on HSDP 128x8.
- **dmuon-plan**: wall time of ``--model llama3-70b --mesh 128x8`` and of the Llama-3-8B
  sweep, each in a fresh process (imports included).

Usage: ``python benchmarks/bench_planner.py [--rounds 3] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dmuon.ownership.plan import plan_ownership  # noqa: E402
from verify.plan.cli import ModelLayout  # noqa: E402
from verify.traffic.predict import predict_step  # noqa: E402
from verify.workload.presets import build_preset  # noqa: E402
from verify.traffic.scale import step_traffic  # noqa: E402


def retired_plan_v1(specs, world: int) -> dict[str, int]:
    """PLAN_VERSION 1's loop (the baseline): cost rows*cols*min, a scan of all owners."""
    cost = {sp.name: sp.shape[0] * sp.shape[1] * min(sp.shape) for sp in specs}
    ordered = sorted(specs, key=lambda sp: (-cost[sp.name], -sp.nbytes, sp.name))
    ns_load, bytes_load, shard_bytes, owner = [0] * world, [0] * world, [0] * world, {}
    for sp in ordered:
        c, nb = cost[sp.name], sp.nbytes
        g = min(range(world), key=lambda o: (ns_load[o] + c, shard_bytes[o] + nb, bytes_load[o] + nb, o))
        owner[sp.name] = g
        ns_load[g] += c
        bytes_load[g] += nb
        shard_bytes[g] += nb
    return owner


def _median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_planner(rounds: int, world: int, baseline_max: int) -> list[list]:
    rows = []
    for name in ("gpt2-small", "llama3-8b", "llama3-70b", "qwen3-30b-a3b", "deepseek-v3-like"):
        ml = ModelLayout(build_preset(name), name)
        muon = set(ml.muon_names)
        specs = [p for p in ml.params if p.name in muon]
        new_t, old_t = [], []
        for _ in range(rounds):  # interleaved
            new_t.append(_median_s(lambda: plan_ownership(specs, (1, world)), 1))
            if len(specs) <= baseline_max:
                old_t.append(_median_s(lambda: retired_plan_v1(specs, world), 1))
        new, old = statistics.median(new_t), statistics.median(old_t) if old_t else None
        rows.append([name, len(specs), world, f"{new:.3f}", f"{old:.2f}" if old else "skipped",
                     f"{old / new:.0f}x" if old else "-"])
    return rows


def bench_predictor(rounds: int, worlds: list[int]) -> list[list]:
    ml = ModelLayout(build_preset("llama3-8b"), "llama3-8b")
    rows = []
    for w in worlds:
        layout = ml.layout("dmuon-z3", 1, w)
        agg = _median_s(lambda: step_traffic(layout), rounds)
        exact = _median_s(lambda: predict_step(layout), 1)
        rows.append(["llama3-8b dmuon-z3", f"1x{w}", f"{agg:.3f}", f"{exact:.1f}", f"{exact / agg:.0f}x"])
    ml70 = ModelLayout(build_preset("llama3-70b"), "llama3-70b")
    for mode in ("naive-hsdp", "dmuon-hsdp-z2", "dmuon-hsdp-z3"):
        layout = ml70.layout(mode, 128, 8)
        rows.append([f"llama3-70b {mode}", "128x8", f"{_median_s(lambda: step_traffic(layout), rounds):.3f}", "-", "-"])
    return rows


def bench_cli() -> list[list]:
    rows = []
    for argv in (["--model", "llama3-70b", "--mesh", "128x8"], ["--model", "llama3-8b", "--sweep"],
                 ["--model", "deepseek-v3-like", "--mesh", "128x8"]):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "verify.plan.cli", *argv], cwd=ROOT, check=True,
                       capture_output=True, timeout=900)
        rows.append(["dmuon-plan " + " ".join(argv), f"{time.perf_counter() - t:.1f}"])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=1024)
    p.add_argument("--baseline-max-matrices", type=int, default=20000)
    p.add_argument("--predict-worlds", default="64,256")
    p.add_argument("--json", help="write the tables as JSON here")
    args = p.parse_args()
    planner = bench_planner(args.rounds, args.world, args.baseline_max_matrices)
    print(tabulate(planner, headers=["preset", "matrices", "W", "plan s (now)", "plan s (v1)", "speed-up"],
                   tablefmt="github"))
    predictor = bench_predictor(args.rounds, [int(w) for w in args.predict_worlds.split(",")])
    print(tabulate(predictor, headers=["predictor", "mesh", "aggregate s", "exact list s", "speed-up"],
                   tablefmt="github"))
    cli = bench_cli()
    print(tabulate(cli, headers=["command", "wall s (fresh process)"], tablefmt="github"))
    print("medians of interleaved rounds on a shared machine: noisy; compare ratios")
    if args.json:
        Path(args.json).write_text(json.dumps({"planner": planner, "predictor": predictor, "cli": cli}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
