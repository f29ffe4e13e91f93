"""Rank-side tasks for the gate tests: ``run_all`` (what each rank of ``make verify-traffic``
runs) with one regression planted in the runtime (and, for the planner's own regression, in the
planner or the predictor the harness shares with it).

Every mutation patches the names the runtime resolves at call time and restores them after
the run; each fails loudly (AttributeError) if the runtime no longer has the name, so a
refactor cannot turn a mutation into a no-op silently. Six regressions (the first six names below), then
one or two in each path the default run's variants were added for (the aligned all_gather /
reduce_scatter form, the per-owner replicate axis).
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch
import torch.distributed as dist

from verify.run.runner import RunConfig, run_all

#: DMuon's default bucket_cap_mb (25) divided by 500, in MB.
SMALL_BUCKET_CAP_MB = 25 / 500
#: The changed ``coalesce="auto"`` target on gloo (bytes): one TinyGPT block (196,608 B) per
#: unit instead of the whole model in one.
CHANGED_AUTO_TARGET_BYTES = 200_000


def _rewrapped(fn, **forced):
    def call(*args, **kwargs):
        return fn(*args, **{**kwargs, **forced})
    return call


def _rewrapped_by(fn, key: str, delta: int):
    """``fn`` called with keyword ``key`` shifted by ``delta``."""
    def call(*args, **kwargs):
        return fn(*args, **{**kwargs, key: kwargs[key] + delta})
    return call


def _repeat_first(fn):
    """``fn`` issuing its collective twice per call (the first one waited, then the real one)."""
    def call(*args, async_op=False, **kwargs):
        work = fn(*args, async_op=True, **kwargs)
        if work is not None:
            work.wait()
        return fn(*args, async_op=async_op, **kwargs)
    return call


def _twice_on_channel(method, channel: str):
    """``Launcher`` method ``method`` issuing its call twice on ``channel`` (the first waited)."""
    def call(self, *args, **kwargs):
        if kwargs.get("channel") == channel:
            method(self, *args, **kwargs).wait()
        return method(self, *args, **kwargs)
    return call


def _by_gather(init):
    """``Launcher.__init__`` that always reduces by gather, whatever the link policy says."""
    def call(self, device, accel=None, reduce_by_gather=False):
        init(self, device, accel, reduce_by_gather=True)
    return call


def _replanned(plan_fn, owner_of):
    """``plan_fn`` whose plan's owners are ``owner_of(g, W)`` of the planned ones."""
    from dmuon.ownership.plan import OwnershipPlan

    def plan(specs, mesh_shape, **kwargs):
        p = plan_fn(specs, mesh_shape, **kwargs)
        w = mesh_shape[0] * mesh_shape[1]
        return OwnershipPlan(mesh_shape=p.mesh_shape, specs=p.specs,
                             owner={n: owner_of(g, w) for n, g in p.owner.items()}, ns_cost=p.ns_cost)
    return plan


def _lossy_fr(read, warmup: bool):
    """``read_flight_recorder`` whose read of rank 1's dump after the window (not of
    ``fr_before/``) lacks one event: the last before the window (``warmup``) or the first in it."""
    from pathlib import Path

    from tracer.fr.parse import fr_window

    def lossy(path, *args, **kwargs):
        got = read(path, *args, **kwargs)
        path = Path(path)
        if dist.get_rank() != 1 or path.parent.name == "fr_before":
            return got
        window = fr_window(read(path.parent / "fr_before" / path.name).events, got.events)
        first = got.events.index(window[0])
        lost = got.events[first - 1 if warmup else first]
        got.events = [ev for ev in got.events if ev is not lost]
        return got
    return lossy


