"""Run every mode on this rank, measure steady-state steps, and assemble the report on rank 0.

Runs inside an initialised default process group (torchrun, or the test harness). For each
mode: build it (``verify.modes.build``), train ``warmup + measured`` steps on the byte corpus, record
the measured steps with the :class:`tracer.interposer.Interposer` and ``torch.profiler`` (and
the Flight Recorder, the NCCL log and the NVLink counters where they exist: ``_MeasuredWindow``),
write this rank's events to ``<out_dir>/<mode>/events_rank<r>.parquet``, and gather everything
to rank 0, which compares with the prediction (``verify.compare``) and cross-checks the other
sources over the window, and checks every step a source recorded before it (the Flight
Recorder's warm-up steps, split by step marks on the system clock: ``verify.sources.steps``).
The global batch is ``batch_per_rank`` times W unless ``global_batch`` is given.

Every check a run is gated on is named in its ``checks`` and the report's ``failures``
(``verify.report.checks``). A mode that raises (in training or in rank 0's comparison) is an
``error`` failure with its message; its traceback goes to ``<out_dir>/<mode>/error_rank<r>.txt``.
Where it raised alike on every rank (or only in rank 0's comparison) the other modes still run;
where some ranks raised, a rank died or the gather failed, the run stops within seconds and the
report names each rank's error and the modes not run (``verify.run.failstop``).

After each mode, once every rank has sent its results, every rank closes the mode's
``DedicatedParams`` and destroys the process groups the mode created (``verify.run.groups``),
whether it passed or raised: on NCCL each group holds a communicator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dmuon
from dmuon.ownership.select import assign_params
from tracer.backends import report_backend
from tracer.crosscheck import crosscheck, profile_for
from tracer.events import write_parquet
from tracer.fr.parse import (
    ENV_BUFFER_SIZE,
    ENV_BUFFER_SIZE_LEGACY,
    dump_flight_recorder,
    flight_recorder_enabled,
    fr_window,
    read_flight_recorder,
)
from tracer.interposer import Interposer
from tracer.kineto_log import QuietProfile
from tracer.nvml import NvlinkSampler
from tracer.profiler import profiler_source_events, read_profiler_trace
from tracer.timeline import write_chrome_trace

from verify.measure.block_order import BlockOrderRecorder, bare_model, blocks_of
from verify.compare import compare_run
from verify.measure.compute_spans import BlockCompute
from verify.workload.data import ByteCorpus, global_batch_size
from verify.workload.model import GPTConfig
from verify.modes.build import build
from verify.modes.workloads import workload_of
from verify.run.groups import ModeScope
from verify.run.failstop import COLLECT_S, Board, stopped_failures, stopped_report
from verify.run.nodes import node_traffic, own_chunks
from verify.sources.nccl_source import WindowMark, capture_active, nccl_source_report
from verify.sources.nvlink import nvlink_report
from verify.sources.steps import evicted_steps, split_steps, step_completeness
from verify.report.checks import failures_of_runs, run_checks
from verify.report.render import load_plots
from verify.measure.figures import add_figures, interposer_source, params_report
from verify.measure.memory_meter import MemoryMeter
from verify.measure import numerics, resume
from verify.measure.steptime import StepTime, sample
from verify.measure.qk_clip import (clipped_heads, not_run_entry as qk_clip_not_run,
                                    run_entry as qk_clip_run_entry)
from verify.traffic.formulas import MODES
from verify.traffic.memory import memory_report
from verify.workload.usermodel import (
    BUILTIN,
    ModelSource,
    check_loss,
    resolve,
    validate_source,
)


@dataclass(frozen=True)
class RunConfig:
    """What ``verify-traffic`` runs (defaults: the embedded CPU job).

    Attributes:
        modes: modes to run, in order; HSDP modes are skipped where W is not even and >= 4.
        steps_warmup: steps before measuring (lazy init, DDP's bucket rebuild).
        steps_measured: steady-state steps recorded by the interposer.
        batch_per_rank: sequences per rank per step; the global batch is W times it, so any
            world size runs (``verify.workload.data.global_batch_size``).
        global_batch: sequences per step over all ranks, overriding ``batch_per_rank``; must
            be a multiple of W (checked before training starts).
        seq_len: tokens per sequence.
        d_model, n_layers, n_heads: the TinyGPT size.
        model: ``--model``: ``tinygpt`` (built in), a preset, or ``pkg.module:factory``
            (``verify.workload.usermodel``).
        seed: model init and data order.
        out_dir: where traces and reports go.
        device: "cpu" (gloo) or "cuda" (NCCL).
        profiler: record the measured steps with ``torch.profiler`` too (CPU activities,
            shapes), a third source matched one to one against the interposer.
        mixed_precision: ``None`` or a key of ``verify.modes.build.MIXED_PRECISION`` (``"bf16"``).
        coalesce: DMuon's ``dedicate_params(coalesce=...)``: ``"auto"``, ``"block"`` or ``"all"``.
        rest: DMuon's ``dedicate_params(rest=...)``: ``"wrapper"`` (DDP / FSDP2 handle the
            non-dedicated params) or ``"replicate"`` (DMuon does; the DMuon modes wrap nothing;
            ``verify.modes.build.build``). Not with ``tp`` > 1.
        hierarchy: DMuon's ``dedicate_params(hierarchy=...)``: ``"auto"``, ``"hierarchical"`` or
            ``"flat"``; matters on the HSDP modes only (docs/traffic-model.md, "HSDP: flat or
            hierarchical"). Not ``"flat"`` with ``tp`` > 1.
        tp: tensor-parallel degree T; > 1 runs the TP-capable modes on a (W/T) × T mesh
            (``verify.modes.tp``; built-in model only).
        ep: expert-parallel degree E; > 1 runs the DMuon modes on an (W/E) × E mesh with the
            reference EP layer's tiny Qwen3-MoE (``verify.modes.ep``; ``rest="replicate"``).
        qk_clip_tau: ``--qk-clip``'s τ, or ``None``: the DMuon modes run MuonClip's QK-clip
            and their prediction has its ``qk_clip`` all_reduce (``verify.measure.qk_clip``;
            built-in model, not with ``tp`` > 1).
        pp: pipeline stages S; > 1 runs the PP-capable modes on an S × (W/S) mesh, the built-in
            model cut into S stage modules run by ``Schedule1F1B`` (``verify.modes.pp``).
        microbatches: the schedule's micro-batches per step (with ``pp`` > 1).
        cp: context-parallel degree C; > 1 runs the CP-capable modes on a (W/C) × C mesh, the
            reference CP decoder, both dims DMuon's shard dims (``verify.modes.cp``).
        numerics: after each mode's window, step P against the single-process oracle and a
            DCP round trip (``verify.measure.numerics``, ``verify.measure.resume``; checks
            ``numerics``, ``owner_grads``, ``checkpoint``); ``--no-numerics`` turns it off.
    """

    modes: tuple[str, ...] = MODES
    steps_warmup: int = 4
    steps_measured: int = 2
    batch_per_rank: int = 2
    global_batch: int | None = None
    seq_len: int = GPTConfig.seq_len
    d_model: int = GPTConfig.d_model
    n_layers: int = GPTConfig.n_layers
    n_heads: int = GPTConfig.n_heads
    seed: int = 0
    out_dir: str = "traces/latest"
    device: str = "cpu"
    profiler: bool = True
    model: str = "tinygpt"
    mixed_precision: str | None = None
    coalesce: str = "auto"
    rest: str = "wrapper"
    hierarchy: str = "auto"
    tp: int = 1
    qk_clip_tau: float | None = None
    ep: int = 1
    pp: int = 1
    microbatches: int = 4
    cp: int = 1
    numerics: bool = True


def runnable_modes(config: RunConfig, world_size: int) -> list[str]:
    """The modes of ``config`` this world size can run under its workload
    (``verify.modes.workload``)."""
    skipped = workload_of(config).skip_reasons(config.modes, world_size, config)
    return [m for m in config.modes if m not in skipped]


def loss_step(model: torch.nn.Module, optimizer, loss_fn, rank: int, step: int) -> float:
    """One training step of a ``--model`` source (``verify.workload.usermodel``) with DMuon's phase
    tags: ``loss_fn(model, rank, step)`` (phase ``forward``), backward (``backward``),
    ``optimizer.step()``, ``zero_grad()``. Returns the loss (a Python float).

    Raises:
        ValueError: the loss is not a 0-dim floating tensor that requires grad.
    """
    with dmuon.phase("forward"):
        loss = check_loss(loss_fn(model, rank, step), "loss_fn")
    with dmuon.phase("backward"):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


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
    step: the interposer, ``torch.profiler`` (CPU activities with shapes; its Chrome trace goes
    to ``<mode>/profiler_rank<r>.json``), the Flight Recorder dumps, this rank's NCCL log window,
    the NVLink counters (local rank 0 samples its node), the ``dmuon.window <mode>`` NVTX
    range and the blocks' forward / backward spans (``verify.measure.compute_spans``)."""

    def __init__(self, mode: str, out: Path, device: str, model: torch.nn.Module,
                 profiler: bool = True) -> None:
        self.mode, self.out, self.device = mode, out, device
        self.rank = dist.get_rank()
        self.interposer = Interposer()
        self.compute = BlockCompute(model)
        self._fr_on = flight_recorder_enabled()
        self._nccl_on = capture_active(dist.get_backend())
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self._nvlink = NvlinkSampler() if local_rank == 0 else None
        self._stack = contextlib.ExitStack()
        self._profiler = None
        if profiler:
            from torch.profiler import ProfilerActivity, profile

            # acc_events: one cycle either way; without it torch 2.11 warns on every rank that
            # a profiler "clears events at the end of each cycle" (2.13: only on a second cycle)
            self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                                     acc_events=True)

    def open(self, drain=None) -> None:
        """Start every recorder. ``drain()`` runs after the interposer stops and before the
        profiler does (HSDP: wait for the last asynchronous replicate broadcasts, so that the
        profiler sees them run; the interposer and the spans end with the last step)."""
        self._fr_before = dump_flight_recorder(self.out / "fr_before", self.rank) if self._fr_on else None
        self._nccl = WindowMark(self.rank) if self._nccl_on else None
        if self._nvlink is not None:
            _sync(self.device)  # warm-up traffic finished before the counters start
            self._nvlink.start()
        if self._profiler is not None:
            self._stack.enter_context(QuietProfile(self._profiler))  # no USDT lines
            if drain is not None:
                self._stack.callback(drain)
        self._stack.enter_context(dmuon.annotate.window(self.mode))
        self._stack.enter_context(self.compute)
        self._stack.enter_context(self.interposer)

    def abort(self) -> None:
        """Stop every recorder after an error in the window (nothing is read or exported), so
        that the interposer and the profiler do not outlive the mode."""
        with contextlib.suppress(Exception):
            self._stack.close()

    def close(self, marks_ns: list[int] | None = None, steps_warmup: int = 0) -> dict:
        """``{"fr_events", "fr_steps", "profiler_events", "nccl", "nvlink"}``: what the other
        recorders saw (``None`` where off). ``marks_ns``: every step's start on the system clock
        and the last step's end (``time.time_ns()``); with them ``fr_steps`` holds the Flight
        Recorder's steps before the window (:func:`_fr_steps`)."""
        self._stack.close()
        profiler_events = None
        if self._profiler is not None:
            path = self.out / f"profiler_rank{self.rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(path))
            profiler_events = read_profiler_trace(path, rank=self.rank).events
        nccl = self._nccl.close() if self._nccl is not None else None  # only the window travels
        nvlink = None
        if self._nvlink is not None:
            _sync(self.device)
            nvlink = self._nvlink.stop()
        fr_events = fr_steps = None
        if self._fr_on:
            after = read_flight_recorder(dump_flight_recorder(self.out, self.rank))
            fr_events = fr_window(read_flight_recorder(self._fr_before).events, after.events)
            if marks_ns is not None:
                fr_steps = _fr_steps(after, fr_events, marks_ns, steps_warmup)
        return {"fr_events": fr_events, "fr_steps": fr_steps, "profiler_events": profiler_events,
                "nccl": nccl, "nvlink": nvlink}


