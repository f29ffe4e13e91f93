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