@contextlib.contextmanager
def mutation(name: str):
    """Plant regression ``name`` (one of the names below) in this process for the duration."""
    import dmuon.placement.layout as dense  # the runtime's planner call (MeshLayout.build)
    import dmuon.runtime.collectives as coll
    import verify.modes.build as modes
    import verify.traffic.predict as predict

    with contextlib.ExitStack() as stack:
        patch = lambda *a, **k: stack.enter_context(mock.patch.object(*a, **k))  # noqa: E731
        if name == "all_to_all_twice":  # one collective issued twice in the all_to_all path
            patch(coll, "all_to_all_", _repeat_first(coll.all_to_all_))
        elif name == "broadcast_twice":  # one extra broadcast in the broadcast path
            patch(coll, "broadcast_", _repeat_first(coll.broadcast_))
        elif name == "small_buckets":  # bucket cap 500x smaller (the runtime's default)
            patch(modes.dmuon, "dedicate_params",
                  _rewrapped(modes.dmuon.dedicate_params, bucket_cap_mb=SMALL_BUCKET_CAP_MB))
        elif name == "owners_rotated":  # the runtime's owners g -> W-1-g (predictor untouched)
            patch(dense, "plan_ownership", _replanned(dense.plan_ownership, lambda g, w: w - 1 - g))
        elif name == "all_on_rank0":  # the planner the predictor shares gives rank 0 everything
            zero = _replanned(dense.plan_ownership, lambda g, w: 0)
            patch(dense, "plan_ownership", zero)
            patch(predict, "plan_ownership", zero)
        elif name == "coalesce_target":  # auto's target changed in the runtime, mirrored in the predictor
            import dmuon.options as options_mod  # where dedicate_params resolves coalesce

            original = options_mod.resolve_coalesce

            def resolve(coalesce, backend):
                c = original(coalesce, backend)
                return dataclasses.replace(c, target_bytes=CHANGED_AUTO_TARGET_BYTES) \
                    if coalesce == "auto" else c
            patch(options_mod, "resolve_coalesce", resolve)
            patch(predict, "DMUON_AUTO_COALESCE_BYTES",
                  {**predict.DMUON_AUTO_COALESCE_BYTES, "gloo": CHANGED_AUTO_TARGET_BYTES})
        # the aligned all_gather / reduce_scatter form (dmuon-z2[nccl+largest]):
        elif name == "reduce_scatter_twice":  # the aligned reduce_scatter issued twice
            patch(coll, "reduce_scatter_sum_", _repeat_first(coll.reduce_scatter_sum_))
        elif name == "link_ignored":  # the runtime reduces by gather whatever link= says
            patch(coll.Launcher, "__init__", _by_gather(coll.Launcher.__init__))
        # the per-owner replicate axis (dmuon-hsdp-z3[block+hierarchical]):
        elif name == "replicate_broadcast_twice":  # the owner's replicate broadcast issued twice
            patch(coll.Launcher, "broadcast", _twice_on_channel(coll.Launcher.broadcast, "replicate"))
        elif name == "replicate_reduce_to_0":  # every replicate reduce to replicate rank 0
            original = coll.Launcher.reduce

            def reduce(self, buf, dst, group, channel="reduce"):
                return original(self, buf, 0 if channel == "replicate" else dst, group, channel=channel)
            patch(coll.Launcher, "reduce", reduce)
        # what the optimizer computes, with unchanged traffic (the numerics and owner_grads checks):
        elif name == "ns_one_fewer":  # Newton-Schulz with one iteration fewer
            patch(dense, "muon_update_matrices_", _rewrapped_by(dense.muon_update_matrices_, "ns_steps", -1))
        elif name == "momentum_restart":  # the momentum buffer restarts from 0 at every step
            import dmuon.optim.muon_math as muon_math

            original = muon_math._momentum_update

            def restarted(grad, momentum_buffer, momentum, nesterov):
                momentum_buffer.zero_()
                return original(grad, momentum_buffer, momentum, nesterov)
            patch(muon_math, "_momentum_update", restarted)
        elif name == "adamw_decay_twice":  # AdamW's decoupled weight decay applied twice
            import dmuon.optim.optimizer as optimizer

            original = optimizer._adam_functional

            def adam(params, *args, lr, weight_decay, **kwargs):
                with torch.no_grad():
                    for p in params:
                        p.mul_(1 - lr * weight_decay)
                return original(params, *args, lr=lr, weight_decay=weight_decay, **kwargs)
            patch(optimizer, "_adam_functional", adam)
        elif name == "hierarchical_grad_r":  # hierarchical HSDP owners divide by N, not W: R x the mean
            import dmuon.runtime.bucket as bucket_module

            original = bucket_module.Bucket.reduced

            def reduced(self, used, world_size):
                r = dist.get_world_size(self.groups.replicate) if self.groups.replicate is not None else 1
                return original(self, used, world_size // r)
            patch(bucket_module.Bucket, "reduced", reduced)
        # memory and checkpoints (the memory and checkpoint checks):
        elif name == "z2_frees":  # Z2 non-holders free their copies at the step (the next
            import dmuon.runtime.bucket as bucket_module  # forward's broadcast refills them; per-owner buckets)

            original = bucket_module.Bucket.stepped

            def stepped(self):
                if not self.is_holder and not self.options.reshard_after_forward:
                    self.free()  # VALID -> FREED; the next forward allocates and broadcasts
                original(self)
            patch(bucket_module.Bucket, "stepped", stepped)
        elif name == "meter_zero":  # the harness's memory meter reads 0 bytes everywhere
            import verify.measure.memory_meter as meter

            patch(meter, "_bytes", lambda seen: 0)
        elif name == "momentum_zeroed_in_state_dict":  # state_dict() re-creates owners' momentum as zeros
            import dmuon.optim.optimizer as optimizer

            original = optimizer.DMuon.state_dict

            def state_dict(self):  # the returned entries only: the live state is untouched
                sd = original(self)
                sd["state"] = {k: {**e, "momentum_buffer": torch.zeros_like(e["momentum_buffer"])}
                               if "momentum_buffer" in e else e for k, e in sd["state"].items()}
                return sd
            patch(optimizer.DMuon, "state_dict", state_dict)
        # a trace source that loses a call (the source checks): the Flight Recorder's dump as
        # rank 1 reads it after the window lacks one event, the last one before the window
        # (a warm-up step) or the first one in it
        elif name in ("fr_lost_warmup", "fr_lost_window"):
            import verify.run.runner as runner

            patch(runner, "read_flight_recorder", _lossy_fr(runner.read_flight_recorder,
                                                            warmup=name == "fr_lost_warmup"))
        elif name != "none":
            raise ValueError(f"Invalid mutation={name!r}.")
        yield


def gate(out_dir: str, modes: tuple[str, ...], mutated: str = "none", warmup: int = 2,
         measured: int = 2, coalesce: str = "auto", numerics: bool = True) -> dict | None:
    """``run_all`` on ``modes`` (``warmup`` warm-up and ``measured`` measured steps, no
    profiler: the gates under test read the interposer's events; DMuon's ``coalesce``; the
    checks after the window where ``numerics``) with ``mutated`` planted: the report on rank 0."""
    with mutation(mutated):
        return run_all(RunConfig(modes=modes, steps_warmup=warmup, steps_measured=measured,
                                 out_dir=out_dir, profiler=False, coalesce=coalesce,
                                 numerics=numerics))
