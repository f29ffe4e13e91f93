"""``tools/node_env.py`` (``make gpu-node``, ``make test-torch``): DMuon over a Python that
already carries torch, installing nothing already there, offline."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("node_env", REPO_ROOT / "tools" / "node_env.py")
node_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(node_env)


def _torch_requirement() -> str:
    _, reqs = node_env.read_requirements(REPO_ROOT / "pyproject.toml", [])
    return next(r for r in reqs if r.startswith("torch"))


@pytest.mark.parametrize("version", ["2.11.0a0+40a1b2c.nv25.03", "2.11.0+cu130", "2.11.0",
                                     "2.12.1", "2.13.0+cpu", "2.16.0"])
def test_pyproject_admits_the_torch_gpu_images_carry(version):
    """The NGC-style pre-release, 2.11 and everything newer satisfy ``[project] dependencies``
    (fails with the former ``torch>=2.13,<2.15``: 2.11 and 2.16 were refused, and a
    requirement without a pre-release refuses ``2.11.0a0``)."""
    assert node_env.unmet([_torch_requirement()], {"torch": version}.get) == []


@pytest.mark.parametrize("version", ["2.10.1", "2.11.0.dev20260101", None])
def test_pyproject_refuses_torch_older_than_2_11(version):
    assert node_env.unmet([_torch_requirement()], {"torch": version}.get) == [
        (_torch_requirement(), version)]


def test_unmet_lists_the_missing_and_the_too_old_only():
    found = {"numpy": "1.24.0", "pandas": "2.2.3", "tqdm": "4.67.0"}.get
    reqs = ["numpy>=1.26", "pandas>=2.2", "pyarrow>=15", "tqdm>=4.66",
            "nvtx>=0.2 ; sys_platform == 'never'"]
    assert node_env.unmet(reqs, found) == [("numpy>=1.26", "1.24.0"), ("pyarrow>=15", None)]


def test_core_needs_no_optional_package():
    """The extras hold what may be missing on a node; the core is what imports need."""
    _, core = node_env.read_requirements(REPO_ROOT / "pyproject.toml", [])
    names = {r.split(">")[0].split("=")[0].strip() for r in core}
    assert names.isdisjoint({"nvtx", "nvidia-ml-py", "matplotlib", "transformers"})
    _, everything = node_env.read_requirements(REPO_ROOT / "pyproject.toml",
                                               ["test", "gpu", "plots"])
    assert {"nvtx>=0.2.10", "nvidia-ml-py>=12.535", "matplotlib>=3.8"} <= set(everything)
    with pytest.raises(ValueError, match=r"--extras \['gpus'\].*Must be among"):
        node_env.read_requirements(REPO_ROOT / "pyproject.toml", ["gpus"])


@pytest.mark.parametrize("found, ok", [
    ({"setuptools": "84.2.1"}, True), ({"setuptools": "70.1.0"}, True),
    ({"setuptools": "65.5.0"}, False), ({"setuptools": "65.5.0", "wheel": "0.45"}, True),
    ({"setuptools": "63.0"}, False), ({}, False)])
def test_editable_build_offline_needs_wheel_below_setuptools_70_1(found, ok):
    """Found by running it: pip's ``--no-build-isolation -e .`` over setuptools 65.5 without
    ``wheel`` (this project's torch-2.11 venv) fails with "invalid command 'bdist_wheel'";
    such a base gets the ``.pth`` link instead of a failed install."""
    assert node_env.editable_buildable(found.get) is ok


def test_torch_missing_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(node_env, "installed_version", {"numpy": "2.0"}.get)
    with pytest.raises(node_env.NodeEnvError, match=r"torch is not installed for .*never installs one.*"
                                         r"make gpu-node PYTHON="):
        node_env.check_base(">=3.11", ["torch>=2.11.0a0", "numpy>=1.26"])
    monkeypatch.setattr(node_env, "installed_version", {"torch": "2.10.0+cu126"}.get)
    with pytest.raises(node_env.NodeEnvError, match=r"torch 2.10.0\+cu126 does not satisfy "
                                                    r"'torch>=2.11.0a0'") as err:
        node_env.check_base(">=3.11", ["torch>=2.11.0a0"])
    assert err.value.exit_code == 2


def test_python_outside_requires_python_is_refused():
    with pytest.raises(node_env.NodeEnvError, match=r"outside DMuon's requires-python '>=9'"):
        node_env.check_base(">=9", ["torch>=2.11.0a0"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("link", ["pth", pytest.param("auto", marks=pytest.mark.slow)])
def test_offline_venv_over_a_venv_uses_its_torch_and_installs_nothing(tmp_path, link):
    """End to end with pip's index switched off: a venv over this test's own venv (the
    layered case: a child venv would not see a venv's packages without the ``.pth``) reuses
    its torch and every dependency, and links the checkout. Fails without the ``.pth``
    (``import torch`` in the child) or if anything were downloaded (``PIP_NO_INDEX``).
    ``auto`` (slow: pip's editable build, over a minute on a loaded 2-core machine) is the
    ``pip install --no-deps --no-build-isolation --no-index -e .`` link."""
    target = tmp_path / "node"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PYTHONPATH": ""}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "node_env.py"), "--venv",
                          str(target), "--link", link, "--extras", ""],  # the core: there
                         capture_output=True, text=True, env=env, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "unmet: none" in run.stdout and f"({'pip' if link == 'auto' else 'pth'})" in run.stdout
    mark = (target / node_env.MARK_NAME).read_text().splitlines()
    import torch
    assert mark == [sys.executable, node_env.installed_version("torch")]
    # "ready: torch V from DIR, DMuon from DIR (link)": what the new venv itself imported
    ready = run.stdout.split(" ready: torch ")[1].split()
    assert Path(ready[2].rstrip(",")).resolve() == Path(torch.__file__).resolve().parent
    assert Path(ready[5]).resolve() == REPO_ROOT
    purelib = Path(node_env.sysconfig.get_path("purelib", scheme="venv",
                                               vars={"base": str(target),
                                                     "platbase": str(target)}))
    assert not (purelib / "torch").exists() and not (purelib / "numpy").exists()