def _fr_steps(read, window: list, marks_ns: list[int], steps_warmup: int) -> dict:
    """This rank's Flight Recorder steps before the window, for the per-step completeness
    check (``verify.sources.steps``): ``{"steps": {step: events}, "evicted": [step, ...],
    "clock_disagrees": [source_ref, ...]}``. ``evicted``: steps the ring buffer may have
    overwritten in part (its oldest kept entry is not FR's first, ``record_id`` 0).
    ``clock_disagrees``: events the step marks (system clock) and FR's seq (``fr_window``) put on
    different sides of the window's start; the check fails on any."""
    steps, _ = split_steps(read.events, marks_ns)
    refs = [ev.source_ref.rsplit("#", 1)[-1] for ev in read.events]
    ids = [int(r.split(".")[0]) for r in refs if r.split(".")[0].isdigit()]
    times = [ev.t_start_ns for ev in read.events if ev.t_start_ns is not None]
    evicted = evicted_steps(marks_ns, min(times, default=None), wrapped=bool(ids) and min(ids) > 0)
    in_window = {ev.source_ref for ev in window}
    by_time = {ev.source_ref for s, evs in steps.items() if s >= steps_warmup for ev in evs}
    return {"steps": {s: evs for s, evs in steps.items() if s < steps_warmup},
            "evicted": evicted, "clock_disagrees": sorted(in_window ^ by_time)}


