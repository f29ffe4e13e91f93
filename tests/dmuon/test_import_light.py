"""``import dmuon`` (and every ``dmuon.*`` module) loads no presentation or dataframe library:
a training script pays for torch and DMuon only (issue 17, item 6). Tables and plots belong
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
    assert "dmuon.ownership.plan" in got["modules"] and "dmuon.runtime.hooks" in got["modules"]
    assert [m for m in HEAVY if m in got["loaded"]] == []
