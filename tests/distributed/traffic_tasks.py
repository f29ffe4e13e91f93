"""Rank-side tasks for the traffic tests: train one mode and return its measured events."""

from __future__ import annotations

import tempfile

from verify.data import ByteCorpus
from verify.runner import RunConfig, _train_mode

_corpus = None


def measure_mode(mode: str, **config) -> dict:
    global _corpus
    if _corpus is None:
        _corpus = ByteCorpus.from_stdlib(200_000)
    cfg = RunConfig(out_dir=tempfile.mkdtemp(prefix="dmuon-traffic-"), steps_warmup=2, steps_measured=2, **config)
    result = _train_mode(mode, cfg, _corpus, lambda n: None)
    result.pop("spans")
    result["out_dir"] = cfg.out_dir
    return result


def measure_with_swapped_params(mode: str, **config) -> dict:
    """``measure_mode`` with the runtime's bucketing mutated: two params of different sizes and
    owners swap buckets (a bucketing bug the independent predictor must catch). Patches the
    name the runtime resolves when ``DedicatedParams`` is built; fails loudly if the runtime
    no longer has it."""
    import dataclasses

    import dmuon.dedicate as runtime

    original = runtime.bucket_layout

    def swapped(specs, plan):
        buckets = list(original(specs, plan))
        a = 0
        b = next(i for i, x in enumerate(buckets)
                 if x.owner != buckets[a].owner and x.numel != buckets[a].numel and x.dtype == buckets[a].dtype)
        ba, bb = buckets[a], buckets[b]
        buckets[a] = dataclasses.replace(ba, names=bb.names, numel=bb.numel)
        buckets[b] = dataclasses.replace(bb, names=ba.names, numel=ba.numel)
        return buckets

    runtime.bucket_layout = swapped
    try:
        return measure_mode(mode, **config)
    finally:
        runtime.bucket_layout = original