def _source(config: RunConfig, corpus: ByteCorpus | None) -> ModelSource:
    batch = global_batch_size(dist.get_world_size(), per_rank=config.batch_per_rank,
                              global_batch=config.global_batch)
    own = workload_of(config).source(config, batch)  # a workload's own model (EP's)
    return own if own is not None else resolve(
        config.model, corpus=corpus, global_batch=batch, seq_len=config.seq_len, d_model=config.d_model,
        n_layers=config.n_layers, n_heads=config.n_heads, seed=config.seed)


def _train_mode(mode: str, config: RunConfig, corpus: ByteCorpus, progress,
                source: ModelSource | None = None, scope: ModeScope | None = None) -> dict:
    """Build ``mode``, train it, record the measured steps; this rank's results. ``scope``
    adopts the mode's ``DedicatedParams`` as soon as it exists (closed by the caller, after
    every rank is done, also when this raises)."""
    rank = dist.get_rank()
    source = source if source is not None else _source(config, corpus)
    made: list = []

    def make_model():
        torch.manual_seed(config.seed)
        made.append(source.factory())
        return made[-1][0]

    workload = workload_of(config)
    running = workload.start(mode, config, make_model=make_model, made=made, corpus=corpus,
                             global_batch=global_batch_size(dist.get_world_size(), per_rank=config.batch_per_rank,
                                                            global_batch=config.global_batch))
    built, loss_fn, run_step, routing = running.built, running.loss_fn, running.run_step, running.routing
    if scope is not None and built.dedicated is not None:
        scope.adopt(built.dedicated)
    model, opt = built.model, built.optimizer
    out = Path(config.out_dir) / mode
    losses, step_bounds, step_times, clipped = [], [], [], []
    window = _MeasuredWindow(mode, out, config.device, model, config.profiler)
    # DMuon numbers its buckets by the first forward's block order, and Z3 / FSDP2 re-send a
    # module that runs twice: the harness records both with its own hooks
    # (verify.measure.block_order), agreed after the loop (outside the window)
    blocks = blocks_of(built.dedicated.names) if built.dedicated is not None else ()
    recorder = BlockOrderRecorder(bare_model(model), blocks, built.layout.fsdp_modules)
    meter = None  # DMuon's bytes at every hook (verify.measure.memory_meter), 1-D / HSDP only
    if built.dedicated is not None and workload.whole_model:
        meter = MemoryMeter(bare_model(model), built.dedicated, config.device).attach(opt)
    ns_before = 0
    marks_ns = []  # every step's start, then the last one's end: system clock, as FR's
    try:
        with running.tagging:
            for step in range(config.steps_warmup + config.steps_measured):
                marks_ns.append(time.time_ns())
                if step == config.steps_warmup:
                    ns_before = opt.ns_calls
                    window.open(drain=built.dedicated.wait_pending if built.dedicated is not None else None)
                    if meter is not None:
                        meter.start()
                    if routing is not None:
                        routing.on = True
                if meter is not None and meter.on:
                    meter.step()
                before = sample()
                losses.append(loss_step(model, opt, loss_fn, rank, step) if run_step is None
                              else run_step(step))  # PP: the loss on the last stage, else None
                if routing is not None:
                    routing.check_closed()
                if built.qk_clip is not None:  # heads the clip scaled (verify.measure.qk_clip)
                    clipped.append(clipped_heads(built.qk_clip))
                if step >= config.steps_warmup:
                    after = sample()
                    step_times.append(StepTime.between(before, after))
                    step_bounds.append((before.wall_ns, after.wall_ns))  # the interposer's clock
                progress(1)
    except BaseException:
        window.abort()
        raise
    finally:
        if meter is not None:
            meter.close()
    marks_ns.append(time.time_ns())
    recorded = window.close(marks_ns, config.steps_warmup)
    ns_window = opt.ns_calls - ns_before
    layout = dataclasses.replace(built.layout, module_calls=recorder.call_counts())
    if routing is not None:  # every rank's routing of the window (a collective, after it)
        routing.close()
        layout = dataclasses.replace(layout, ep_routing=routing.gathered())
    if built.dedicated is not None:
        built.dedicated.wait_pending()
        layout = dataclasses.replace(layout, dmuon_block_order=recorder.agreed())
    after = _after_window(mode, config, built, loss_fn, make_model, lambda: made[-1][1], scope, out)
    events = window.interposer.events
    write_parquet(events, out / f"events_rank{rank}.parquet")
    if rank == 0:
        (out / "layout.json").write_text(json.dumps(layout.to_dict(), indent=1))
    return {
        "events": events,
        "spans": window.interposer.spans + window.compute.spans,
        "losses": losses,
        "step_bounds_ns": step_bounds,
        "step_times": step_times,
        **recorded,
        "ns_calls": ns_window,
        "layout": layout,
        "plan_digest": built.dedicated.plan.digest() if built.dedicated else None,
        "memory": None if meter is None else {**meter.result(),
                                              "prefetch_depth": built.dedicated.prefetch_depth},
        "qk_clip_clipped": clipped,
        **after,
    }


