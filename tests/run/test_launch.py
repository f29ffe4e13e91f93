"""`make verify-traffic` end to end on 2 CPU processes (torchrun, gloo), and its pieces."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verify.run.launch import launch_command, launch_env


def test_launch_command_runs_verify_main_under_torchrun():
    cmd = launch_command(4, Path("traces/x"), ["--modes", "dmuon-z2"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=4" in cmd and cmd[-4:] == ["--out-dir", "traces/x", "--modes", "dmuon-z2"]


def test_launch_env_sets_nccl_logging_only_for_nccl(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    gloo = launch_env(False, tmp_path)
    assert "NCCL_DEBUG" not in gloo and "TORCH_DISTRIBUTED_DEBUG" not in gloo
    nccl = launch_env(True, tmp_path)
    assert nccl["NCCL_DEBUG_SUBSYS"] == "INIT,COLL"
    assert nccl["NCCL_DEBUG_FILE"].endswith("nccl.%h.%p.log")


@pytest.mark.parametrize("args, says", [
    (["--modes", "bogus"], "Invalid --modes entries ['bogus']"),
    (["--modes", "naive-hsdp"], "no mode of --modes naive-hsdp can run at W=2"),
    (["--model", "nosuch.module:f"], "cannot import 'nosuch.module'"),
    (["--global-batch", "3"], "Invalid --global-batch=3"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--tp", "3"], "Invalid --tp 3 at W=2 (--nproc). Must divide W"),
    (["--modes", "dmuon-ddp", "--tp", "2"], "no mode of --modes dmuon-ddp can run with --tp 2 at W=2"),
    (["--hierarchy", "ring"], "argument --hierarchy: invalid choice: 'ring'"),
    (["--timeout-s", "0"], "Invalid --timeout-s 0. Must be >= 1 second"),
    (["--hierarchy", "flat", "--tp", "2"], "--tp 2 runs without --hierarchy flat"),
])
def test_bad_worker_input_is_one_line_and_exit_2_before_torchrun(tmp_path, capsys, args, says):
    from verify.run.launch import main

    run = tmp_path / "run"
    assert main(["--nproc", "2", "--out-dir", str(run), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("make verify-traffic: error: ") and says in err[0], err
    assert err[1] == f"verify-traffic: exit code 2 (bad input), in {run / 'exit_code'}"
    assert [p.name for p in run.iterdir()] == ["exit_code"]  # torchrun never started
    assert (run / "exit_code").read_text() == "2\n"  # what make cannot pass on (verify.run.ci)


@pytest.mark.parametrize("nproc, args, says", [
    (4, ["--tp", "3"], "Invalid --tp 3 at W=4 (--nproc). Must divide W, the mesh being (W/T) x T: "
                       "give --tp 2 or 4, or an --nproc that 3 divides."),
    (4, ["--modes", "dmuon-ddp", "--tp", "2"],
     "no mode of --modes dmuon-ddp can run with --tp 2 at W=4: no tensor-parallel variant"),
    (4, ["--modes", "dmuon-hsdp-z2", "--tp", "2"], "needs W/T even and >= 4, have W/T=2"),
    (4, ["--modes", "dmuon-z2", "--tp", "2"], None),
    (4, ["--modes", "dmuon-ddp,dmuon-z3", "--tp", "4"], None),  # dmuon-ddp skipped, as the workers do
    (8, ["--tp", "2"], None),  # every mode: the TP-capable ones run
    (4, ["--tp", "2", "--hierarchy", "hierarchical"], None),  # what 'auto' is under TP
    (3, ["--tp", "3"], "Invalid --tp 3 at W=3 (--nproc): the built-in model's blocks.0.mlp.fc1.weight "
                       "has 256 rows, not a multiple of T=3"),
    (6, ["--tp", "2"], "attn.proj.weight has 64 local rows, not a multiple of N=3"),
    (4, ["--hierarchy", "flat"], None),  # ARGS="--hierarchy ..." reaches the workers' parser
])
def test_usage_problem_checks_tp_before_torchrun(tmp_path, nproc, args, says):
    """--tp was not checked before torchrun: --tp 3 at W = 4 raised 'Invalid --tp 3 at W=4' in
    every mode on every rank, and a mode set without TP variants (dmuon-ddp) made the workers
    exit 2 under a torchrun traceback."""
    from verify.run.launch import usage_problem

    problem = usage_problem(args, tmp_path, nproc)
    assert (problem is None) if says is None else (says in (problem or "")), problem


@pytest.mark.parametrize("nproc, args, says", [
    (4, ["--pp", "3"], "Invalid --pp 3 at W=4 (--nproc). Must divide W and leave W/S >= 2"),
    (4, ["--pp", "4"], "Invalid --pp 4 at W=4 (--nproc)"),  # one rank per stage: no data parallel
    (4, ["--modes", "naive-hsdp", "--pp", "2"], "no pipeline-parallel variant"),
    (4, ["--pp", "2", "--tp", "2"], "--tp 2 and --pp 2 do not run together"),
    (4, ["--pp", "2", "--microbatches", "0"], "Invalid --pp 2 / --microbatches 0"),
    (4, ["--pp", "2", "--microbatches", "3"], "Invalid --microbatches 3 with --pp 2 at W=4: the 8 sequences"),
    (4, ["--pp", "2", "--microbatches", "1"], "torch's Schedule1F1B needs at least one micro-batch per stage"),
    (4, ["--pp", "2"], None),  # every mode: the PP-capable ones run
])
def test_usage_problem_checks_pp_before_torchrun(tmp_path, nproc, args, says):
    from verify.run.launch import usage_problem

    problem = usage_problem(args, tmp_path, nproc)
    assert (problem is None) if says is None else (says in (problem or "")), problem


@pytest.mark.parametrize("nproc, args, says", [
    (4, ["--cp", "3"], "Invalid --cp 3 at W=4 (--nproc). Must divide W and leave W/C >= 2"),
    (4, ["--cp", "4"], "Invalid --cp 4 at W=4 (--nproc)"),  # one data-parallel rank
    (4, ["--modes", "naive-hsdp", "--cp", "2"], "no context-parallel variant"),
    (4, ["--cp", "2", "--pp", "2"], "--pp 2 and --cp 2 do not run together"),
    (4, ["--cp", "2", "--mixed-precision", "bf16"], "--cp 2 runs without --mixed-precision bf16"),
    (4, ["--cp", "0"], "Invalid --cp 0. Must be >= 1"),
    (6, ["--cp", "3"], "Invalid --cp 3 at W=6: the 12 sequences of 64 tokens"),  # 3 does not divide 64
    (4, ["--cp", "2"], None),  # every mode: the CP-capable ones run
])
def test_usage_problem_checks_cp_before_torchrun(tmp_path, nproc, args, says):
    from verify.run.launch import usage_problem

    problem = usage_problem(args, tmp_path, nproc)
    assert (problem is None) if says is None else (says in (problem or "")), problem


def test_rank_errors_name_the_ranks_own_error_before_a_peers_broken_connection(tmp_path):
    from verify.run.launch import rank_errors

    assert rank_errors(tmp_path) == ""
    (tmp_path / "dmuon-z2").mkdir()
    (tmp_path / "dmuon-z2" / "error_rank0.txt").write_text(
        "Traceback...\nRuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer\n")
    (tmp_path / "dmuon-z2" / "error_rank1.txt").write_text("Traceback...\nValueError: rank 1 only\n")
    assert rank_errors(tmp_path).startswith("FAIL: dmuon-z2 raised on rank 1: ValueError: rank 1 only; ")


def test_a_reused_run_folder_reports_only_this_runs_errors(tmp_path, capsys, monkeypatch):
    """traces/<run-id>/dmuon-z2/error_rank0.txt of an earlier run was blamed for a later run's
    failure in another mode (rank_errors globbed every error file of the folder)."""
    import verify.run.launch as launch

    out = tmp_path / "bk_stale"
    (out / "dmuon-z2").mkdir(parents=True)
    (out / "dmuon-z2" / "error_rank0.txt").write_text("Traceback...\nValueError: stale error\n")
    (out / "exit_code").write_text("0\n")

    def worker_fails(cmd, env, out_dir):  # torchrun stands in: this run's dmuon-ddp raises on rank 1
        (out / "dmuon-ddp").mkdir()
        (out / "dmuon-ddp" / "error_rank1.txt").write_text("Traceback...\nValueError: this run\n")
        return 1, ""

    monkeypatch.setattr(launch, "supervise", worker_fails)
    assert launch.main(["--nproc", "2", "--backend", "gloo", "--out-dir", str(out),
                        "--modes", "dmuon-ddp"]) == 1
    err = capsys.readouterr().err
    assert "FAIL: dmuon-ddp raised on rank 1: ValueError: this run" in err
    assert "stale error" not in err and not (out / "dmuon-z2" / "error_rank0.txt").exists()
    assert (out / "exit_code").read_text() == "1\n"  # this run's code, not the earlier verdict

    monkeypatch.setattr(launch, "supervise", lambda cmd, env, out_dir: (0, ""))  # no verdict written
    assert launch.main(["--nproc", "2", "--backend", "gloo", "--out-dir", str(out),
                        "--modes", "dmuon-ddp"]) == 1
    assert "no verdict" in capsys.readouterr().err


@pytest.mark.parametrize("verdict", [0, 1])
def test_the_workers_verdict_is_the_exit_code_and_recorded(tmp_path, capsys, monkeypatch, verdict):
    """make turns 1 into 2 (GNU make exits 0 or 2): the code is recorded in exit_code and
    printed. Fails without the fix: the launcher returned the verdict without either."""
    import verify.run.launch as launch

    out = tmp_path / "run"

    def worker(cmd, env, out_dir):  # torchrun stands in: rank 0 wrote its verdict
        (out / "exit_code").write_text(f"{verdict}\n")
        return 0, ""

    monkeypatch.setattr(launch, "supervise", worker)
    assert launch.main(["--nproc", "2", "--backend", "gloo", "--out-dir", str(out)]) == verdict
    meaning = "pass" if verdict == 0 else "a check failed"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"verify-traffic: exit code {verdict} ({meaning}), in {out / 'exit_code'}")
    assert (out / "exit_code").read_text() == f"{verdict}\n"


def test_nccl_without_a_gpu_is_missing_hardware_exit_3(tmp_path, capsys, monkeypatch):
    """--backend nccl on a machine without a GPU: 3 (missing hardware), as make gpu-check and
    make nsys-verify; it was argparse's usage error, 2."""
    import verify.run.launch as launch

    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)
    assert launch.main(["--backend", "nccl", "--out-dir", str(tmp_path / "run")]) == 3
    err = capsys.readouterr().err
    assert "Invalid --nproc=0 for --backend nccl with 0 visible GPUs" in err
    assert (tmp_path / "run" / "exit_code").read_text() == "3\n"


