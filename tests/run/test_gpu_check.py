"""``make gpu-check``'s decision logic and plumbing, on CPU (no GPU in CI): what it runs, how
it judges a report, what it does where no GPU exists, and ``verify.run.launch --backend``."""

import pytest

from verify.run import gpu_check as G
from verify.run.launch import resolve_backend


def test_missing_requirements_names_what_is_missing():
    assert G.missing_requirements(True, 1, True) == []
    (gpu,) = G.missing_requirements(False, 0, True)
    assert "a CUDA GPU" in gpu and "is_available()=False" in gpu
    assert len(G.missing_requirements(True, 0, False)) == 2


def test_without_a_gpu_it_prints_what_is_missing_and_exits_3(capsys, monkeypatch):
    monkeypatch.setattr(G.torch.cuda, "is_available", lambda: False)
    assert G.main([]) == G.EXIT_NO_GPU == 3
    assert "gpu-check: skipped, this machine lacks a CUDA GPU" in capsys.readouterr().out


def test_traffic_command_forces_one_nccl_process_over_the_dmuon_modes(tmp_path):
    cmd = G.traffic_command(tmp_path)
    assert cmd[1:3] == ["-m", "verify.run.launch"]
    assert cmd[cmd.index("--backend") + 1] == "nccl" and cmd[cmd.index("--nproc") + 1] == "1"
    assert cmd[cmd.index("--modes") + 1] == "dmuon-ddp,dmuon-z2,dmuon-z3"


def _run(mode, nccl=None, ok=True):
    sources = {"interposer": {"pass": True}}
    if nccl is not None:
        sources["nccl_log"] = nccl
    return {"mode": mode, "pass": ok, "sources": sources}


def test_traffic_problems_require_a_passing_nccl_log_in_every_mode():
    good = {"events": 16, "pass": True}
    assert G.traffic_problems({"runs": [_run(m, good) for m in G.MODES]}) == []
    report = {"runs": [_run("dmuon-ddp"), _run("dmuon-z2", {"events": 0, "pass": True}),
                       _run("dmuon-z3", {"events": 3, "pass": False, "mismatches": ["x"]}, ok=False)]}
    problems = G.traffic_problems(report)
    assert any(p.startswith("dmuon-ddp: no nccl_log source") for p in problems)
    assert any(p.startswith("dmuon-z2: the NCCL log window holds no COLL line") for p in problems)
    assert any(p.startswith("dmuon-z3: nccl_log failed: ['x']") for p in problems)
    assert any(p.startswith("dmuon-z3: run failed") for p in problems)
    assert G.traffic_problems({"runs": []}) == [f"{m}: no run in the report" for m in G.MODES]


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
])
def test_resolve_backend_rejects(backend, gpus, nproc, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace("[", r"\[")):
        resolve_backend(backend, gpus, nproc)