def _after_window(mode: str, config: RunConfig, built, loss_fn, make_model, fresh_loss_fn,
                  scope: ModeScope | None, out: Path) -> dict:
    """Outside the measured window, one more step ``P`` (= warm-up + measured steps), on every
    rank. The reference mode: its loss (``{"probe_loss"}``). A DMuon mode the numerics probe
    applies to (``verify.measure.numerics.applies``): save a DCP checkpoint, run step P recording
    what the oracle needs (``verify.measure.numerics.probe_step``), then build the mode afresh, load
    the checkpoint, run step P again and list what is not bit-identical
    (``{"numerics", "checkpoint": {"step", "differ", "compared"}}``; ``verify.measure.resume``).
    Other modes: ``{}``."""
    step = config.steps_warmup + config.steps_measured
    if not config.numerics:
        return {}
    if mode == numerics.REFERENCE_MODE and workload_of(config).whole_model:
        return {"probe_loss": loss_step(built.model, built.optimizer, loss_fn, dist.get_rank(), step)}
    if numerics.applies(config, mode) is not None:
        return {}
    path = out / "checkpoint"
    resume.save(built.model, built.optimizer, path)
    probe = numerics.probe_step(built.model, built.optimizer, built.dedicated, loss_fn, step)
    expected = resume.snapshot(built.model, built.optimizer, built.dedicated)
    built.dedicated.wait_pending()
    fresh = build(mode, make_model, config.device, config.mixed_precision, config.coalesce,
                  config.rest, config.hierarchy, qk_clip_tau=config.qk_clip_tau)
    if scope is not None:
        scope.adopt(fresh.dedicated)
    if isinstance(fresh.model, torch.nn.parallel.DistributedDataParallel):
        # DDP reduces its first backward in the params' order and later ones in the order
        # recorded then (its bucket rebuild): over gloo's ring at W > 2 that rounds the rest's
        # grads differently. One backward without a step (the load overwrites what it leaves)
        # puts the fresh DDP where the uninterrupted one is.
        resume.warm_up(fresh.model, fresh.optimizer, fresh_loss_fn(), step)
    resume.load(fresh.model, fresh.optimizer, path)
    again = numerics.probe_step(fresh.model, fresh.optimizer, fresh.dedicated, fresh_loss_fn(), step,
                                capture=False)
    fresh.dedicated.wait_pending()
    differ = resume.differing(resume.snapshot(fresh.model, fresh.optimizer, fresh.dedicated), expected)
    if scope is None:  # nobody else releases the fresh mode's groups
        fresh.dedicated.close()
    if again["loss"] != probe["loss"]:
        differ.insert(0, f"loss of step {step}")
    return {"numerics": probe, "checkpoint": {"step": step, "differ": differ, "compared": len(expected)}}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


