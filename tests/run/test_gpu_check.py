"""``make gpu-check``'s decision logic and plumbing, on CPU (no GPU in CI): what it runs, how
it judges each part, its one report file and exit codes, what it does where no GPU exists, and
``verify.run.launch --backend``. The CUDA calls themselves (set_sync_debug_mode, the CUDA
sanitizer, max_memory_allocated) only run on a GPU; these tests feed their outcomes in."""

import json

import pytest

from verify.run import device_checks as D
from verify.run import gpu_check as G
from verify.run.launch import resolve_backend


def test_missing_requirements_names_what_is_missing():
    assert G.missing_requirements(True, 1, True) == []
    (gpu,) = G.missing_requirements(False, 0, True)
    assert "a CUDA GPU" in gpu and "is_available()=False" in gpu
    assert len(G.missing_requirements(True, 0, False)) == 2


def test_without_a_gpu_it_writes_its_report_and_exit_code_3(tmp_path, capsys, monkeypatch):
    """No GPU here: the one report file says SKIPPED, what is missing and what is not checked;
    exit_code holds 3 (make gpu-check can only say 2)."""
    monkeypatch.setattr(G.torch.cuda, "is_available", lambda: False)
    assert G.main(["--out-dir", str(tmp_path)]) == G.EXIT_NO_GPU == 3
    out = capsys.readouterr().out
    assert "skipped, this machine lacks a CUDA GPU" in out
    report = json.loads((tmp_path / G.REPORT_FILE).read_text())
    assert report["verdict"] == "SKIPPED" and report["exit_code"] == 3 and report["parts"] == {}
    assert report["missing"][0].startswith("a CUDA GPU") and report["summary"][1] in out
    assert [n["what"].split(" ")[0] for n in report["not_checked"]][:4] == ["W", "HSDP", "NVLink", "nsys"]
    assert (tmp_path / "exit_code").read_text() == "3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit_code", G.REPORT_FILE]


def test_traffic_command_forces_one_nccl_process_over_the_dmuon_modes(tmp_path):
    cmd = G.traffic_command(tmp_path)
    assert cmd[1:3] == ["-m", "verify.run.launch"]
    assert cmd[cmd.index("--backend") + 1] == "nccl" and cmd[cmd.index("--nproc") + 1] == "1"
    assert cmd[cmd.index("--modes") + 1] == "dmuon-ddp,dmuon-z2,dmuon-z3"


def _run(mode, drop=(), failing=None, empty=None, ok=True):
    sources = {name: {"events": 4, "pass": name != failing, "mismatches": ["x"]}
               for name in G.SOURCES if name not in drop}
    if empty:
        sources[empty]["events"] = 0
    return {"mode": mode, "pass": ok, "sources": sources,
            "checks": [{"check": "collectives", "pass": ok}]}


def test_traffic_problems_require_every_source_with_events_passing_in_every_mode():
    assert G.SOURCES == ("interposer", "flight_recorder", "profiler", "nccl_log")
    assert G.traffic_problems({"runs": [_run(m) for m in G.MODES]}) == []
    report = {"runs": [_run("dmuon-ddp", drop=("nccl_log", "flight_recorder")),
                       _run("dmuon-z2", empty="profiler"),
                       _run("dmuon-z3", failing="nccl_log", ok=False)]}
    problems = G.traffic_problems(report)
    assert any(p.startswith("dmuon-ddp: no nccl_log source (the NCCL log") for p in problems)
    assert any(p.startswith("dmuon-ddp: no flight_recorder source") for p in problems)
    assert "dmuon-z2: the profiler source holds no event in the window" in problems
    assert "dmuon-z3: nccl_log failed: ['x']" in problems
    assert any(p.startswith("dmuon-z3: run failed (checks ['collectives']") for p in problems)
    assert len(problems) == 5
    assert G.traffic_problems({"runs": []}) == [f"{m}: no run in the report" for m in G.MODES]


def test_parity_and_sync_problems_and_the_verdict():
    parity = {"oracle_cuda_vs_cpu": 0.01,
              "dmuon-z2": {"rel_err": 0.01, "pass": True, "rel_err_cpu": 0.02, "pass_cpu": True},
              "dmuon-z3": {"rel_err": 0.9, "pass": False, "rel_err_cpu": 0.5, "pass_cpu": False}}
    problems = G.parity_problems(parity)
    assert problems == [
        "parity dmuon-z3: rel err 0.9 > 0.05 against torch's Muon + AdamW on the same device",
        "parity dmuon-z3: rel err 0.5 > 0.1 against the CPU oracle (CUDA against CPU)"]
    sync = {"dmuon-z2": {"pass": True, "error": None},
            "dmuon-z3": {"pass": False, "error": "RuntimeError: sync at dmuon/x.py:3 in f"}}
    assert G.sync_problems(sync) == ["sync dmuon-z3: a host-device synchronisation inside a "
                                     "step: RuntimeError: sync at dmuon/x.py:3 in f"]
    assert G.verdict([]) == ("PASS", 0) and G.verdict(["x"]) == ("FAIL", 1)


