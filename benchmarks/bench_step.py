"""Step time of every Muon implementation of the harness, side by side.

One invocation, ``--world-size`` forked gloo ranks (``tests/distributed/harness.py``), three
models:

- ``mlp``: ``--mlp-layers`` x Linear(``--mlp-dim``, ``--mlp-dim``) + ReLU blocks and a 16-way
  head, ``--mlp-batch`` random rows per rank (the compute-bound workload);
- ``latency``: the same MLP at ``--latency-layers`` x (``--latency-dim``)² with
  ``--latency-batch`` rows per rank (default 12 x 64², 8 rows: a step made of many small
  matrices, where each collective's fixed cost dominates; the latency-bound row);
- ``tinygpt``: the ``make verify-traffic`` model (``verify/workload/model.py`` defaults, byte tokens of
  the standard library, 2 sequences per rank).

Every implementation is a mode of ``verify/modes/build.py`` (its own meshes and process groups),
built once per model; after ``--warmup`` steps each, ``--rounds`` rounds time ``--steps``
steps of every implementation, in order on even rounds and reversed on odd ones (the machine
is shared and noisy: a drift hits every implementation alike). Step time is rank 0's wall
clock over the block, after a barrier. Then one more step per implementation runs under the
interposer (``tracer/interposer.py``) to count its collectives per rank-step and the time the
training thread spends inside collective calls.

Printed per model and implementation:

- median CPU ms per step summed over the ranks (``time.process_time``: every thread of each
  rank, gloo's included): with W ranks on fewer cores the step's wall time follows it;
- median ms/step over rounds, and the median over rounds of its ratio to the fastest
  *baseline* (ddp-muon, zero1-muon, naive-*) of the same round (with the first and third
  quartiles of that ratio over rounds: the spread a verdict near its target sits in) and to
  zero1-muon;
- collectives per rank-step (mean over ranks; asynchronous ones included and counted apart);
- exposed communication: time the training thread spends in collective calls and blocked in
  their ``wait()`` (interposer timings of the instrumented step: issue ``t_start_ns`` ..
  ``t_end_ns`` plus ``t_wait_start_ns`` .. ``t_waited_ns``, each call counted once; mean over
  ranks) / median step time. DDP's C++ reducer waits are not visible to the interposer, so
  for ddp-muon and the DDP part of dmuon-ddp / zero1-muon this is a lower bound.

DMuon runs with ``coalesce="auto"`` (docs/traffic-model.md, "Coalescing"); each DMuon mode
also runs as ``<mode>/block`` with ``coalesce="block"`` (one unit per block, the layout before
coalescing) in the same rounds, so before and after are measured side by side
(``--no-per-block`` skips them). Each DMuon mode also runs as ``<mode>/rest`` with
``dedicate_params(rest="replicate")`` (and ``coalesce="auto"``): DMuon keeps the params it does
not dedicate replicated and all-reduces their grads itself (one call per dtype per step,
``dmuon/runtime/rest.py``), and nothing wraps the model, against the default rows where DDP or
FSDP2 handles them (``--no-rest`` skips them). Without a wrapper dmuon-ddp/rest is dmuon-z2/rest:
two rows of one configuration, whose difference shows the invocation's noise. The HSDP modes
run with ``hierarchy="auto"`` (flat on gloo for a one-unit model: docs/traffic-model.md, "HSDP:
flat or hierarchical") and also as ``<mode>/hier`` and ``<mode>/rest/hier`` with
``hierarchy="hierarchical"`` (``--no-hier`` skips them).

Targets (W=4, medians of the per-round ratios to the fastest baseline): dmuon-ddp,
dmuon-z2, dmuon-hsdp-z2 <= 1.0; dmuon-z3, dmuon-hsdp-z3 <= 1.15, for every variant of the
mode (``/block``, ``/rest``), with a PASS/FAIL column.

Usage: ``python benchmarks/bench_step.py [--world-size 4] [--rounds 7] [--models mlp,tinygpt,latency]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.distributed.harness import DistributedPool  # noqa: E402
from tracer.interposer import Interposer  # noqa: E402
from verify.workload.data import ByteCorpus, local_slice  # noqa: E402
from verify.workload.model import GPTConfig, TinyGPT  # noqa: E402
from verify.modes.build import build  # noqa: E402
from verify.run.runner import train_step  # noqa: E402

BASELINES = ("ddp-muon", "zero1-muon", "naive-fsdp2-z2", "naive-fsdp2-z3", "naive-hsdp")
DMUON = ("dmuon-ddp", "dmuon-z2", "dmuon-z3", "dmuon-hsdp-z2", "dmuon-hsdp-z3")
#: The targets: median ratio to the fastest baseline of the round at W=4.
TARGETS = {"dmuon-ddp": 1.0, "dmuon-z2": 1.0, "dmuon-hsdp-z2": 1.0, "dmuon-z3": 1.15,
           "dmuon-hsdp-z3": 1.15}
CORPUS_BYTES = 200_000
MLP_CLASSES = 16


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class MLP(nn.Module):
    """``layers`` x (Linear(dim, dim) + ReLU) and a 16-way ``head``: 4 Muon matrices by default."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, MLP_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


