"""``verify-traffic --qk-clip [TAU]``: the flag reaches RunConfig, bad
values are refused before torchrun with one line, the committed default baseline is skipped
with its reason (not failed) on a --qk-clip run, and an end-to-end 2-process run shows the
phase ``qk_clip`` with measured = predicted bytes and n/a for a baseline mode.

Each fails without the feature: the workers' parser had no ``--qk-clip`` (exit 2, unrecognized
argument) and RunConfig no ``qk_clip_tau``. The baseline test also failed before this change's
fix of ``baseline_key``: a run's ``modes`` tuple never equalled the file's JSON list, so the
committed baseline was skipped on the default run too ("not the run the baseline was written
from: modes=(...) (baseline [...])").
"""

import json
import subprocess
import sys

import pytest

from verify.report import baseline as bl
from verify.run.main import parse_args
from verify.measure.qk_clip import DEFAULT_TAU
from verify.run.runner import RunConfig, report_config
from verify.modes.variants import RUN_MODES


@pytest.mark.parametrize("argv, want", [([], None), (["--qk-clip"], DEFAULT_TAU),
                                        (["--qk-clip", "0.2"], 0.2),
                                        (["--qk-clip", "--modes", "dmuon-z2,ddp-muon"], DEFAULT_TAU)])
def test_qk_clip_option_parses(argv, want):
    assert parse_args(["--out-dir", "x", *argv]).qk_clip == want


@pytest.mark.parametrize("args, says", [
    (["--qk-clip", "0"], "Invalid --qk-clip 0.0. Must be a finite threshold > 0"),
    (["--qk-clip", "nan"], "Invalid --qk-clip nan"),
    (["--qk-clip", "--model", "gpt2-small"], "--qk-clip runs the built-in model only"),
    (["--qk-clip", "--tp", "2"], "--tp 2 runs without --qk-clip"),
    (["--qk-clip", "--modes", "ddp-muon,naive-fsdp2-z2"], "no DMuon mode, so nothing would run the clip"),
    (["--qk-clip", "x"], "argument --qk-clip: invalid float value: 'x'"),
])
def test_bad_qk_clip_is_one_line_and_exit_2_before_torchrun(tmp_path, capsys, args, says):
    from verify.run.launch import main

    run = tmp_path / "run"
    assert main(["--nproc", "2", "--out-dir", str(run), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("make verify-traffic: error: ") and says in err[0], err
    assert [p.name for p in run.iterdir()] == ["exit_code"]  # torchrun never started


def _default_report(tau):
    config = report_config(RunConfig(modes=tuple(RUN_MODES), out_dir="traces/x", qk_clip_tau=tau))
    return {"config": config, "world_size": 4, "backend": "gloo", "model": "tinygpt",
            "torch_version": "2.13.0", "runs": [], "failures": [], "pass": True}


def test_the_default_baseline_applies_to_the_default_run_only():
    base = bl.read_baseline(bl.DEFAULT_BASELINE)
    plain = bl.apply_baseline(_default_report(None), base, "b.json", explicit=False)
    assert plain["baseline"]["compared"], plain["baseline"]["reason"]
    clipped = bl.apply_baseline(_default_report(DEFAULT_TAU), base, "b.json", explicit=False)
    assert not clipped["baseline"]["compared"] and clipped["pass"]
    assert clipped["baseline"]["reason"] == ("not the run the baseline was written from: "
                                             f"qk_clip_tau={DEFAULT_TAU!r} (baseline None)")
    assert bl.summary_lines(clipped) == [f"baseline b.json: not compared ({clipped['baseline']['reason']})"]


@pytest.mark.slow  # ~16 s; the wiring runs in make test in test_qk_clip_traffic.py (a pool)
@pytest.mark.distributed
def test_verify_traffic_qk_clip_end_to_end_two_processes(tmp_path):
    """torchrun, 2 gloo processes, two DMuon modes and one baseline, --qk-clip at its default:
    exit 0, the qk_clip phase in the DMuon runs with measured = predicted (W = 2, 8 heads: one
    all_reduce of 32 B per rank and step, f(n)·S = 32 B), n/a for ddp-muon, the same in
    report.md and the terminal, the default baseline not compared."""
    proc = subprocess.run(
        [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", "runs/qk",
         "--modes", "dmuon-ddp,dmuon-z2,ddp-muon", "--steps-warmup", "2", "--steps-measured", "1",
         "--no-profiler", "--qk-clip"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "runs/qk/report.json").read_text())
    assert report["pass"] and report["config"]["qk_clip_tau"] == DEFAULT_TAU
    runs = {run["mode"]: run for run in report["runs"]}
    for mode in ("dmuon-ddp", "dmuon-z2"):
        q, ph = runs[mode]["qk_clip"], runs[mode]["phases"]["qk_clip"]
        assert (ph["collectives_measured"], ph["collectives_predicted"], ph["pass"]) == (2, 2, True)
        assert q["msg_bytes"] == 32 and q["measured_avg_bytes"] == q["predicted_avg_bytes"] == 32.0
        assert q["pass"] and q["clipped_per_step"][0] == 8  # every head over τ at init
    assert runs["ddp-muon"]["qk_clip"]["applies"] is False and "qk_clip" not in runs["ddp-muon"]["phases"]
    md = (tmp_path / "runs/qk/report.md").read_text()
    assert "## QK-clip (MuonClip): phase qk_clip" in md and "n/a: not a DMuon mode" in md
    assert "qk_clip phase" in proc.stdout and "qk_clip n/a: not a DMuon mode" in proc.stdout
    assert f"qk_clip_tau={DEFAULT_TAU!r} (baseline None)" in proc.stdout  # skipped, not failed
