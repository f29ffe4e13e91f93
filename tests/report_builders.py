"""The example verify-traffic report of the renderer tests (test_report, test_report_layout,
test_nvlink, test_verdicts): a helper module, so test modules do not import each other.

It follows the traffic model of docs/spec.md §2 for a small GPT (2 blocks, d=64: per block qkv
64×192, proj 64×64, fc1 64×256, fc2 256×64, so P_M = 98,304) at W=4 on gloo, all 9 modes, with
dmuon-z3 failing: the backward re-broadcast of blocks.1.mlp is missing on every rank and a
1-element all_reduce (a barrier) is unexpected.
"""

from __future__ import annotations

from verify.report.render import MODES

P_M = 98_304

# mode -> (N, R, {phase: (closed-form fraction of P_M, seed fraction or None)}, formula,
#          NS calls per dedicated param per step)
_MODEL = {
    "ddp-muon": (4, 1, {"backward": (1.5, None)}, "2(N-1)/N", 4),
    "zero1-muon": (4, 1, {"backward": (0.0, None), "optimizer": (1.5, None)}, "2(N-1)/N", 1),
    "dmuon-ddp": (4, 1, {"forward": (0.75, None), "backward": (0.75, None),
                         "optimizer": (0.0, None)}, "2(N-1)/N", 1),
    "naive-fsdp2-z2": (4, 1, {"forward": (0.75, None), "backward": (0.75, None),
                              "optimizer": (0.75, None)}, "3(N-1)/N", 4),
    "naive-fsdp2-z3": (4, 1, {"forward": (0.75, None), "backward": (1.5, None),
                              "optimizer": (0.75, None)}, "4(N-1)/N", 4),
    "dmuon-z2": (4, 1, {"forward": (0.75, None), "backward": (0.75, None),
                        "optimizer": (0.0, None)}, "2(N-1)/N", 1),
    "dmuon-z3": (4, 1, {"forward": (0.75, None), "backward": (1.5, None),
                        "optimizer": (0.0, None)}, "3(N-1)/N", 1),
    "naive-hsdp": (2, 2, {"forward": (0.5, None), "backward": (1.0, None),
                          "optimizer": (0.5, None), "replicate": (0.5, None)},
                   "4(N-1)/N + 2(R-1)/(N·R)", 4),
    "dmuon-hsdp-z2": (2, 2, {"forward": (0.5, 0.5), "backward": (0.5, 0.5),
                             "optimizer": (0.0, 0.0), "replicate": (0.5, 1.0)},
                      "2(W-1)/W", 1),
    "dmuon-hsdp-z3": (2, 2, {"forward": (0.5, 0.5), "backward": (1.0, 1.0),
                             "optimizer": (0.0, 0.0), "replicate": (0.5, 1.0)},
                      "2(W-1)/W + (N-1)/N", 1),
}
N_DEDICATED = 8
MODULES = ("blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp")
FR_MISMATCHES = [
    f"rank {r} pg 0,1,2,3 seq {41 + r}: predicted broadcast 32768 float32 root 3 "
    f"(backward, blocks.1.mlp), trace has none" for r in range(4)
] + [f"rank {r} pg 0,1,2,3 seq {45 + r}: unexpected all_reduce 1 float32" for r in range(3)]


def _run(mode: str) -> dict:
    n, r, phases, formula, ns_per_param = _MODEL[mode]
    w = n * r
    run_phases = {}
    for name, (frac, seed_frac) in phases.items():
        elems = frac * P_M
        n_coll = 0 if frac == 0 else 4 * w
        run_phases[name] = {
            "measured_avg_elems": elems, "predicted_avg_elems": elems,
            "closed_form_avg_elems": elems,
            "seed_avg_elems": None if seed_frac is None else seed_frac * P_M,
            "collectives_measured": n_coll, "collectives_predicted": n_coll, "pass": True,
        }
    total = sum(ph["measured_avg_elems"] for ph in run_phases.values())
    seed_total = (None if phases["forward" if "forward" in phases else "backward"][1] is None
                  else sum(ph["seed_avg_elems"] for ph in run_phases.values()))
    n_events = sum(ph["collectives_measured"] for ph in run_phases.values()) + 6 * w
    hsdp = mode.startswith("dmuon-hsdp")
    return {
        "mode": mode, "world_size": w, "shard_size": n, "replicate_size": r, "p_m": P_M,
        "measured_avg_elems": total, "predicted_avg_elems": total,
        "closed_form": formula, "closed_form_avg_elems": total, "seed_avg_elems": seed_total,
        "ratio_to_p_m": total / P_M,
        "ns_calls_per_step": ns_per_param * N_DEDICATED,
        "ns_calls_expected": ns_per_param * N_DEDICATED,
        "max_rank_elems": total * 1.25 + 0.5,
        "total_measured_avg_elems": total + 52_224.0,
        "total_predicted_avg_elems": total + 52_224.0,
        "loss_first": 10.8321, "loss_last": 7.9154, "pass": True,
        "phases": run_phases, "missing": [], "unexpected": [],
        "sources": {
            "interposer": {"events": n_events, "matched": n_events, "unmatched": 0,
                           "pass": True, "mismatches": []},
            "flight_recorder": {"events": n_events, "matched": n_events, "unmatched": 0,
                                "pass": True, "mismatches": []},
        },
        "replicate_overlap": [
            {"module": m, "rank": rank, "issued_ns": 9_000_000 + 10_000 * i,
             "waited_ns": 11_200_000 + 400_000 * i + 1_000 * rank, "wait_dur_ns": 3_000 + 500 * i}
            for i, m in enumerate(MODULES) for rank in range(w)
        ] if hsdp else [],
        "timeline": f"traces/r1/{mode}/timeline.json" if hsdp else None,
    }


def _fail_dmuon_z3(run: dict) -> None:
    lost = 0.75 * 32_768  # (N-1)/N · S of the missing broadcast of fc1+fc2 packed
    bwd = run["phases"]["backward"]
    bwd["measured_avg_elems"] -= lost
    bwd["collectives_measured"] -= 4  # the 4 missing broadcasts (the barrier moves no param)
    bwd["pass"] = False
    run["measured_avg_elems"] -= lost
    run["ratio_to_p_m"] = run["measured_avg_elems"] / P_M
    run["pass"] = False
    run["missing"] = [
        {"rank": rank, "phase": "backward", "op": "broadcast", "group_id": "0,1,2,3",
         "count": 32_768, "dtype": "float32", "root": 3, "module": "blocks.1.mlp", "n": 1}
        for rank in range(4)
    ]
    run["unexpected"] = [
        {"rank": rank, "phase": "backward", "op": "all_reduce", "group_id": "0,1,2,3",
         "count": 1, "dtype": "float32", "root": None, "module": None, "n": 1}
        for rank in range(4)
    ]
    fr = run["sources"]["flight_recorder"]
    fr.update({"matched": fr["events"] - 4, "unmatched": 4, "pass": False,
               "mismatches": list(FR_MISMATCHES)})


def example_report() -> dict:
    runs = [_run(m) for m in MODES]
    _fail_dmuon_z3(runs[MODES.index("dmuon-z3")])
    return {
        "pass": False, "created_utc": "2025-06-01T12:00:00Z", "torch_version": "2.13.0+cpu",
        "backend": "gloo", "world_size": 4, "steps_warmup": 2, "steps_measured": 3,
        "run_id": "r1-gloo-w4", "runs": runs,
    }
