"""Rank-side tasks for ``verify-traffic --qk-clip`` (``tests/distributed/phase_d/
test_qk_clip_traffic.py``): the modes' builder with the clip on, and ``run_all`` (what each rank
of ``make verify-traffic ARGS="--qk-clip"`` runs) with an optional extra all_reduce planted in
the clip's phase."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from verify.run.runner import RunConfig, _source, run_all


def built_layout(mode: str, tau: float | None) -> dict:
    """``verify.modes.build.build(mode, qk_clip_tau=tau)`` on TinyGPT: the layout's head count,
    whether a QKClip is attached, and its layers' names (the DMuon state closed after)."""
    from verify.modes.build import build

    source = _source(RunConfig(), None)
    built = build(mode, lambda: source.factory()[0], qk_clip_tau=tau)
    try:
        clip = built.qk_clip
        return {"heads": built.layout.qk_clip_heads, "clip": clip is not None,
                "layers": [x.name for x in clip.layers] if clip is not None else [],
                "tau": clip.tau if clip is not None else None}
    finally:
        if built.dedicated is not None:
            built.dedicated.close()


def _twice(fn):
    """``fn`` (a synchronous collective) issued twice per call: one extra call, same phase."""
    def call(*args, **kwargs):
        fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


def qk_clip_run(out_dir: str, modes: tuple[str, ...], tau: float, planted: bool = False) -> dict | None:
    """``run_all`` on ``modes`` with ``--qk-clip tau`` (2 warm-up, 2 measured steps, no
    profiler); ``planted``: the runtime's MAX all_reduce issued twice per call (the clip's
    all_reduce duplicated, in its own phase). The report on rank 0."""
    import dmuon.runtime.collectives as coll

    with contextlib.ExitStack() as stack:
        if planted:  # fails loudly (AttributeError) if the runtime renames it
            stack.enter_context(mock.patch.object(coll, "all_reduce_max_", _twice(coll.all_reduce_max_)))
        torch.manual_seed(0)
        return run_all(RunConfig(modes=modes, steps_warmup=2, steps_measured=2, out_dir=out_dir,
                                 profiler=False, qk_clip_tau=tau))