def test_report_summary_says_every_part_and_what_is_not_checked():
    env = {"torch": "2.11.0", "python": "3.12.1", "cuda": "13.0", "gpu": "H100", "nccl": "2.27.5"}
    parts = {"parity": {"oracle_cuda_vs_cpu": 0.0, "dmuon-z2": {
                 "rel_err": 1e-3, "pass": True, "rel_err_cpu": 2e-3, "pass_cpu": True,
                 "memory": {"max_allocated_bytes": 3 * 2**20}}},
             "sync": {"dmuon-z2": {"pass": True, "error": None}},
             "streams": {"dmuon-z2": {"clean": {"race": False, "error": None, "waits_skipped": 0},
                                      "control": {"race": True, "error": "e", "waits_skipped": 4}}}}
    report = G.build_report(env, parts, ["traffic: x"], [], {"traffic": 1.0})
    assert (report["verdict"], report["exit_code"]) == ("FAIL", 1)
    assert report["summary"][:5] == [
        "gpu-check FAIL (exit 1) on H100, torch 2.11.0, CUDA 13.0, NCCL 2.27.5, Python 3.12.1",
        "parity dmuon-z2: rel err 1.00e-03, vs CPU 2.00e-03; peak memory 3.0 MiB",
        "sync dmuon-z2: no host sync",
        "streams dmuon-z2: clean ordered, control detected (4 waits skipped)",
        "FAIL traffic: x"]
    assert len([s for s in report["summary"] if s.startswith("not checked: ")]) == len(G.NOT_CHECKED)
    assert G.build_report(env, parts, [], [], {})["exit_code"] == 0
    assert G.build_report(env, {}, [], ["a CUDA GPU"], {})["verdict"] == "SKIPPED"
    json.dumps(report)  # the one file to attach


def test_stream_problems_need_a_clean_run_and_a_detected_control():
    def runs(clean_race=False, clean_error=None, control_race=True, skipped=3, control_error="race"):
        return {"clean": {"race": clean_race, "error": clean_error, "waits_skipped": 0},
                "control": {"race": control_race, "error": control_error, "waits_skipped": skipped}}

    assert D.stream_problems({"dmuon-z2": runs()}) == []
    assert D.stream_problems({"m": runs(clean_race=True, clean_error="E at f")}) == [
        "streams m: race between DMuon's streams: E at f"]
    assert D.stream_problems({"m": runs(control_race=False, control_error=None)}) == [
        "streams m: negative control not detected: 3 event waits skipped and no race reported"]
    assert D.stream_problems({"m": runs(control_race=False, skipped=0, control_error=None)}) == [
        "streams m: negative control planted nothing (no event wait skipped)"]


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_skip_event_waits_plants_the_unordered_read_and_restores_the_wait():
    """The negative control's bug on DMuon's real Pending (stand-in stream and event objects:
    no GPU here): inside skip_event_waits the current stream never waits for the side stream's
    event; outside it waits again."""
    from dmuon.runtime.collectives import Pending

    stream = _Stream()
    with D.skip_event_waits() as skipped:
        Pending(event="ev1", wait_stream=lambda: stream).wait()
    assert stream.waited == [] and skipped == ["ev1"]
    Pending(event="ev2", wait_stream=lambda: stream).wait()
    assert stream.waited == ["ev2"]


def test_a_sanitizer_race_is_recognised_through_wrapping_exceptions():
    class CUDASanitizerErrors(Exception):
        pass

    try:
        try:
            raise CUDASanitizerErrors("1 error")
        except CUDASanitizerErrors as inner:
            raise RuntimeError("autograd hook failed") from inner
    except RuntimeError as exc:
        assert D._is_race(exc)
    assert D._is_race(RuntimeError(D.CSAN_MARK + " on tensor 0x7f"))
    assert not D._is_race(RuntimeError("NCCL error"))


@pytest.mark.parametrize("backend,gpus,nproc,expected", [
    ("auto", 0, None, (False, 4)),
    ("auto", 8, None, (True, 8)),
    ("auto", 1, None, (False, 4)),  # one GPU: the CPU default, unless nccl is asked for
    ("nccl", 1, None, (True, 1)),
    ("nccl", 2, 1, (True, 1)),
    ("gloo", 8, 1, (False, 1)),
])
def test_resolve_backend(backend, gpus, nproc, expected):
    assert resolve_backend(backend, gpus, nproc) == expected


@pytest.mark.parametrize("backend,gpus,nproc,text", [
    ("nccl", 0, None, "Invalid --nproc=0 for --backend nccl with 0 visible GPUs"),
    ("nccl", 2, 3, "Invalid --nproc=3 for --backend nccl with 2 visible GPUs"),
    ("auto", 0, 1, "Invalid --nproc=1. Must be >= 2"),
    ("mpi", 0, 1, "Invalid --backend='mpi'"),
    ("auto", 0, 0, "Invalid --nproc=0. Must be >= 1, or left out"),  # was the default (4)
    ("nccl", 8, 0, "Invalid --nproc=0. Must be >= 1, or left out"),  # was the GPU count
])
def test_resolve_backend_rejects(backend, gpus, nproc, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace("[", r"\[")):
        resolve_backend(backend, gpus, nproc)
