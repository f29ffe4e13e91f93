"""Run every mode on this rank, measure steady-state steps, and assemble the report on rank 0.

Runs inside an initialised default process group (torchrun, or the test harness). For each
mode: build it (``verify.modes``), train ``warmup + measured`` steps on the byte corpus, record
the measured steps with the :class:`tracer.interposer.Interposer` (and the Flight Recorder,
the NCCL log and the NVLink counters where they exist: ``_MeasuredWindow``), write this rank's
events to ``<out_dir>/<mode>/events_rank<r>.parquet``, and gather everything to rank 0, which
compares with the prediction (``verify.compare``) and cross-checks the other sources.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dmuon
from tracer.crosscheck import crosscheck
from tracer.events import write_parquet
from tracer.flight_recorder import (
    dump_flight_recorder,
    flight_recorder_enabled,
    fr_window,
    read_flight_recorder,
)
from tracer.interposer import Interposer
from tracer.nvml import NvlinkSampler
from tracer.timeline import write_chrome_trace

from .compare import compare_run
from .data import ByteCorpus, local_slice
from .model import GPTConfig, TinyGPT
from .modes import build
from .nccl_source import WindowMark, capture_active, nccl_source_report
from .nvlink import nvlink_report
from .plots import plot_timeline
from .traffic import MODES


@dataclass(frozen=True)
class RunConfig:
    """What ``verify-traffic`` runs (defaults: the embedded CPU job).

    Attributes:
        modes: modes to run, in order; HSDP modes are skipped where W is not even and >= 4.
        steps_warmup: steps before measuring (lazy init, DDP's bucket rebuild).
        steps_measured: steady-state steps recorded by the interposer.
        global_batch: sequences per step over all ranks (divisible by W).
        seq_len: tokens per sequence.
        d_model, n_layers, n_heads: the TinyGPT size.
        seed: model init and data order.
        out_dir: where traces and reports go.
        device: "cpu" (gloo) or "cuda" (NCCL).
        mixed_precision: ``None`` or a key of ``verify.modes.MIXED_PRECISION`` (``"bf16"``).
    """

    modes: tuple[str, ...] = MODES
    steps_warmup: int = 4
    steps_measured: int = 2
    global_batch: int = 8
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seed: int = 0
    out_dir: str = "traces/latest"
    device: str = "cpu"
    mixed_precision: str | None = None


def runnable_modes(config: RunConfig, world_size: int) -> list[str]:
    """The modes of ``config`` this world size can run (HSDP needs an even W >= 4)."""
    ok_hsdp = world_size >= 4 and world_size % 2 == 0
    return [m for m in config.modes if ok_hsdp or "hsdp" not in m]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> float:
    """One step of next-token training with DMuon's phase tags: forward and the cross-entropy
    loss (phase ``forward``), backward (``backward``), ``optimizer.step()``, ``zero_grad()``.

    Args:
        x, y: int64 token ids ``[batch, seq_len]`` of this rank (inputs and targets).

    Returns:
        The loss (a Python float).
    """
    with dmuon.phase("forward"):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    with dmuon.phase("backward"):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


class _MeasuredWindow:
    """Every recorder of the measured steps, opened after the warm-up and closed after the last
    step: the interposer, the Flight Recorder dumps, this rank's NCCL log window, the NVLink
    counters (local rank 0 samples its node) and the ``dmuon.window <mode>`` NVTX range."""

    def __init__(self, mode: str, out: Path, device: str) -> None:
        self.mode, self.out, self.device = mode, out, device
        self.rank = dist.get_rank()
        self.interposer = Interposer()
        self._fr_on = flight_recorder_enabled()
        self._nccl_on = capture_active(dist.get_backend())
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self._nvlink = NvlinkSampler() if local_rank == 0 else None
        self._stack = contextlib.ExitStack()

    def open(self) -> None:
        self._fr_before = dump_flight_recorder(self.out / "fr_before", self.rank) if self._fr_on else None
        self._nccl = WindowMark(self.rank) if self._nccl_on else None
        if self._nvlink is not None:
            _sync(self.device)  # warm-up traffic finished before the counters start
            self._nvlink.start()
        self._stack.enter_context(dmuon.annotate.window(self.mode))
        self._stack.enter_context(self.interposer)

    def close(self) -> dict:
        """``{"fr_events", "nccl", "nvlink"}``: what the other recorders saw (``None`` where off)."""
        self._stack.close()
        nccl = self._nccl.close() if self._nccl is not None else None  # only the window travels
        nvlink = None
        if self._nvlink is not None:
            _sync(self.device)
            nvlink = self._nvlink.stop()
        fr_events = None
        if self._fr_on:
            after = dump_flight_recorder(self.out, self.rank)
            fr_events = fr_window(read_flight_recorder(self._fr_before).events,
                                  read_flight_recorder(after).events)
        return {"fr_events": fr_events, "nccl": nccl, "nvlink": nvlink}


def _train_mode(mode: str, config: RunConfig, corpus: ByteCorpus, progress) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(seq_len=config.seq_len, d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads)

    def make_model():
        torch.manual_seed(config.seed)
        return TinyGPT(cfg)

    built = build(mode, make_model, config.device, config.mixed_precision)
    model, opt = built.model, built.optimizer
    out = Path(config.out_dir) / mode
    losses, step_starts = [], []
    window = _MeasuredWindow(mode, out, config.device)
    ns_before = 0
    for step in range(config.steps_warmup + config.steps_measured):
        if step == config.steps_warmup:
            ns_before = opt.ns_calls
            window.open()
        if step >= config.steps_warmup:
            step_starts.append(dmuon.annotate.now_ns())
        x, y = corpus.global_batch(step, config.global_batch, config.seq_len, seed=config.seed)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        losses.append(train_step(model, opt, x.to(config.device), y.to(config.device)))
        progress(1)
    recorded = window.close()
    step_starts.append(dmuon.annotate.now_ns())
    if built.dedicated is not None:
        built.dedicated.wait_pending()
    events = window.interposer.events
    write_parquet(events, out / f"events_rank{rank}.parquet")
    if rank == 0:
        (out / "layout.json").write_text(json.dumps(built.layout.to_dict(), indent=1))
    return {
        "events": events,
        "spans": window.interposer.spans,
        "losses": losses,
        "step_starts_ns": step_starts,
        **recorded,
        "ns_calls": opt.ns_calls - ns_before,
        "layout": built.layout,
        "plan_digest": built.dedicated.plan.digest() if built.dedicated else None,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_all(config: RunConfig, progress=None) -> dict | None:
    """Run every mode; returns the report dict on rank 0 and ``None`` elsewhere.

    ``progress(n)`` is called after every training step on rank 0 (e.g. ``tqdm.update``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = ByteCorpus.from_stdlib()
    tick = progress if (progress is not None and rank == 0) else (lambda n: None)
    runs = []
    for mode in runnable_modes(config, world):
        mine = _train_mode(mode, config, corpus, tick)
        gathered: list = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank != 0:
            continue
        events = [ev for r in gathered for ev in r["events"]]
        run = compare_run(
            gathered[0]["layout"],
            events,
            steps=config.steps_measured,
            ns_calls=sum(r["ns_calls"] for r in gathered),
        )
        losses = [sum(r["losses"][i] for r in gathered) / world for i in range(len(mine["losses"]))]
        run["loss_first"], run["loss_last"] = losses[0], losses[-1]
        run["loss_falls"] = losses[-1] < losses[0]
        run["pass"] = run["pass"] and run["loss_falls"]
        digests = {r["plan_digest"] for r in gathered}
        run["plan_digest"] = digests.pop() if len(digests) == 1 else sorted(map(str, digests))
        run["sources"] = _sources(run, events, gathered, config.steps_measured)
        run["pass"] = run["pass"] and all(s["pass"] for s in run["sources"].values())
        run["replicate_overlap"] = _replicate_overlap(gathered)
        run["nvlink"] = nvlink_report([r["nvlink"] for r in gathered if r["nvlink"] is not None], events)
        per_rank = {i: (r["events"], r["spans"]) for i, r in enumerate(gathered)}
        timeline = Path(config.out_dir) / mode / "timeline.json"
        write_chrome_trace(timeline, per_rank, name=mode)
        run["timeline"] = str(timeline.relative_to(config.out_dir))
        if mode.startswith("dmuon-"):
            starts = gathered[0]["step_starts_ns"]  # one host: one perf_counter clock
            plot_timeline(timeline.with_suffix(".png"), per_rank, title=f"{mode}: last measured step",
                          t0_ns=starts[-2], t1_ns=starts[-1])
        runs.append(run)
    if rank != 0:
        return None
    return {
        "pass": all(r["pass"] for r in runs) and bool(runs),
        "torch_version": torch.__version__,
        "backend": dist.get_backend(),
        "world_size": world,
        "steps_warmup": config.steps_warmup,
        "steps_measured": config.steps_measured,
        "config": asdict(config),
        "runs": runs,
    }


def _sources(run: dict, events: list, gathered: list[dict], steps: int) -> dict:
    """report.json ``sources``: the interposer against the prediction, the others against it."""
    unexpected = sum(u["n"] for u in run["unexpected"])
    missing = sum(m["n"] for m in run["missing"])
    sources = {
        "interposer": {
            "events": len(events),
            "matched": len(events) - unexpected,
            "unmatched": unexpected + missing,
            "pass": unexpected == 0 and missing == 0,
            "mismatches": [f"missing {m}" for m in run["missing"][:10]]
            + [f"unexpected {u}" for u in run["unexpected"][:10]],
        }
    }
    if all(r["fr_events"] is not None for r in gathered):
        fr = [ev for r in gathered for ev in r["fr_events"]]
        check = crosscheck(events, fr, source="flight_recorder", backend=dist.get_backend())
        sources["flight_recorder"] = {**check.as_report(), "mismatches": [str(m) for m in check.mismatches[:20]]}
    if any(r["nccl"] is not None for r in gathered):
        sources["nccl_log"] = nccl_source_report(
            [r["nccl"] for r in gathered if r["nccl"] is not None], events, gathered[0]["layout"], steps)
    return sources


def _replicate_overlap(gathered: list[dict]) -> list[dict]:
    """HSDP: each replicate broadcast's issue time and the end of its wait (interposer clock, ns).

    A wait is paired with the latest earlier issue of the same module on the same rank;
    ``gap_ns`` (wait start minus issue) is the time the transfer had to hide behind compute.
    """
    out = []
    for rank, r in enumerate(gathered):
        issued: dict[str, list[int]] = {}
        for s in r["spans"]:
            if s.name == "dmuon.replicate_broadcast":
                issued.setdefault(s.module, []).append(s.t_start_ns)
        for s in r["spans"]:
            if s.name != "dmuon.replicate_wait":
                continue
            before = [t for t in issued.get(s.module, []) if t < s.t_start_ns]
            if before:
                out.append({
                    "module": s.module,
                    "rank": rank,
                    "issued_ns": before[-1],
                    "waited_ns": s.t_start_ns,
                    "gap_ns": s.t_start_ns - before[-1],
                    "wait_dur_ns": s.t_end_ns - s.t_start_ns,
                })
    return out
