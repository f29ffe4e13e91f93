"""``import dmuon`` (and every ``dmuon.*`` module) loads no presentation or dataframe library:
a training script pays for torch and DMuon only. Tables and plots belong
to the CLI side (``verify/``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

#: Libraries the runtime must not pull in (the trace tools use them, DMuon does not).
HEAVY = ("tabulate", "pandas", "pyarrow", "matplotlib")

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib, json, pkgutil, sys
import dmuon
names = [m.name for m in pkgutil.walk_packages(dmuon.__path__, "dmuon.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_import_dmuon_loads_no_presentation_or_dataframe_library():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, cwd=REPO_ROOT, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "dmuon.ownership.plan" in got["modules"] and "dmuon.runtime.runtime" in got["modules"]
    assert [m for m in HEAVY if m in got["loaded"]] == []


#: The optional packages (pyproject's extras ``gpu``, ``plots``, ``test``, ``torchtitan``) by
#: import name.
OPTIONAL = ("nvtx", "pynvml", "matplotlib", "transformers", "torchtitan")

BLOCKED_SCRIPT = """
import importlib, importlib.abc, json, pkgutil, sys
BLOCKED = %r

class Block(importlib.abc.MetaPathFinder):
    # a machine without the optional packages: importing one (or a submodule) fails
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)

sys.meta_path.insert(0, Block())
import dmuon, tracer
names = [m.name for pkg in (dmuon, tracer)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
from dmuon import annotate
from tracer.nvml import NvlinkSampler
out = {"modules": names, "loaded": sorted({m.split(".")[0] for m in sys.modules}),
       "nvtx_on": annotate.nvtx_enabled()}
try:
    annotate.set_nvtx_enabled(True)
except ValueError as exc:
    out["nvtx"] = str(exc)
sampler = NvlinkSampler()
sampler.start()
out["nvml"] = sampler.stop().reason
try:
    importlib.import_module("verify.report.plots")
except ModuleNotFoundError as exc:
    out["plots"] = str(exc)
print(json.dumps(out))
"""


def test_dmuon_and_tracer_import_without_the_optional_packages():
    """With nvtx, pynvml, matplotlib, transformers and torchtitan unimportable (a meta-path finder raises
    for them), every ``dmuon.*`` and ``tracer.*`` module imports, and each feature that needs
    one says which package and the pip command. Fails if any module imports one at module
    level unguarded, or a message stops naming the package (the report's plots named neither
    the package nor pip before ``tracer._compat.require``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", BLOCKED_SCRIPT % (OPTIONAL,)], capture_output=True,
                         text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "tracer.nvml" in got["modules"] and "dmuon.annotate" in got["modules"]
    assert [m for m in OPTIONAL if m in got["loaded"]] == []
    assert got["nvtx_on"] is False
    assert "pip install 'nvtx'" in got["nvtx"]
    assert "nvidia-ml-py" in got["nvml"]
    assert "'matplotlib'" in got["plots"] and "pip install 'matplotlib'" in got["plots"]
    assert ".[plots]" in got["plots"]
