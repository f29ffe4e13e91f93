"""``bin/dmuon-ci``: the exit codes make cannot pass on (GNU make exits 0 or 2), returned
exactly, and each run's ``exit_code`` file. Runs the real script as CI would, on this machine
(no GPU, no nsys: the missing-hardware code 3 is the one it can show end to end; 0 and 1 of
verify-traffic: tests/run/test_launch.py). Fails without the fix: there was no such entry
point, and gpu-check / nsys-verify wrote no exit_code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verify.run import ci

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bin" / "dmuon-ci"


def _ci(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DMUON_PYTHON": sys.executable}
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.skipif(not _no_gpu(), reason="shows exit 3 on a machine without a GPU")
def test_gpu_check_without_a_gpu_returns_3_and_records_it(tmp_path):
    proc = _ci("gpu-check", "--out-dir", "out", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (tmp_path / "out" / "exit_code").read_text() == "3\n"
    assert proc.stderr.strip().splitlines()[-1] == (
        "gpu-check: exit code 3 (missing hardware or tools), in out/exit_code")
    assert _ci("code", "out", cwd=tmp_path).returncode == 3  # read back later, e.g. after make


@pytest.mark.skipif(shutil.which("nsys") is not None, reason="shows exit 3 where nsys is missing")
def test_nsys_verify_without_nsys_returns_3_and_records_it(tmp_path):
    assert ci.main(["nsys-verify", "--out-dir", str(tmp_path / "out")]) == 3  # in-process: fast
    assert (tmp_path / "out" / "exit_code").read_text() == "3\n"


def test_verify_traffic_usage_error_returns_2(tmp_path, capsys):
    out = tmp_path / "out"
    assert ci.main(["verify-traffic", "--nproc", "2", "--modes", "bogus", "--out-dir", str(out)]) == 2
    assert "Invalid --modes entries ['bogus']" in capsys.readouterr().err
    assert (out / "exit_code").read_text() == "2\n"
    assert ci.main(["verify-traffic", "--frobnicate-launcher", "--nproc", "x"]) == 2  # argparse's


def test_unknown_tool_and_bad_code_folders_are_usage_errors(tmp_path, capsys):
    assert ci.main(["bogus"]) == 2 and "Invalid tool 'bogus'" in capsys.readouterr().err
    assert ci.main([]) == 2
    assert ci.main(["code", str(tmp_path)]) == 2 and "no exit_code file" in capsys.readouterr().err
    (tmp_path / "exit_code").write_text("7\n")
    assert ci.main(["code", str(tmp_path)]) == 2 and "holds '7'" in capsys.readouterr().err
    for code in ci.MEANINGS:
        ci.record_exit(tmp_path, code, "t")
        assert ci.main(["code", str(tmp_path)]) == code


def test_the_documented_github_actions_workflow_names_what_exists():
    """docs/ci/github-actions.yml (the CPU/gloo lane): valid YAML whose run lines name a make
    target of the Makefile and a ``bin/dmuon-ci verify-traffic`` command line that the tool's
    own checks accept (``verify.run.launch.usage_problem``: launcher flags, then the job's), and
    whose uploaded JUnit file is the one the run writes (``<out-dir>/junit.xml``)."""
    import shlex

    import yaml

    from verify.run.launch import usage_problem

    flow = yaml.safe_load((ROOT / "docs" / "ci" / "github-actions.yml").read_text())
    steps = flow["jobs"]["verify-traffic"]["steps"]
    runs = [shlex.split(s["run"]) for s in steps if "run" in s]
    makefile = (ROOT / "Makefile").read_text()
    assert [r for r in runs if r[0] == "make"] == [["make", "install"]] and "\ninstall:" in makefile
    (gate,) = [r for r in runs if r[0] == "bin/dmuon-ci"]
    assert gate[1] == "verify-traffic" and (ROOT / gate[0]).is_file()
    args = gate[2:]
    nproc, out_dir = _pop(args, "--nproc"), _pop(args, "--out-dir")
    assert usage_problem(args, Path(out_dir), int(nproc)) is None
    reports = [s["with"] for s in steps if "with" in s and "report_paths" in s["with"]]
    assert reports == [{"report_paths": f"{out_dir}/junit.xml"}]


def _pop(args: list[str], flag: str) -> str:
    """The value after ``flag`` in ``args``, both removed from it."""
    i = args.index(flag)
    value = args[i + 1]
    del args[i : i + 2]
    return value