def test_init_kwargs_bind_the_gpu_on_nccl_only():
    """NCCL joins with device_id (eager communicators: created in init_process_group, not by
    DMuon's first collective inside a forward hook); gloo as before. Fails without the fix:
    the harness passed no device_id."""
    import datetime

    import torch

    from verify.run.groups import init_kwargs

    assert init_kwargs("nccl", 3, 300) == {"backend": "nccl", "device_id": torch.device("cuda", 3),
                                           "timeout": datetime.timedelta(seconds=300)}
    assert init_kwargs("gloo", 3, 60) == {"backend": "gloo", "timeout": datetime.timedelta(seconds=60)}
    for bad, says in ((("mpi", 0, 1), "Invalid backend='mpi'"), (("nccl", -1, 1), "Invalid local_rank=-1"),
                      (("gloo", 0, 0), "Invalid timeout_s=0")):
        with pytest.raises(ValueError, match=says):
            init_kwargs(*bad)


def test_verify_traffic_main_joins_with_init_kwargs(monkeypatch, tmp_path):
    """verify.run.main passes init_kwargs' arguments to init_process_group (stand-in: the call
    is captured and stops the run; no group is created)."""
    import verify.run.main as worker

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop here

    monkeypatch.setattr(worker.dist, "init_process_group", fake_init)
    monkeypatch.setattr(worker.torch.cuda, "set_device", lambda i: seen.setdefault("set_device", i))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(KeyboardInterrupt):
        worker.main(["--out-dir", str(tmp_path), "--backend", "nccl", "--timeout-s", "77"])
    import torch

    assert seen["device_id"] == torch.device("cuda", 2) and seen["set_device"] == 2
    assert seen["backend"] == "nccl" and seen["timeout"].total_seconds() == 77


