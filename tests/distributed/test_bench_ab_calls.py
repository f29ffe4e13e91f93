"""``benchmarks/bench_ab_calls.py``: its counts are the same on every run of one tree (what makes
them an A/B that the machine's load cannot move), and its comparison names what changed.

The determinism test would fail if a count came from something the load changes (a polling
loop around a wait, a timer-driven path): two runs of the same tree would then differ.
The comparison test fails if ``compare`` lost a grown function or a changed op or collective.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_ab_calls", ROOT / "benchmarks" / "bench_ab_calls.py")
ab = importlib.util.module_from_spec(_spec)
sys.modules["bench_ab_calls"] = ab  # the pool's workers unpickle its rank task by module name
_spec.loader.exec_module(ab)


def _args(**kw) -> argparse.Namespace:
    base = dict(tree=ROOT, model="latency", modes="dmuon-z3", warmup=2, steps=2, cpu_rounds=1,
                latency_dim=16, latency_layers=3, latency_batch=4, mlp_dim=16, mlp_layers=2, mlp_batch=4)
    return argparse.Namespace(**{**base, **kw})


def test_counts_repeat_on_one_tree(pool2):
    args = _args()
    first, second = (ab.summarise(pool2.run(ab._rank_task, args)) for _ in range(2))
    for key in ("py_calls", "ops", "collectives", "waits"):
        assert first["dmuon-z3"][key] == second["dmuon-z3"][key] > 0, key
    assert first["dmuon-z3"]["collective_ops"] == second["dmuon-z3"]["collective_ops"]
    assert first["dmuon-z3"]["op_counts"] == second["dmuon-z3"]["op_counts"]
    calls = {k: v[0] for k, v in first["dmuon-z3"]["funcs"].items()}
    assert calls == {k: v[0] for k, v in second["dmuon-z3"]["funcs"].items()}
    assert calls["verify/run/runner.py:train_step"] == 1  # per rank-step, keyed inside the tree


def test_compare_names_what_grew():
    def row(calls, us, ops, colls):
        return {"py_calls": calls, "py_own_us": us, "ops": sum(ops.values()), "collectives": sum(colls.values()),
                "waits": 1.0, "cpu_ms": 1.0, "thread_cpu_ms": 1.0,
                "funcs": {"dmuon/a.py:f": [calls - 10, us / 2], "dmuon/b.py:g": [10, us / 2]},
                "op_counts": ops, "collective_ops": colls}

    a = {"dmuon-z3": row(100, 50.0, {"aten.mm.default": 4}, {"all_gather": 1})}
    b = {"dmuon-z3": row(160, 90.0, {"aten.mm.default": 4, "aten.zeros.default": 2},
                         {"all_gather": 1, "reduce_scatter": 1})}
    text = ab.compare(a, b, top=5)
    assert "dmuon-z3 | 100.0 -> 160.0" in text
    assert "90.0 ->    150.0" in text and "dmuon/a.py:f" in text
    assert "aten.zeros.default 0.0->2.0" in text and "aten.mm.default" not in text.split("op_counts changed")[1]
    assert "reduce_scatter 0.0->1.0" in text


def test_func_key_strips_tree_and_site_packages():
    assert ab._func_key("/t/dmuon/x.py", "f", "/t") == "dmuon/x.py:f"
    assert ab._func_key("/v/lib/python3.11/site-packages/torch/a.py", "g", "/t") == "torch/a.py:g"
    assert ab._func_key("~", "<built-in method len>", "/t") == "~:<built-in method len>"
