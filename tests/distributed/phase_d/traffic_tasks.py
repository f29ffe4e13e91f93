"""Rank-side tasks for the traffic tests: train one mode and return its measured events."""

from __future__ import annotations

import tempfile

from verify.workload.data import ByteCorpus
from verify.run.runner import RunConfig, _train_mode

_corpus = None


def measure_mode(mode: str, **config) -> dict:
    global _corpus
    if _corpus is None:
        _corpus = ByteCorpus.from_stdlib(200_000)
    # the traffic alone: the checks after the window run in test_gate_numerics.py; torch.profiler
    # (about 2 s of each 3.5 s task) only where a test reads its source (``profiler=True``)
    cfg = RunConfig(out_dir=tempfile.mkdtemp(prefix="dmuon-traffic-"), steps_warmup=2, steps_measured=2,
                    **{"numerics": False, "profiler": False, **config})
    result = _train_mode(mode, cfg, _corpus, lambda n: None)
    result.pop("spans")
    result["out_dir"] = cfg.out_dir
    return result


def measure_with_swapped_params(mode: str, **config) -> dict:
    """``measure_mode`` with the runtime's bucketing mutated: two buckets of different sizes
    swap owners (a bucketing bug the independent predictor must catch). Patches the
    name the runtime resolves when ``DedicatedParams`` is built; fails loudly if the runtime
    no longer has it."""
    import dataclasses
    from collections import Counter

    import dmuon.runtime.runtime as runtime  # where Runtime builds the buckets

    original = runtime.bucket_layout

    chosen: list[tuple[str, str]] = []

    def swapped(specs, plan, cap_bytes, *coalesce):
        buckets = list(original(specs, plan, cap_bytes, *coalesce))
        keys = Counter((x.numel, x.owner) for x in buckets)
        # the first pair whose swap changes the multiset of (count, root): a swap between two
        # pairs of equal sizes and owners would be invisible in any trace (no module names)
        a, b = next((i, j) for i, x in enumerate(buckets) for j, y in enumerate(buckets)
                    if x.owner != y.owner and x.numel != y.numel and x.dtype == y.dtype
                    and keys - Counter([(x.numel, x.owner), (y.numel, y.owner)])
                    + Counter([(y.numel, x.owner), (x.numel, y.owner)]) != keys)
        ba, bb = buckets[a], buckets[b]
        # swap the owners (the runtime re-derives a bucket's params from its module on every
        # rebind, so a names swap would be repaired; an owner swap is a plain bucketing bug)
        buckets[a] = dataclasses.replace(ba, owner=bb.owner)
        buckets[b] = dataclasses.replace(bb, owner=ba.owner)
        chosen.append((ba.module, bb.module))
        return buckets

    runtime.bucket_layout = swapped
    try:
        return {**measure_mode(mode, **config), "swapped_modules": chosen[0]}
    finally:
        runtime.bucket_layout = original


def measure_with_shifted_ns_rank(mode: str, **config) -> dict:
    """``measure_mode`` under TP with every Newton–Schulz rank moved to TP index 0 (a plan
    bug: training stays correct, the gathers / scatters merge at one root). The
    independent TP predictor (verify/traffic/tp.py) must flag the calls. Patches the name
    ``dmuon.api`` resolves; fails loudly if the runtime no longer has it."""
    from unittest import mock

    import dataclasses

    from dmuon.placement import layout

    original = layout.plan_layout

    def shifted(dims, layouts, specs):
        planned = original(dims, layouts, specs)
        assert planned.ns_index, "no sharded matrix whose Newton-Schulz rank to shift"
        return dataclasses.replace(planned, ns_index={n: 0 for n in planned.ns_index})

    with mock.patch.object(layout, "plan_layout", shifted):
        return measure_mode(mode, **config)


def verdict(out_dir: str, modes: tuple[str, ...], **config) -> dict | None:
    """``run_all`` (what ``make verify-traffic`` runs on each rank) on ``modes``: the report on
    rank 0, ``None`` elsewhere."""
    from verify.run.runner import run_all

    return run_all(RunConfig(modes=modes, steps_warmup=2, steps_measured=2, out_dir=out_dir, **config))