@pytest.mark.distributed
def test_verify_traffic_end_to_end_two_processes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", "runs/e2e",
         "--modes", "dmuon-z3", "--steps-warmup", "2", "--steps-measured", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "runs/e2e/report.json").read_text())
    (run,) = report["runs"]
    # 3(N-1)/N - (N-1)/N·P_M^L at N=2, P_M^L = P_M: TinyGPT is one unit under gloo's 2 MB
    # target, which Z3 keeps from forward into backward (docs/protocol.md step 2)
    assert report["pass"] and run["mode"] == "dmuon-z3" and run["ratio_to_p_m"] == 1.0
    assert run["sources"]["flight_recorder"]["pass"]
    assert run["sources"]["profiler"]["pass"]  # torch.profiler: the third source on CPU
    assert run["sources"]["profiler"]["matched"] == run["sources"]["interposer"]["events"]
    assert "nccl_log" not in run["sources"]  # gloo: no NCCL log to read
    assert run["nvlink"]["available"] or run["nvlink"]["reason"]  # here: NVML missing, and why
    for name in ("report.md", "traffic.png", "dmuon-z3/timeline.json", "dmuon-z3/timeline.png",
                 "dmuon-z3/layout.json", "dmuon-z3/profiler_rank0.json", "dmuon-z3/profiler_rank1.json"):
        assert (tmp_path / "runs/e2e" / name).is_file(), name
    assert "PASS" in proc.stdout and (tmp_path / "runs/e2e/exit_code").read_text() == "0\n"
    # nothing the user did not ask for (Kineto's USDT markers, tqdm off a terminal),
    # junit.xml beside report.json, and the real report valid under the committed JSON Schema
    for stream in (proc.stdout, proc.stderr):
        assert "USDT" not in stream and "profiler_start" not in stream and "training steps" not in stream
        # no warning of any kind: torch 2.11's profiler printed "Warning: Profiler clears events
        # at the end of each cycle" as a UserWarning once per rank without acc_events=True
        assert "warn" not in stream.lower(), stream[-3000:]
    assert (tmp_path / "runs/e2e/junit.xml").is_file()
    import jsonschema  # the test extra (pyproject.toml)
    from verify.report.schema_json import SCHEMA_PATH
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.distributed
@pytest.mark.slow  # ~14 s of torchrun; a mode raising on every rank: test_nodes_failstop.py in make test
def test_rising_loss_and_a_raising_mode_are_named_in_the_last_line(tmp_path):
    """A user model with exactly right traffic whose loss rises (dmuon-z2), and whose loss_fn
    raises under DDP in its first measured step (dmuon-ddp, run first): both are reported,
    each by name; the mode after the one that raised still runs and its traffic still matches
    (that the failed window's recorders are closed: tests/distributed/phase_d/test_record.py)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "verify.run.launch", "--nproc", "2", "--out-dir", str(out),
         "--modes", "dmuon-ddp,dmuon-z2", "--steps-warmup", "2", "--steps-measured", "1",
         "--model", "tests.distributed.phase_d.verdict_factories:rising_loss_raises_under_ddp"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == "FAIL: loss did not fall (dmuon-z2); mode raised an error (dmuon-ddp)"
    report = json.loads((out / "report.json").read_text())
    (run,) = report["runs"]
    assert run["mode"] == "dmuon-z2" and run["loss_last"] > run["loss_first"]
    assert [c["check"] for c in run["checks"] if not c["pass"]] == ["loss"]  # traffic all right
    assert [(f["mode"], f["check"]) for f in report["failures"]] == [("dmuon-z2", "loss"),
                                                                     ("dmuon-ddp", "error")]
    assert "RuntimeError: verdict test: this loss_fn refuses DDP" in report["failures"][1]["detail"]
    assert "refuses DDP" in (out / "dmuon-ddp" / "error_rank1.txt").read_text()
    md = (out / "report.md").read_text().split("## Failures")[1]
    assert "- loss did not fall: " in md and "- mode raised an error: " in md
    assert (out / "exit_code").read_text() == "1\n"


@pytest.mark.parametrize("argv, want", [([], "auto"), (["--hierarchy", "flat"], "flat"),
                                        (["--hierarchy", "hierarchical"], "hierarchical")])
def test_hierarchy_option_parses(argv, want):
    """``make verify-traffic ARGS="--hierarchy ..."``: launch passes unknown args through to
    the workers' parser (main() puts it in RunConfig.hierarchy, for verify.modes.build.build)."""
    from verify.run.main import parse_args

    assert parse_args(["--out-dir", "x", *argv]).hierarchy == want