#: Characters of an exception message kept in a failure's detail (the traceback file has all).
MAX_ERROR_CHARS = 400


def _error_text(exc: BaseException) -> str:
    """``Type: message`` on one line, at most :data:`MAX_ERROR_CHARS` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def _record_error(config: RunConfig, mode: str, exc: BaseException) -> dict:
    """This rank's traceback to ``<out_dir>/<mode>/error_rank<r>.txt``; returns
    ``{"error": one-line text, "file": path relative to out_dir, or why it was not written}``."""
    name = f"{mode}/error_rank{dist.get_rank()}.txt"
    path = Path(config.out_dir) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exc)))
    except OSError as why:  # the error is still reported; only its traceback is lost
        name = f"not written: {why}"
    return {"error": _error_text(exc), "file": name}


def _error_failure(mode: str, errors: dict[int, dict], where: str) -> dict:
    """report.json ``failures`` entry of a mode that raised on ``errors``' ranks."""
    first = min(errors)
    return {"mode": mode, "check": "error",
            "detail": f"{where} raised on rank(s) {sorted(errors)}: {errors[first]['error']} "
                      f"(traceback: {errors[first]['file']})"}


def run_all(config: RunConfig, progress=None, board: Board | None = None,
            nodes: dict | None = None) -> dict | None:
    """Run every mode; returns the report dict on the reporting rank (rank 0; where the run
    stopped and rank 0 is gone, the surviving rank that claimed it) and ``None`` elsewhere.

    ``progress(n)`` is called after every training step on rank 0 (e.g. ``tqdm.update``).
    A mode that raises alike on every rank becomes an ``error`` failure of the report (module
    docstring) and the next modes run. A mode that fails on some ranks only, a rank that dies,
    or a failed gather stops the run (``verify.run.failstop``, through ``board``, default: a
    new one on the default store): ``board.stopped`` then says where, the report (rank 0) has
    ``stopped`` and an ``error`` failure naming each rank's error and every mode not run, and
    the caller must end the process without another collective (``failstop.exit_now``).
    ``nodes`` (``verify.run.nodes.node_map``) over more than one node adds each run's bytes
    per node and between nodes (``run["nodes"]``, ``verify.run.nodes.node_traffic``).

    Raises:
        ValueError: ``--model`` breaks the protocol (``validate_source``), or no mode of
            ``config.modes`` runs at this world size; alike on every rank, before training.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = runnable_modes(config, world)
    if not modes:
        reasons = "; ".join(f"{m}: {why}" for m, why in _skipped(config, world).items())
        raise ValueError(f"Invalid --modes for W={world}: no mode can run ({reasons}).")
    source = _source(config, None)
    validate_source(source, config.seed)  # on every rank, before any training collective
    tick = progress if (progress is not None and rank == 0) else (lambda n: None)
    board = board if board is not None else Board()
    if nodes is not None and nodes["count"] > 1 and config.numerics:
        # the DCP round trip reads one checkpoint folder on every rank: nodes may share none
        config = dataclasses.replace(config, numerics=False)
    runs: list[dict] = []
    layouts: dict = {}  # rank 0: mode -> its RunLayout (the loss checks' Muon targets)
    errors: list[dict] = []
    reporter = rank == 0  # where the run stops: the rank that claimed the report
    for i, mode in enumerate(modes):
        board.stopped = board.broken(mode) if board.run_broken() else None
        if board.stopped is None:
            scope = ModeScope()  # this mode's groups and DMuon hooks, released after the gather
            try:
                mine = _train_mode(mode, config, None, tick, source, scope)
            except Exception as exc:  # a failed mode; the next run if every rank raised alike
                mine = _record_error(config, mode, exc)
            board.stopped = board.settle(mode, mine)  # verify.run.failstop, steps 1-3
        if board.stopped is None:
            gathered: list = [None] * world if rank == 0 else None
            try:
                dist.gather_object(mine, gathered, dst=0)
            except Exception as exc:  # a peer left or died: no further collective is safe
                board.post(mode, _record_error(config, mode, exc))
                board.stopped = board.broken(mode)
        if board.stopped is not None:
            reporter = board.claim_report()  # rank 0, or a survivor where rank 0 is gone
            if reporter:
                board.stopped = board.broken(mode, collect_s=COLLECT_S)
                errors += stopped_failures(board.stopped, modes[i + 1:], world)
                if rank != 0:  # the earlier modes' results were gathered to rank 0
                    errors += [{"mode": m, "check": "error",
                                "detail": f"ran, but its results were gathered to rank 0, which "
                                          f"stopped before writing the report (rank {rank} "
                                          "wrote it)"} for m in modes[:i]]
            break  # the caller ends the process: its groups cannot be used again
        # every rank is past the mode's collectives: free its communicators before the next
        # mode builds its own (on NCCL 0.5-1.6 GB each; verify.run.groups)
        unreleased = scope.close()
        if unreleased:
            print(f"verify-traffic: rank {rank}, {mode}: not released: " + "; ".join(unreleased),
                  file=sys.stderr, flush=True)
        if rank != 0:
            continue
        if unreleased:
            errors.append({"mode": mode, "check": "error",
                           "detail": "releasing the mode's groups failed on rank 0: "
                                     + "; ".join(unreleased)})
        raised = {r: g for r, g in enumerate(gathered) if "error" in g}
        if raised:
            errors.append(_error_failure(mode, raised, "training"))
            continue
        try:
            runs.append(_assemble_run(mode, config, source, gathered))
            layouts[mode] = gathered[0]["layout"]
            if nodes is not None and nodes["count"] > 1:
                runs[-1]["nodes"] = node_traffic(
                    [ev for r in gathered for ev in r["events"]], nodes["of_rank"],
                    config.steps_measured, own_chunks(gathered[0]["layout"]), nodes["hosts"])
        except Exception as exc:
            errors.append(_error_failure(mode, {0: _record_error(config, mode, exc)},
                                         "comparing (rank 0)"))
    if rank != 0 and not reporter:
        return None
    try:  # every probed mode's losses against the reference's (verify.measure.numerics)
        _loss_checks(runs, config, source, world, layouts)
    except Exception as exc:
        errors.append(_error_failure("numerics", {0: _record_error(config, "numerics", exc)},
                                     "comparing the losses (rank 0)"))
    failures = failures_of_runs(runs) + errors
    report = {
        "pass": not failures,
        "torch_version": torch.__version__,
        "backend": report_backend(dist.get_backend()),
        "world_size": world,
        "steps_warmup": config.steps_warmup,
        "steps_measured": config.steps_measured,
        "config": report_config(config),
        "model": source.name,
        "params": _params(source, config.seed),
        "skipped": [{"mode": m, "reason": why} for m, why in _skipped(config, world).items()],
        "runs": runs,
        "failures": failures,
    }
    if board.stopped is not None:
        report["stopped"] = stopped_report(board.stopped, modes[modes.index(board.stopped.mode) + 1:])
    return report


def _loss_checks(runs: list[dict], config: RunConfig, source: ModelSource, world: int,
                 layouts: dict) -> None:
    """Rank 0: ``numerics["losses"]`` of every probed run (``verify.measure.numerics.add_loss_checks``,
    on the Muon targets of the default selection), then its checks and ``pass`` again."""
    from verify.modes.build import ADAMW_LR, MUON_LR, muon_names

    torch.manual_seed(config.seed)
    targets = muon_names(source.factory()[0])
    numerics.add_loss_checks(runs, source, config, world, layouts, targets=targets,
                             muon_lr=MUON_LR, adamw_lr=ADAMW_LR)
    for run in runs:
        if run.get("numerics") is not None:
            run["checks"] = run_checks(run)
            run["pass"] = all(c["pass"] for c in run["checks"])


def _skipped(config: RunConfig, world: int) -> dict[str, str]:
    """``{mode: reason}`` of the modes of ``config`` that did not run at W = ``world``."""
    return workload_of(config).skip_reasons(config.modes, world, config)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _assemble_run(mode: str, config: RunConfig, source: ModelSource, gathered: list[dict]) -> dict:
    """Rank 0: the report entry of ``mode`` from every rank's results (compare with the
    prediction, cross-check the sources, figures, timeline), its ``checks`` and ``pass``."""
    world = len(gathered)
    events = [ev for r in gathered for ev in r["events"]]
    run = compare_run(
        gathered[0]["layout"],
        events,
        steps=config.steps_measured,
        ns_calls=sum(r["ns_calls"] for r in gathered),
        ns_calls_per_rank=[r["ns_calls"] for r in gathered],  # the ns_balance check
    )
    # every rank's loss of each step (PP: the last stage's ranks hold it, the others None)
    held = [[r["losses"][i] for r in gathered if r["losses"][i] is not None]
            for i in range(len(gathered[0]["losses"]))]
    losses = [sum(v) / len(v) for v in held]
    run["loss_first"], run["loss_last"] = _finite(losses[0]), _finite(losses[-1])
    probe_losses = [r["probe_loss"] for r in gathered if "probe_loss" in r]
    if gathered[0].get("numerics") is not None:
        probe_losses = [r["numerics"]["loss"] for r in gathered]
    # every step's loss, mean over ranks (and step P's where it ran: verify.measure.numerics)
    run["losses"] = [x if math.isfinite(x) else None
                     for x in losses + ([sum(probe_losses) / world] if probe_losses else [])]
    if gathered[0].get("numerics") is not None:  # the oracle's step P (verify.measure.numerics)
        from verify.modes.build import ADAMW_LR, MUON_LR

        run["numerics"] = numerics.run_entry(gathered, source, config, gathered[0]["layout"],
                                             muon_lr=MUON_LR, adamw_lr=ADAMW_LR)
        run["checkpoint"] = numerics.checkpoint_entry(gathered)
        shutil.rmtree(Path(config.out_dir) / mode / "checkpoint", ignore_errors=True)
    run["loss_falls"] = math.isfinite(losses[0]) and math.isfinite(losses[-1]) and losses[-1] < losses[0]
    digests = {r["plan_digest"] for r in gathered}
    run["plan_digest"] = digests.pop() if len(digests) == 1 else sorted(map(str, digests))
    run["sources"] = _sources(run, events, gathered, config.steps_measured)
    run["replicate_overlap"] = _replicate_overlap(gathered)
    run["nvlink"] = nvlink_report([r["nvlink"] for r in gathered if r["nvlink"] is not None], events)
    add_figures(run, gathered[0]["layout"], events, config.steps_measured,
                [r["step_times"] for r in gathered], config.device)
    per_rank = {i: (r["events"], r["spans"]) for i, r in enumerate(gathered)}
    timeline = Path(config.out_dir) / mode / "timeline.json"
    write_chrome_trace(timeline, per_rank, name=mode)
    run["timeline"] = str(timeline.relative_to(config.out_dir))
    if mode.startswith("dmuon-"):
        # one host, one perf_counter clock: the last measured step from its first start
        # to its last end over all ranks (window close and dumps come after it)
        last = [r["step_bounds_ns"][-1] for r in gathered]
        title = f"{mode} ({source.name}, W={world}, {dist.get_backend()}): last measured step"
        plots = load_plots()  # None without matplotlib: every file but the PNGs
        if plots is not None:
            plots.plot_timeline(timeline.with_suffix(".png"), per_rank, title=title,
                                t0_ns=min(a for a, _ in last), t1_ns=max(b for _, b in last))
    if config.qk_clip_tau is not None:  # --qk-clip: the phase's bytes, or n/a and why
        layout = gathered[0]["layout"]
        run["qk_clip"] = (qk_clip_run_entry(layout, events, config.steps_measured, config.qk_clip_tau,
                                            gathered[0]["qk_clip_clipped"])
                          if layout.qk_clip_heads else qk_clip_not_run(config.qk_clip_tau))
    if all(r.get("memory") is not None for r in gathered):  # DMuon's bytes vs the bound
        run["memory"] = memory_report(gathered[0]["layout"], [r["memory"] for r in gathered])
    run["checks"] = run_checks(run)
    run["pass"] = all(c["pass"] for c in run["checks"])
    return run
#: RunConfig fields that size the built-in TinyGPT (``--model tinygpt`` only) and those that
#: shape the byte-corpus batches (the built-in model and the presets; a factory's loss_fn
#: makes its own batches).
BUILTIN_FIELDS = ("d_model", "n_layers", "n_heads")
CORPUS_FIELDS = ("seq_len", "batch_per_rank", "global_batch")


def report_config(config: RunConfig) -> dict:
    """report.json ``config``: the RunConfig without the fields the model does not use (no
    TinyGPT size for a preset or a factory; no corpus batch shape for a factory)."""
    out = asdict(config)
    drop = () if config.model == BUILTIN else BUILTIN_FIELDS
    if config.model != BUILTIN and ":" in config.model:
        drop += CORPUS_FIELDS
    return {k: v for k, v in out.items() if k not in drop}


def _params(source: ModelSource, seed: int) -> dict:
    """report.json ``params``: DMuon's default split of a fresh model (local, no collective)."""
    torch.manual_seed(seed)
    model = source.factory()[0]
    return params_report(assign_params(model))