#: Suffix of the DMuon rows built with ``coalesce="block"`` (one unit per block: the layout
#: before coalescing), run in the same invocation as the default ``"auto"`` rows.
PER_BLOCK = "/block"
#: Suffix of the DMuon rows built with ``rest="replicate"`` (DMuon replicates the rest; nothing
#: wraps the model), run in the same invocation as the default ``rest="wrapper"`` rows.
REST = "/rest"
#: Suffix of the HSDP rows built with ``hierarchy="hierarchical"`` (the replicate reduce and
#: broadcast kept), run in the same invocation as the default ``"auto"`` rows.
HIER = "/hier"


def _implementations(world: int, per_block: bool, rest: bool = True, hier: bool = True) -> list[str]:
    hsdp = world >= 4 and world % 2 == 0
    extra = tuple(m + PER_BLOCK for m in DMUON) if per_block else ()
    extra += tuple(m + REST for m in DMUON) if rest else ()
    if hier:
        extra += tuple(m + s + HIER for m in DMUON if "hsdp" in m for s in ("", REST)[: 1 + rest])
    return [m for m in (*BASELINES, *DMUON, *extra) if hsdp or "hsdp" not in m]


def _build(mode: str, make_model):
    """``mode`` of :func:`_implementations` built by ``verify.modes.build.build``: its suffixes
    pick DMuon's ``coalesce`` (``/block``), ``rest`` (``/rest``) and ``hierarchy`` (``/hier``)."""
    base, *suffixes = mode.split("/")
    return build(base, make_model, coalesce="block" if "block" in suffixes else "auto",
                 rest="replicate" if "rest" in suffixes else "wrapper",
                 hierarchy="hierarchical" if "hier" in suffixes else "auto")


