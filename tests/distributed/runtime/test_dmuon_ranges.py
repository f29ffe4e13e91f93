"""Every range the timeline issue lists is emitted by a real DMuon step, on 4 gloo ranks:
broadcast, re-broadcast, reduce, replicate wait, Newton–Schulz per matrix and the HSDP
replicate broadcast, each with module and owner, as span listeners see them and as NVTX
messages that tracer.nsys.parse parses back (recorded through a stand-in NVTX domain)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from dmuon import annotate
from tests.distributed.parity.dmuon_tasks import GLOBAL_BATCH, SMALL, corpus, make_model
from tests.builders import RecordingDomain
from tracer.nsys.parse import _SPAN_RE
from verify.workload.data import local_slice
from verify.modes.build import build
from verify.run.runner import train_step

pytestmark = pytest.mark.distributed

#: DMuon's span names, one per range of the issue (docs/spec.md §1 step order).
ISSUE_RANGES = {"dmuon.broadcast", "dmuon.rebroadcast", "dmuon.reduce", "dmuon.replicate_wait",
                "dmuon.newton_schulz", "dmuon.replicate_broadcast"}


TWO_BLOCKS = dataclasses.replace(SMALL, n_layers=2)


def _ranges_of_last_step(mode: str, steps: int) -> dict:
    """Train ``steps`` steps; spans and NVTX pushes of the last one (the replicate wait of an
    HSDP step waits for the previous step's broadcast, so the first step has none)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # two blocks, one unit each: Z3 re-broadcasts every unit but the last (protocol step 2),
    # so a one-unit model has no re-broadcast
    built = build(mode, lambda: make_model(TWO_BLOCKS), coalesce="block")
    spans, fake = [], RecordingDomain()
    saved = annotate._NVTX_DOMAIN, annotate.nvtx_enabled()
    try:
        for step in range(steps):
            if step == steps - 1:
                annotate.add_span_listener(spans.append)
                annotate._NVTX_DOMAIN = fake
                annotate.set_nvtx_enabled(True)
            x, y = corpus().global_batch(step, GLOBAL_BATCH, TWO_BLOCKS.seq_len)
            train_step(built.model, built.optimizer, local_slice(x, rank, world), local_slice(y, rank, world))
    finally:
        annotate.remove_span_listener(spans.append)
        annotate._NVTX_DOMAIN = saved[0]
        annotate.set_nvtx_enabled(saved[1])
    built.dedicated.wait_pending()
    return {"spans": [(s.name, s.module, s.owner) for s in spans],
            "pushed": [m for kind, m in fake.calls if kind == "push"],
            "pops": sum(kind == "pop" for kind, _ in fake.calls),
            "module_names": sorted({b.module_name for b in built.dedicated.buckets}),
            "matrices": len(built.dedicated.names)}


def test_hsdp_z3_step_emits_every_issue_range_with_module_and_owner(pool4):
    results = pool4.run(_ranges_of_last_step, "dmuon-hsdp-z3", 2)
    names = {name for out in results for name, _, _ in out["spans"]}
    assert names == ISSUE_RANGES
    for out in results:
        assert out["spans"], "a rank emitted no span"
        for name, module, owner in out["spans"]:
            assert module in out["module_names"] and 0 <= owner < 4, (name, module, owner)
        assert out["pops"] == len(out["pushed"])
        spans_pushed = [m for m in out["pushed"] if not m.startswith("dmuon.phase ")]
        assert len(spans_pushed) == len(out["spans"])
        for message in spans_pushed:  # what nsys will show, read back by tracer.nsys.parse
            match = _SPAN_RE.match(message)
            assert match and match["module"] in out["module_names"] and match["owner"], message
    # Newton–Schulz: one range per owner and matrix shape (same-shape matrices of one owner
    # are one batch; here every matrix of the block has its own shape), on its owner only,
    # named after the block.
    ns = [(rank, module, owner) for rank, out in enumerate(results)
          for name, module, owner in out["spans"] if name == "dmuon.newton_schulz"]
    assert sorted({module for _, module, _ in ns}) == results[0]["module_names"]
    assert len(ns) == results[0]["matrices"]
    assert all(rank == owner for rank, _, owner in ns)  # 2 x 2 mesh: owner index = world rank