def _sources(run: dict, events: list, gathered: list[dict], steps: int) -> dict:
    """report.json ``sources``: the interposer against the prediction, the others against it."""
    sources = {"interposer": interposer_source(run, len(events))}
    if all(r["fr_events"] is not None for r in gathered):
        fr = [ev for r in gathered for ev in r["fr_events"]]
        check = crosscheck(events, fr, source="flight_recorder", backend=report_backend(dist.get_backend()))
        sources["flight_recorder"] = {**check.as_report(), "mismatches": [str(m) for m in check.mismatches[:20]]}
        if all(r.get("fr_steps") is not None for r in gathered):
            _fr_step_check(sources["flight_recorder"], gathered, steps,
                           report_backend(dist.get_backend()))
    if all(r.get("profiler_events") is not None for r in gathered):
        ref, prof, note = profiler_source_events(events, [ev for r in gathered for ev in r["profiler_events"]])
        check = crosscheck(ref, prof, source="profiler", backend=report_backend(dist.get_backend()))
        sources["profiler"] = {**check.as_report(), "mismatches": [str(m) for m in check.mismatches[:20]],
                               "notes": ([note] if note else []) + check.notes}
    if any(r["nccl"] is not None for r in gathered):
        sources["nccl_log"] = nccl_source_report(
            [r["nccl"] for r in gathered if r["nccl"] is not None], events, gathered[0]["layout"], steps)
    recorded = {"flight_recorder": [ev for r in gathered for ev in (r["fr_events"] or ())],
                "profiler": [ev for r in gathered for ev in (r.get("profiler_events") or ())]}
    for name, src in sources.items():
        if name in recorded:
            _op_kinds(src, recorded[name], run.get("predicted_ops") or {},
                      profile_for(name, report_backend(dist.get_backend())))
    return sources


