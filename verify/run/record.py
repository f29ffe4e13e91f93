"""Phase D inside your own training script: record a window of steps and assert the exact match.

::

    from verify.run.record import TrafficWindow

    window = TrafficWindow(model, dm, optimizer, out_dir="traces/my-job")
    for step, batch in enumerate(loader):
        if step == 5:
            window.start()                       # after warm-up (lazy init, DDP's bucket rebuild)
        with dmuon.phase("forward"):
            loss = loss_fn(model(batch))
        with dmuon.phase("backward"):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if window.recording:
            window.step_done(loss)
        if step == 6:
            window.finish()                      # raises TrafficMismatch on every rank on a mismatch

or, around the measured steps only, ``with TrafficWindow(...) as window: ... window.step_done()``.

What is checked: the collectives every rank issued in the window (the interposer,
``tracer.interposer``), one to one against the prediction for *this* job
(``verify.traffic.predict.predict_step`` on a :class:`~verify.traffic.predict.RunLayout` read from the live
objects: the model's parameter shapes, ``dm``'s dedicated params, mesh and Z2/Z3 flag, and the
wrapping: ``DistributedDataParallel`` and its bucket cap, or the modules wrapped with
``fully_shard`` and whether each reshards after forward, or none under
``dedicate_params(rest="replicate")``), the W-average against the closed
form, Newton–Schulz calls, and DMuon's memory: each rank's peak bytes of dedicated params and
grad buffers in forward, backward and between steps, read by the harness's own hooks
(``verify.measure.memory_meter``, attached at :meth:`TrafficWindow.start`, removed at
:meth:`TrafficWindow.finish`) against the bound from the plan (``verify.traffic.memory``;
check ``memory``, docs/verify.md "Memory"). Rank 0 writes ``report.json``, ``report.md`` and
``traffic.png`` to ``out_dir`` (``verify.report.render``), the same files as ``make verify-traffic``.

Create the window before the first training step: it records the order in which DMuon's
blocks first run in the first forward it sees (``verify.measure.block_order``; DMuon numbers its
buckets by the first step's order, ``docs/protocol.md`` step 7), which the layout reports as
``dmuon_block_order``. Start it after at least one step: the first step has setup calls (DDP's
bucket rebuild, DMuon's block-order agreement) that the prediction of a steady step omits.

Requirements: every rank runs the same steps; the forward (with the loss) runs under
``dmuon.phase("forward")`` and backward under ``dmuon.phase("backward")`` (DMuon tags its own
collectives; DDP's and FSDP2's take the phase of the code that triggers them). A collective
without a phase fails the check with a message saying so.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.ownership.plan import specs_from_named_parameters
from tracer.backends import device_type, report_backend
from tracer.interposer import Interposer

from verify.measure.block_order import BlockOrderRecorder, bare_model, blocks_of
from verify.compare import compare_run
from verify.report.checks import failures_of_runs, final_line, run_checks
from verify.traffic.predict import (DMUON_HIERARCHIES, RunLayout, dmuon_flattens, dmuon_policy_backend,
                                    dmuon_uneven_aligned)
from verify.measure.figures import add_figures, interposer_source, params_report
from verify.measure.memory_meter import MemoryMeter
from verify.traffic.memory import memory_report
from verify.measure.steptime import StepTime, sample


class TrafficMismatch(AssertionError):
    """The measured collectives differ from the prediction (raised on every rank)."""


def _backend(dedicated: dmuon.DedicatedParams) -> str:
    """The backend DMuon's collectives run on, by its params' device (CUDA: NCCL, else gloo)."""
    first = next(iter(dedicated), None)
    return "nccl" if first is not None and first.device.type == "cuda" else "gloo"


def layout_from_job(model: nn.Module, dedicated: dmuon.DedicatedParams,
                    block_order: tuple[str, ...] = ()) -> RunLayout:
    """The :class:`RunLayout` of a live job (call after the first step: FSDP2 initialises
    lazily). See the module docstring for what is read; ``block_order`` is the harness's
    record of the blocks' execution order (``RunLayout.dmuon_block_order``, ``()``: model
    order).

    Mixed precision: ``dedicated.mp_policy``'s ``param_dtype`` / ``reduce_dtype`` (torch names),
    the one policy the predictor models for DMuon and FSDP2 alike.

    HSDP hierarchy: ``dedicated.hierarchy``, the value given to ``dedicate_params`` (not what the
    runtime resolved it to), and the harness's own backend table entry
    (:func:`verify.traffic.predict.dmuon_flattens`); the predictor derives flat or hierarchical
    from them (:func:`verify.traffic.predict.dmuon_hierarchy`).

    Raises:
        ValueError: ``dedicated`` is not a ``DedicatedParams`` or its ``hierarchy`` is not one of
            :data:`verify.traffic.predict.DMUON_HIERARCHIES`, the wrapping is neither DDP nor
            FSDP2 (under ``rest="wrapper"``), a non-root FSDP2 group's
            ``reshard_after_forward`` differs from DMuon's, or an FSDP2 group's mixed-precision
            ``param_dtype`` / ``reduce_dtype`` differ from DMuon's.
    """
    if not isinstance(dedicated, dmuon.DedicatedParams):
        raise ValueError(f"Invalid dedicated={type(dedicated).__name__}. Must be the "
                         "DedicatedParams returned by dmuon.dedicate_params.")
    topo = dedicated.topology
    z3 = getattr(dedicated, "reshard_after_forward", None)
    if not isinstance(z3, bool):
        raise ValueError(f"Invalid dedicated: reshard_after_forward={z3!r}. Must be the bool "
                         "given to dmuon.dedicate_params (Z3: True, Z2: False).")
    hierarchy = getattr(dedicated, "hierarchy", None)
    if hierarchy not in DMUON_HIERARCHIES:
        raise ValueError(f"Invalid dedicated: hierarchy={hierarchy!r}. Must be the value given to "
                         f"dmuon.dedicate_params, one of {DMUON_HIERARCHIES}.")
    # Muon's matrix shape of each dedicated param, as DMuon planned it (the plan's specs)
    matrices = {sp.name: sp.matrix_shape for sp in dedicated.plan.specs}
    mp = _mp_dtypes(dedicated.mp_policy)
    # the harness's own tables, by the backend whose link policy DMuon follows (link=...)
    backend = dmuon_policy_backend(getattr(dedicated, "link", "auto"), _backend(dedicated))
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    common = dict(replicate_size=topo.replicate_size, shard_size=topo.shard_size,
                  frozen_names=tuple(n for n, p in bare.named_parameters() if not p.requires_grad),
                  muon_names=tuple(dedicated.names),
                  dmuon_bucket_cap_bytes=int(dedicated.bucket_cap_bytes),
                  dmuon_coalesce_bytes=int(dedicated.coalesce_bytes),
                  dmuon_reduce_by_gather=bool(dedicated.reduce_by_gather),
                  # the harness's own table, by the backend the params' device (or link=...)
                  # selects (uneven groups reduce by all_to_all: only where DMuon reduces by gather)
                  dmuon_uneven_aligned=bool(dedicated.reduce_by_gather)
                  and dmuon_uneven_aligned(backend),
                  dmuon_block_order=tuple(block_order), mp_param_dtype=mp[0], mp_reduce_dtype=mp[1],
                  dmuon_hierarchy=hierarchy, dmuon_auto_flat=dmuon_flattens(backend))
    hsdp = topo.replicate_size > 1
    mode = f"dmuon-{'hsdp-' if hsdp else ''}{'z3' if z3 else 'z2'}"
    if dedicated.rest == "replicate":  # DMuon keeps the rest: no wrapper
        specs = tuple(specs_from_named_parameters(bare.named_parameters(), matrices))
        return RunLayout(mode=mode, params=specs, reshard_after_forward=z3, dmuon_rest="replicate",
                         **common)
    if isinstance(model, DistributedDataParallel):
        if topo.replicate_size != 1:
            raise ValueError("Invalid wrapping: DistributedDataParallel with a 2-D DMuon mesh. "
                             "Must be a 1-D mesh (HSDP uses fully_shard).")
        specs = tuple(specs_from_named_parameters(model.module.named_parameters(), matrices))
        buffers = tuple((str(b.dtype).removeprefix("torch."), b.numel())
                        for b in model.modules_buffers) if model.will_sync_module_buffers() else ()
        return RunLayout(mode="dmuon-ddp", params=specs, reshard_after_forward=z3,
                         ddp_buffers=buffers,
                         ddp_bucket_cap_bytes=int(model.bucket_bytes_cap),
                         ddp_first_bucket_cap_bytes=_ddp_first_bucket_cap(model), **common)
    from torch.distributed.fsdp import FSDPModule

    wrapped = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not wrapped:
        raise ValueError(f"Invalid model={type(model).__name__}: neither DistributedDataParallel "
                         "nor wrapped with fully_shard. Must be the wrapped model you train.")
    # children before parents (the order fully_shard is applied in), the root last
    wrapped.sort(key=lambda nm: (-nm[0].count(".") if nm[0] else 1, 0))
    flags = {}  # module -> reshards after forward (FSDP2 internals, torch 2.13: set at lazy init)
    for name, m in wrapped:
        group = m._get_fsdp_state()._fsdp_param_group
        if group is not None:
            flags[name] = group.post_forward_mesh_info is not None
            if _mp_dtypes(group.mp_policy) != mp:
                raise ValueError(
                    f"Invalid wrapping: fully_shard of {name or '<root>'!r} has mixed precision "
                    f"(param_dtype, reduce_dtype) = {_mp_dtypes(group.mp_policy)} while "
                    f"dedicate_params has {mp}. Must give both the same MixedPrecisionPolicy "
                    "(the predictor models one policy).")
    inner = {f for name, f in flags.items() if name}
    if inner - {z3}:
        raise ValueError(f"Invalid wrapping: fully_shard groups use reshard_after_forward="
                         f"{sorted(inner)} while dedicate_params uses {z3}. Must use the same "
                         "setting everywhere (the predictor models one flag).")
    specs = tuple(specs_from_named_parameters(model.named_parameters(), matrices))
    return RunLayout(mode=mode, params=specs, fsdp_modules=tuple(n for n, _ in wrapped),
                     reshard_after_forward=z3, root_auto_reshard="" in flags and not flags[""],
                     **common)


def _mp_dtypes(policy) -> tuple[str | None, str | None]:
    """``(param_dtype, reduce_dtype)`` of a ``MixedPrecisionPolicy`` as torch names (``None``:
    unset; ``reduce_dtype`` None means ``param_dtype``, as in FSDP2)."""
    def name(dtype):
        return None if dtype is None else str(dtype).removeprefix("torch.")
    pd = name(getattr(policy, "param_dtype", None))
    return pd, name(getattr(policy, "reduce_dtype", None)) or pd


class TrafficWindow:
    """Record the collectives of a window of training steps and check them (module docstring).

    Args:
        model: the wrapped model you train (DDP or fully_shard).
        dedicated: what ``dmuon.dedicate_params`` returned.
        optimizer: the ``dmuon.DMuon`` optimizer (its ``ns_calls`` counts Newton–Schulz).
        out_dir: where rank 0 writes the report files (``None``: no files).
        run_id: the report's run id (default: ``out_dir``'s name).
        qk_clip_heads: the query heads MuonClip's QK-clip (``dmuon.optim.qk_clip.QKClip`` on
            ``optimizer``) packs into its per-step MAX all_reduce (Σ ``n_heads`` over the
            layers you gave it); 0 (default): no QK-clip.

    What the window counts itself, from construction on (never from the measured calls):
    forwards of the model with grad enabled per optimizer step (the warm-up steps must have
    one each: gradient accumulation is refused at :meth:`start`), and calls of the
    optimizer's ``clip_grad_norm_`` per recorded step (``RunLayout.grad_clips``: DMuon's
    one-element all_reduce each).

    Raises:
        ValueError: at construction, an optimizer without ``ns_calls``, a process group
            that is not initialised, a DMuon mesh that does not span every rank (tensor
            parallelism: not modelled here, ``make verify-traffic ARGS="--tp T"`` is), or
            ``qk_clip_heads`` not an int >= 0; at :meth:`start`, warm-up steps of more than
            one forward each (gradient accumulation: not modelled), a forward of the model,
            a ``model.state_dict()`` or a ``dedicated.sync_params()`` since the last step (an
            evaluation, a checkpoint, a sync: they refresh DMuon's copies, so the first
            recorded forward would not), or a DDP model that has not rebuilt its buckets yet
            (it does so once, in its second step's forward); at :meth:`finish` (on
            every rank), no step recorded, collectives without a phase tag, not one forward
            of the model per recorded step, or a different number of ``clip_grad_norm_``
            calls in different recorded steps.
        TrafficMismatch: at :meth:`finish`, on every rank, when the check fails.
        RuntimeError: at :meth:`finish`, on every rank, when rank 0 could not build or write
            the report (its error's text; the other ranks do not wait forever).
    """

    def __init__(self, model: nn.Module, dedicated: dmuon.DedicatedParams, optimizer, *,
                 out_dir: str | os.PathLike | None = None, run_id: str | None = None,
                 qk_clip_heads: int = 0) -> None:
        if isinstance(qk_clip_heads, bool) or not isinstance(qk_clip_heads, int) or qk_clip_heads < 0:
            raise ValueError(f"Invalid qk_clip_heads={qk_clip_heads!r}. Must be an int >= 0 (the "
                             "query heads QKClip watches; 0: no QK-clip).")
        if not dist.is_initialized():
            raise ValueError("Invalid call: torch.distributed is not initialised. Must create a "
                             "TrafficWindow inside the job, after init_process_group.")
        if not hasattr(optimizer, "ns_calls"):
            raise ValueError(f"Invalid optimizer={type(optimizer).__name__}: no ns_calls counter. "
                             "Must be the dmuon.DMuon optimizer.")
        dp = dedicated.topology.world_size
        if dp != dist.get_world_size():
            raise ValueError(
                f"Invalid job: DMuon's mesh spans R*N = {dp} data-parallel ranks of the "
                f"{dist.get_world_size()} (a tensor-parallel mesh). TrafficWindow predicts "
                "data-parallel jobs only; check TP traffic with make verify-traffic "
                "ARGS=\"--nproc W --tp T\" (docs/verify.md).")
        ranks = torch.tensor(dedicated.mesh_ranks if dedicated.mesh_ranks is not None else [])
        if ranks.numel() and ranks.flatten().tolist() != list(range(dist.get_world_size())):
            raise ValueError(  # the same mesh tensor on every rank: every rank raises
                f"Invalid mesh: ranks {ranks.tolist()} are not in init_device_mesh's row-major "
                "order (world rank r*N + s at coordinate (r, s)). TrafficWindow predicts DMuon's "
                "and FSDP2's groups from that layout; build the mesh with "
                "init_device_mesh(device, (W,)) or (R, N) to record this job's traffic.")
        self.model, self.dedicated, self.optimizer = model, dedicated, optimizer
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.run_id = run_id or (self.out_dir.name if self.out_dir else "traffic-window")
        self.report: dict | None = None
        self._interposer: Interposer | None = None
        self._times: list[StepTime] = []
        self._losses: list[float] = []
        self._last = None
        from torch.distributed.fsdp import FSDPModule

        units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        self._order = BlockOrderRecorder(bare_model(model), blocks_of(dedicated.names), units)
        self._forwards = 0  # forwards of the model while recording (not AC recompute)
        self._forward_hook = None
        self._meter: MemoryMeter | None = None  # DMuon's bytes at every hook while recording
        self._meter_trace: list = []  # the last complete recorded step's samples
        self.qk_clip_heads = qk_clip_heads
        # grad-enabled forwards per optimizer step from construction on (accumulation at start())
        self._step_forwards: list[int] = []
        self._since_step = 0
        self._no_grad_since_step = 0  # forwards without grad (evaluation) since the last step
        self._state_dicts_since_step = 0  # model.state_dict() calls (a checkpoint) since then
        self._state_dict_hook = bare_model(model).register_state_dict_pre_hook(self._count_state_dict)
        self._syncs_since_step = 0  # dm.sync_params() calls since then (counted, then DMuon's)
        dedicated.sync_params = self._count_sync
        self._grad_forward_hook = bare_model(model).register_forward_pre_hook(self._count_grad_forward)
        self._step_hook = optimizer.register_step_post_hook(self._count_step)
        self._clips = 0  # clip_grad_norm_ calls in the current recorded step
        self._clips_per_step: list[int] = []

    def _count_grad_forward(self, module, args) -> None:
        if torch._C._current_graph_task_id() != -1:  # a recompute inside backward
            return
        if torch.is_grad_enabled():
            self._since_step += 1
        else:
            self._no_grad_since_step += 1

    def _count_step(self, optimizer, args, kwargs) -> None:
        self._step_forwards.append(self._since_step)
        self._since_step = self._no_grad_since_step = self._state_dicts_since_step = 0
        self._syncs_since_step = 0

    def _count_state_dict(self, module, prefix, keep_vars) -> None:
        self._state_dicts_since_step += 1

    def _count_sync(self, *args, **kwargs):
        self._syncs_since_step += 1
        return type(self.dedicated).sync_params(self.dedicated, *args, **kwargs)

    def _count_clip(self, *args, **kwargs):
        self._clips += 1
        return type(self.optimizer).clip_grad_norm_(self.optimizer, *args, **kwargs)

    def _count_forward(self, module, args) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            self._forwards += 1

    @property
    def recording(self) -> bool:
        return self._interposer is not None

    def start(self) -> TrafficWindow:
        """Start recording (call between steps, after at least one warm-up step)."""
        if self._interposer is not None:
            raise ValueError("Invalid start(): already recording. Must call finish() first.")
        accumulated = sorted({n for n in self._step_forwards if n != 1})
        if accumulated:
            raise ValueError(
                f"Invalid start(): the warm-up steps ran {accumulated} forwards with grad each "
                f"(of {len(self._step_forwards)} steps). TrafficWindow predicts one forward and "
                "one backward per step; gradient accumulation (M micro-batches per step: Z3 and "
                "FSDP2 gather again at every micro-batch, reduces run at the last) is not "
                "modelled. Record a window of single-batch steps (M = 1, the same global "
                "batch per step), or check the traffic with make verify-traffic.")
        since = self._since_step + self._no_grad_since_step
        if since or self._state_dicts_since_step or self._syncs_since_step:
            raise ValueError(
                f"Invalid start(): {since} forwards of the model ({self._no_grad_since_step} "
                f"without grad: an evaluation), {self._state_dicts_since_step} "
                f"model.state_dict() calls (a checkpoint) and {self._syncs_since_step} "
                "dm.sync_params() calls ran since the last optimizer step. Each refreshes "
                "DMuon's stale copies, so the first recorded step's forward would not and its "
                "traffic would miss the prediction. Call start() right after a step, before "
                "evaluating, checkpointing or syncing (or do them after finish()).")
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.model, DistributedDataParallel) and _ddp_rebuild_ahead(self.model):
            raise ValueError(
                "Invalid start(): DDP has not rebuilt its gradient buckets yet. It does so once, "
                "in the forward after its first synchronised backward (two broadcasts from rank "
                "0), which the prediction does not model. Call start() after at least two "
                "warm-up steps.")
        self._ns_before = self.optimizer.ns_calls
        self._clips, self._clips_per_step = 0, []
        self.optimizer.clip_grad_norm_ = self._count_clip  # counted, then DMuon's own
        self._forwards = 0
        self._forward_hook = bare_model(self.model).register_forward_pre_hook(self._count_forward)
        device = "cuda" if _backend(self.dedicated) == "nccl" else "cpu"
        self._meter = MemoryMeter(bare_model(self.model), self.dedicated, device).attach(self.optimizer)
        self._meter.start()
        self._meter.step()
        self._interposer = Interposer().__enter__()
        self._last = sample()
        return self

    def step_done(self, loss) -> None:
        """Mark the end of one recorded training step whose loss was ``loss`` (float or tensor)."""
        if self._interposer is None:
            raise ValueError("Invalid step_done(): not recording. Must call start() first.")
        now = sample()
        self._losses.append(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
        self._times.append(StepTime.between(self._last, now))
        self._last = now
        self._meter_trace = self._meter.trace  # this step's samples; the next step starts
        self._meter.step()
        self._clips_per_step.append(self._clips)
        self._clips = 0

    def finish(self) -> dict | None:
        """Stop, compare on rank 0, write the report, and raise on a mismatch on every rank.

        Returns:
            The report dict on rank 0, ``None`` elsewhere (also kept as ``self.report``).
        """
        if self._interposer is None:
            raise ValueError("Invalid finish(): not recording. Must call start() first.")
        ip, self._interposer = self._interposer, None
        ip.__exit__(None, None, None)
        self._forward_hook.remove()
        self._stop_counting()
        self.dedicated.wait_pending()
        memory = self._close_meter()
        steps = len(self._times)
        untagged = sum(ev.phase is None for ev in ip.events)
        problem = None
        if steps < 1:
            problem = "no step recorded. Must call step_done() after each recorded step."
        elif untagged:
            problem = (f"{untagged} collectives without a phase tag. Must run forward and the "
                       "loss under dmuon.phase('forward') and backward under "
                       "dmuon.phase('backward').")
        elif self._forwards != steps:
            problem = (f"{self._forwards} forwards of the model in {steps} recorded steps. Must "
                       "run one forward and one backward per recorded step: the prediction "
                       "models that step (no gradient accumulation, evaluation or extra "
                       "forwards inside the window).")
        elif len(set(self._clips_per_step)) > 1:
            problem = (f"opt.clip_grad_norm_ called {self._clips_per_step} times in the recorded "
                       "steps. Must call it the same number of times in every recorded step "
                       "(the prediction has one count per step).")
        problems: list = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        bad = {r: p for r, p in enumerate(problems) if p}
        if bad:
            raise ValueError(f"Invalid TrafficWindow recording on ranks {sorted(bad)}: {next(iter(bad.values()))}")
        layout = layout_from_job(self.model, self.dedicated, self._order.agreed())
        layout = dataclasses.replace(layout, module_calls=self._order.call_counts(),
                                     qk_clip_heads=self.qk_clip_heads,
                                     grad_clips=self._clips_per_step[0])
        mine = {"events": ip.events, "times": self._times, "losses": self._losses,
                "ns_calls": self.optimizer.ns_calls - self._ns_before, "memory": memory}
        rank = dist.get_rank()
        gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        verdict: list = [None]  # rank 0's (kind, text): a mismatch, or its own error
        if rank == 0:
            try:
                self.report = self._report(layout, gathered, steps)
                summary = self._summary(self.report)
                verdict[0] = None if summary is None else ("mismatch", summary)
            except Exception as exc:  # noqa: BLE001 - sent to every rank, then raised
                verdict[0] = ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            kind, text = verdict[0]
            if kind == "mismatch":
                raise TrafficMismatch(text)
            raise RuntimeError(f"TrafficWindow: rank 0 could not build or write the report: {text}")
        return self.report

    def _report(self, layout: RunLayout, gathered: list[dict], steps: int) -> dict:
        events = [ev for r in gathered for ev in r["events"]]
        run = compare_run(layout, events, steps=steps, ns_calls=sum(r["ns_calls"] for r in gathered))
        device = device_type(dist.get_backend())  # "cpu:gloo,cuda:nccl" is NCCL too
        add_figures(run, layout, events, steps, [r["times"] for r in gathered], device)
        run["sources"] = {"interposer": interposer_source(run, len(events))}
        losses = [sum(r["losses"][i] for r in gathered) / len(gathered) for i in range(steps)]
        run.update(loss_first=losses[0] if math.isfinite(losses[0]) else None,
                   loss_last=losses[-1] if math.isfinite(losses[-1]) else None,
                   replicate_overlap=[], timeline=None)
        # DMuon's bytes against the plan's bound (check "memory")
        run["memory"] = memory_report(layout, [r["memory"] for r in gathered])
        run["checks"] = run_checks(run)  # no loss check: a window of the user's steps
        run["pass"] = all(c["pass"] for c in run["checks"])
        report = {
            "pass": bool(run["pass"]),
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__, "backend": report_backend(dist.get_backend()),
            "world_size": dist.get_world_size(), "steps_warmup": 0, "steps_measured": steps,
            "run_id": self.run_id, "model": "own script (verify.run.record.TrafficWindow)",
            "params": params_report(self.dedicated.assignments()),
            "runs": [run],
            "failures": failures_of_runs([run]),
        }
        if self.out_dir is not None:
            from verify.report.render import write_report

            write_report(report, self.out_dir)
        return report

    @staticmethod
    def _summary(report: dict) -> str | None:
        if report["pass"]:
            return None
        from verify.report.render import failure_sections

        run = report["runs"][0]
        lines = [final_line(report)]  # e.g. "FAIL: collectives differ from the prediction (dmuon-z3)"
        for title, body in failure_sections(run, "simple"):
            lines += [f"{title}:", body]
        return "\n".join(lines)

    def _close_meter(self) -> dict:
        """Stop measuring memory and remove the meter's hooks; this rank's figures
        (``MemoryMeter.result`` with the last complete recorded step's trace) and DMuon's
        ``prefetch_depth``."""
        meter, self._meter = self._meter, None
        if meter is None:
            return {}
        meter.close()
        return {**meter.result(), "trace": [list(s) for s in self._meter_trace],
                "prefetch_depth": self.dedicated.prefetch_depth}

    def __enter__(self) -> TrafficWindow:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # the step failed: stop recording, keep the original error
            if self._interposer is not None:
                self._interposer.__exit__(None, None, None)
                self._interposer = None
                self._forward_hook.remove()
                self._stop_counting()
                self._close_meter()
            return
        self.finish()

    def _stop_counting(self) -> None:
        """The optimizer's own ``clip_grad_norm_`` and DMuon's ``sync_params`` again (the
        window's counters go)."""
        self.optimizer.__dict__.pop("clip_grad_norm_", None)
        self.dedicated.__dict__.pop("sync_params", None)
        self._state_dict_hook.remove()


def _ddp_rebuild_ahead(model) -> bool:
    """Whether the live DDP object will still rebuild its buckets (torch 2.13: once, unless
    ``find_unused_parameters`` without a static graph; ``_has_rebuilt_buckets`` once done)."""
    rebuilds = bool(getattr(model, "static_graph", False)) or not model.find_unused_parameters
    return rebuilds and not getattr(model, "_has_rebuilt_buckets", True)


def _ddp_first_bucket_cap(model) -> int | None:
    """The live DDP object's first-bucket cap (torch 2.13 ``BucketCapacityConfig``), or
    ``None`` when it equals the other buckets' cap (an explicit ``bucket_cap_mb``)."""
    config = getattr(model, "_bucket_config", None)
    first = getattr(config, "first_bucket_bytes_cap", None)
    if first is None or first >= int(model.bucket_bytes_cap):
        return None
    return int(first)
