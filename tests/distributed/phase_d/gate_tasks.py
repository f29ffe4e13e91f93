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
from unittest import mock

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


@contextlib.contextmanager
def mutation(name: str):
    """Plant regression ``name`` (one of the names below) in this process for the duration."""
    import dmuon.placement.layout as dense  # the runtime's planner call (MeshLayout.build)
    import dmuon.runtime.collectives as coll
    import verify.run.modes as modes
    import verify.traffic.predict as predict
    from dmuon.ownership.buckets import Coalescing

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
                return Coalescing(CHANGED_AUTO_TARGET_BYTES, c.reduce_by_gather, c.flat_hsdp) \
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
        elif name != "none":
            raise ValueError(f"Invalid mutation={name!r}.")
        yield


def gate(out_dir: str, modes: tuple[str, ...], mutated: str = "none") -> dict | None:
    """``run_all`` on ``modes`` (2 warm-up and 2 measured steps, no profiler: the gates under
    test read the interposer's events) with ``mutated`` planted: the report on rank 0."""
    with mutation(mutated):
        return run_all(RunConfig(modes=modes, steps_warmup=2, steps_measured=2, out_dir=out_dir,
                                 profiler=False))