def _fr_step_check(src: dict, gathered: list[dict], steps: int, backend: str) -> None:
    """The Flight Recorder's steps before the window, each against one step's prediction
    (:func:`verify.sources.steps.step_completeness`): ``src["steps"]`` = ``{"checked",
    "not_recorded", "incomplete"}``; a step missing a predicted call, or an event the step marks
    and FR's seq place on different sides of the window's start, fails the source, named in
    ``mismatches`` after the window's own. A step the ring buffer overwrote on any rank is
    listed in ``not_recorded`` and asked of no rank."""
    by_step: dict[int, list] = {}
    evicted, clock = set(), []
    for r in gathered:
        for s, evs in r["fr_steps"]["steps"].items():
            by_step.setdefault(s, []).extend(evs)
        evicted.update(r["fr_steps"]["evicted"])
        clock += r["fr_steps"]["clock_disagrees"]
    size = os.environ.get(ENV_BUFFER_SIZE, os.environ.get(ENV_BUFFER_SIZE_LEGACY, "torch's default"))
    not_recorded = {s: f"partly overwritten in FR's ring buffer ({ENV_BUFFER_SIZE}={size} entries)"
                    for s in evicted}
    layout = gathered[0]["layout"]
    result = step_completeness(layout, by_step, source="flight_recorder", window_steps=steps,
                               profile=profile_for("flight_recorder", backend),
                               not_recorded=not_recorded)
    lines = result["lines"]
    if clock:
        lines.append(f"{len(clock)} event(s) that FR's seq and the step marks (system clock) put "
                     f"on different sides of the window's start (first: {clock[0]}); the steps "
                     "before the window cannot be told apart")
    src["steps"] = {"checked": result["steps_checked"], "not_recorded": result["steps_not_recorded"],
                    "incomplete": len(result["incomplete"]) + len(clock)}
    if lines:
        src["pass"] = False
        src["mismatches"] = (src["mismatches"] + lines)[:20] if src["mismatches"] else lines[:20]


def _op_kinds(src: dict, source_events: list, predicted_ops: dict, profile) -> None:
    """A source's ``op_counts`` (its own events per op over the window) and ``ops_missing``:
    the op kinds the prediction has that it recorded none of, each as the source records it
    (``profile``: ``tracer.crosscheck.SourceProfile``, e.g. gloo's Flight Recorder writes a
    reduce_scatter as an all_reduce; an op it never records is not asked for); any fails the
    source's check (a source that lost every event of a kind cannot pass)."""
    counts = Counter(ev.op for ev in source_events)
    src["op_counts"] = dict(sorted(counts.items()))
    missing = []
    for op in predicted_ops:
        eq = profile.equivalence_for(op)
        recorded_as = eq.other_op if eq is not None else op
        if op not in profile.unobserved_ops and not counts.get(recorded_as):
            missing.append(op if recorded_as == op else f"{op} (recorded as {recorded_as})")
    src["ops_missing"] = missing
    if missing:
        src["pass"] = False


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
