"""Mutation test: a bucketing bug in the runtime is caught by the independent predictor.

In a real 2-rank run the runtime's bucketing is patched so that two buckets of different size
swap owners; training still runs, and the comparison fails, naming the collectives
that are missing (the buckets as the documented protocol defines them) and unexpected (what
the runtime issued instead)."""

import pytest

from tests.distributed.phase_d import traffic_tasks
from verify.compare import compare_run
from verify.traffic.predict import dmuon_buckets

pytestmark = pytest.mark.distributed


def test_swapped_bucket_members_fail_naming_the_collectives(pool2):
    results = pool2.run(traffic_tasks.measure_with_swapped_params, "dmuon-z2", coalesce="block")
    layout = results[0]["layout"]
    events = [ev for r in results for ev in r["events"]]
    run = compare_run(layout, events, steps=2, ns_calls=sum(r["ns_calls"] for r in results))
    assert not run["pass"]
    buckets = dmuon_buckets(layout.muon_specs(), layout.plan(), layout.dmuon_bucket_cap_bytes,
                            coalesce_bytes=layout.dmuon_coalesce_bytes)
    mod_a, mod_b = results[0]["swapped_modules"]
    a = next(x for x in buckets if x.module == mod_a)
    b = next(x for x in buckets if x.module == mod_b and x.owner != a.owner)
    missing = {(m["op"], m["count"], m["root"]) for m in run["missing"]}
    unexpected = {(u["op"], u["count"], u["root"]) for u in run["unexpected"]}
    reduce = "gather" if layout.dmuon_reduce_by_gather else "reduce"  # gloo: docs/protocol.md step 4
    for op in ("broadcast", reduce):
        # predicted: each bucket whole from its owner; issued: the other one's size (a reduce
        # also carries one usage element per param)
        ka, kb = (len(a.names), len(b.names)) if op == reduce else (0, 0)
        assert (op, a.numel + ka, a.owner) in missing and (op, b.numel + kb, b.owner) in missing
        assert (op, b.numel + kb, a.owner) in unexpected and (op, a.numel + ka, b.owner) in unexpected
    # a missing call is named by the module of a predicted bucket with that key
    names = {x.module for x in buckets}
    assert all(m["module"] in names for m in run["missing"])
    # every rank takes part in each call, in each of the 2 measured steps
    assert {m["n"] for m in run["missing"]} == {2} and len(run["missing"]) == 2 * 2 * 2
    assert run["phases"]["forward"]["pass"] is False and run["phases"]["backward"]["pass"] is False
