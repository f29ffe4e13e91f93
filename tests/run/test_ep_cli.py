"""``--ep E`` on the command line (verify/run/main.py, verify/run/launch.py): checked before
torchrun, one line naming the value, the constraint and the fix; the EP workload is fixed, so
flags that would change it are refused rather than silently ignored."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("nproc, args, says", [
    (4, ["--ep", "2"], None),
    (4, ["--ep", "2", "--modes", "dmuon-z2,dmuon-hsdp-z3"], None),  # (2, 2) and (2, 1, 2)
    (4, ["--ep", "3"], "Invalid --ep 3 at W=4 (--nproc). Must divide W"),
    (3, ["--ep", "3"], "Invalid --ep 3: the EP workload's 8 experts per layer"),  # 8 % 3
    (8, ["--ep", "2", "--tp", "4"], "the attention's 2 KV heads must split evenly over T"),
    (4, ["--ep", "4", "--modes", "dmuon-hsdp-z2"], "HSDP x EP runs on a (2, W/(2E), E) mesh"),
    (4, ["--ep", "2", "--modes", "ddp-muon"], "no expert-parallel variant"),
    (4, ["--ep", "0"], "Invalid --ep 0. Must be >= 1"),
    (4, ["--ep", "2", "--tp", "2"], None),  # TP x EP (verify/modes/tpep.py): dmuon-z2, dmuon-z3
    (4, ["--ep", "2", "--tp", "2", "--modes", "ddp-muon"], "no TP x EP variant"),
    (6, ["--ep", "2", "--tp", "2"], "Invalid --tp 2 --ep 2 at W=6 (--nproc). E·T = 4 must divide W"),
    (4, ["--ep", "2", "--tp", "2", "--pp", "2"], "do not run together"),
    (4, ["--ep", "2", "--tp", "2", "--rest", "replicate"], "--tp 2 --ep 2 runs without --rest replicate"),
    (4, ["--ep", "2", "--tp", "2", "--mixed-precision", "bf16"], "--tp 2 --ep 2 runs without --mixed-precision"),
    (4, ["--ep", "2", "--model", "tiny-moe"], "--ep 2 runs without --model tiny-moe"),
    (4, ["--ep", "2", "--mixed-precision", "bf16"], "--ep 2 runs without --mixed-precision bf16"),
    (4, ["--ep", "2", "--hierarchy", "flat"], "--ep 2 runs without --hierarchy flat"),
    (4, ["--ep", "2", "--qk-clip"], "--ep 2 runs without --qk-clip"),
])
def test_usage_problem_checks_ep_before_torchrun(tmp_path, nproc, args, says):
    from verify.run.launch import usage_problem

    problem = usage_problem(args, tmp_path, nproc)
    assert (problem is None) if says is None else (says in (problem or "")), problem