def _batches(model_name: str, args):
    """``batch(step) -> (x, y)`` of this rank, identical for every implementation."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if model_name in ("mlp", "latency"):
        dim, layers, rows = ((args.mlp_dim, args.mlp_layers, args.mlp_batch) if model_name == "mlp"
                             else (args.latency_dim, args.latency_layers, args.latency_batch))

        def mlp_batch(step: int):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(rows, dim, generator=g)
            return x, torch.randint(0, MLP_CLASSES, (rows,), generator=g)

        return (lambda: MLP(dim, layers)), mlp_batch
    cfg = GPTConfig()
    corpus = ByteCorpus.from_stdlib(CORPUS_BYTES)

    def gpt_batch(step: int):
        x, y = corpus.global_batch(step, 2 * world, cfg.seq_len)
        return local_slice(x, rank, world), local_slice(y, rank, world)

    return (lambda: TinyGPT(cfg)), gpt_batch


def _rank_task(model_name: str, args) -> dict:
    world = dist.get_world_size()
    make_model, batch = _batches(model_name, args)
    impls = _implementations(world, args.per_block, args.rest, args.hier)
    built = {}
    for mode in impls:
        torch.manual_seed(0)
        built[mode] = _build(mode, make_model)
    step = 0
    for mode in impls:
        for _ in range(args.warmup):
            train_step(built[mode].model, built[mode].optimizer, *batch(step))
            step += 1
    rounds: list[dict[str, float]] = []
    cpu_rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        times, cpu = {}, {}
        for mode in (impls if r % 2 == 0 else impls[::-1]):
            b = built[mode]
            dist.barrier()
            t0, c0 = time.perf_counter_ns(), time.process_time_ns()
            for _ in range(args.steps):
                train_step(b.model, b.optimizer, *batch(step))
                step += 1
            if b.dedicated is not None:
                b.dedicated.wait_pending()
            times[mode] = (time.perf_counter_ns() - t0) / args.steps
            cpu[mode] = (time.process_time_ns() - c0) / args.steps
        rounds.append(times)
        cpu_rounds.append(cpu)
    counted = {}
    for mode in impls:
        b = built[mode]
        dist.barrier()
        with Interposer() as rec:
            train_step(b.model, b.optimizer, *batch(step))
            step += 1
            if b.dedicated is not None:
                b.dedicated.wait_pending()
        counted[mode] = {"collectives": len(rec.events), "in_collectives_ns": _blocked_ns(rec.events)}
    return {"rounds": rounds, "cpu_rounds": cpu_rounds, "counted": counted}


def _blocked_ns(events) -> int:
    """Time in collective calls (issue) and in their waits, each call once (the events of one
    coalesced call share its times)."""
    issued = {(e.t_start_ns, e.t_end_ns) for e in events if e.t_end_ns is not None}
    waited = {(e.t_wait_start_ns, e.t_waited_ns) for e in events if e.t_waited_ns is not None}
    return sum(b - a for a, b in issued) + sum(b - a for a, b in waited)


def _summarise(per_rank: list[dict]) -> list[dict]:
    rounds = per_rank[0]["rounds"]  # rank 0's wall clock after a barrier
    impls = list(rounds[0])
    rows = []
    for mode in impls:
        ms = statistics.median(t[mode] for t in rounds) / 1e6
        ratios = [t[mode] / min(t[b] for b in BASELINES if b in t) for t in rounds]
        to_fastest = statistics.median(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (to_fastest,) * 3
        to_zero1 = statistics.median(t[mode] / t["zero1-muon"] for t in rounds)
        calls = statistics.mean(r["counted"][mode]["collectives"] for r in per_rank)
        inside_ms = statistics.mean(r["counted"][mode]["in_collectives_ns"] for r in per_rank) / 1e6
        cpu_ms = statistics.median(sum(r["cpu_rounds"][i][mode] for r in per_rank)
                                   for i in range(len(rounds))) / 1e6
        target = TARGETS.get(mode.split("/")[0])
        rows.append({"implementation": mode, "ms_per_step": ms, "cpu_ms_per_step": cpu_ms,
                     "x_fastest_baseline": to_fastest, "x_fastest_iqr": [q1, q3],
                     "x_zero1": to_zero1, "collectives_per_rank_step": calls,
                     "exposed_comm_fraction": min(inside_ms / ms, 1.0), "target_x_fastest": target,
                     "verdict": None if target is None else ("PASS" if to_fastest <= target else "FAIL")})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--models", default="mlp,tinygpt,latency", help="comma-separated: mlp, tinygpt, latency")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (>= 5 for a median)")
    parser.add_argument("--no-per-block", dest="per_block", action="store_false",
                        help=f"skip the DMuon rows with coalesce='block' ('{PER_BLOCK}': the layout before "
                        "coalescing, run beside the default coalesce='auto' rows)")
    parser.add_argument("--no-rest", dest="rest", action="store_false",
                        help=f"skip the DMuon rows with rest='replicate' ('{REST}': DMuon all-reduces "
                        "the params it does not dedicate and nothing wraps the model, run beside the "
                        "default rows where DDP / FSDP2 handle them)")
    parser.add_argument("--no-hier", dest="hier", action="store_false",
                        help=f"skip the HSDP rows with hierarchy='hierarchical' ('{HIER}')")
    parser.add_argument("--steps", type=int, default=3, help="steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps per implementation before timing")
    parser.add_argument("--mlp-dim", type=int, default=256)
    parser.add_argument("--mlp-layers", type=int, default=4)
    parser.add_argument("--mlp-batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--latency-dim", type=int, default=64)
    parser.add_argument("--latency-layers", type=int, default=12)
    parser.add_argument("--latency-batch", type=int, default=8, help="rows per rank")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := [m for m in models if m not in ("mlp", "tinygpt", "latency")]:
        parser.error(f"Invalid --models entries {unknown}. Must be among mlp, tinygpt, latency.")
    if min(args.rounds, args.steps, args.world_size - 1) < 1 or args.warmup < 2:
        parser.error(f"Invalid {args.rounds=}, {args.steps=}, {args.world_size=} or {args.warmup=}. "
                     "Must be rounds, steps >= 1, world size >= 2, warmup >= 2.")
    out = {}
    with DistributedPool(args.world_size, timeout_s=1800) as pool:
        for model_name in models:
            rows = _summarise(pool.run(_rank_task, model_name, args))
            out[model_name] = rows
            print(f"\n{model_name}: W={args.world_size} gloo, {args.rounds} interleaved rounds x "
                  f"{args.steps} steps, torch {torch.__version__}")
            print(tabulate(
                [[r["implementation"], r["ms_per_step"], r["cpu_ms_per_step"], r["x_fastest_baseline"],
                  "{:.2f}-{:.2f}".format(*r["x_fastest_iqr"]), r["x_zero1"],
                  r["collectives_per_rank_step"], r["exposed_comm_fraction"],
                  "" if r["target_x_fastest"] is None else f"<= {r['target_x_fastest']:.2f}",
                  r["verdict"] or ""] for r in rows],
                headers=["implementation", "ms/step", "CPU ms/step", "x fastest baseline", "quartiles", "x zero1",
                         "collectives/rank-step", "exposed comm", "target", "verdict"],
                floatfmt=".2f"))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
