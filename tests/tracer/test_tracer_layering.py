"""Layering and fast start: ``tracer/`` imports neither ``dmuon`` nor
``verify``, and nothing but the interposer imports torch; a ``dmuon-trace`` parse leaves torch
out of ``sys.modules``. Each check runs in a fresh interpreter (this one has torch loaded)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("dmuon", "verify", "torch")
#: Tracer modules allowed to import torch (it hooks torch.distributed): not dmuon/verify.
NEEDS_TORCH = {"tracer.interposer"}


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter at the repo root; it prints one JSON line."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tracer_modules() -> list[str]:
    return sorted(f"tracer.{p.stem}" for p in (REPO / "tracer").glob("*.py") if p.stem != "__init__")


def test_tracer_modules_import_neither_dmuon_nor_verify_nor_torch():
    modules = _tracer_modules()
    assert "tracer.context" in modules and "tracer.cli" in modules
    # Imports only add modules, so checking after each import in turn pins the culprit.
    code = f"""
import importlib, json, sys
found = {{}}
for name in {[m for m in modules if m not in NEEDS_TORCH]!r}:
    importlib.import_module(name)
    found[name] = sorted({{m.split('.')[0] for m in sys.modules}} & {set(FORBIDDEN)!r})
print(json.dumps(found))
"""
    for name, bad in _fresh(code).items():
        assert not bad, f"{name} pulled in {bad}"


def _imported_roots(path: Path) -> set[str]:
    """Top-level packages named by every import statement in ``path`` (lazy ones included)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_every_tracer_module_names_neither_dmuon_nor_verify():
    """Statically, so the torch-importing interposer is covered without importing torch; also
    catches imports inside functions that the import check above cannot reach."""
    for path in sorted((REPO / "tracer").glob("*.py")):
        bad = _imported_roots(path) & {"dmuon", "verify"}
        assert not bad, f"{path.name} imports {bad}"
    assert "torch" in _imported_roots(REPO / "tracer" / "interposer.py")


def test_dmuon_annotate_uses_the_tracer_context():
    from dmuon import annotate
    from tracer import context

    assert annotate.Span is context.Span and annotate._listeners is context._listeners
    seen = []
    annotate.add_span_listener(seen.append)
    try:
        with annotate.phase("forward"), annotate.span("dmuon.x", module="m", owner=1):
            assert context.current_phase() == "forward" and context.current_span() == ("dmuon.x", "m")
    finally:
        annotate.remove_span_listener(seen.append)
    assert [(s.name, s.module, s.owner, s.phase) for s in seen] == [("dmuon.x", "m", 1, "forward")]
    assert context.current_phase() is None and context.current_span() is None


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["nccl", "{fixtures}/nccl/nccl_coll_allreduce_tf_2gpu__nccl_issue203.log", "--out", "{tmp}/n.parquet"],
    ["fr", "{fixtures}/flight_recorder", "--out", "{tmp}/f.parquet"],
    ["nsys", "{fixtures}/nsys/nsys2026.2_h100_2gpu_nccl_sendrecv__nsys-ai_mfu_2gpu_after.sqlite",
     "--out", "{tmp}/s.parquet"],
])
def test_a_parse_leaves_torch_dmuon_verify_unimported(shared_fixtures, tmp_path, argv):
    argv = [a.format(fixtures=shared_fixtures, tmp=tmp_path) for a in argv]
    code = f"""
import contextlib, io, json, sys
from tracer.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        rc = main({argv!r})
    except SystemExit as exc:
        rc = exc.code
print(json.dumps({{"rc": rc, "loaded": sorted({{m.split('.')[0] for m in sys.modules}} & {set(FORBIDDEN)!r})}}))
"""
    result = _fresh(code)
    assert result == {"rc": 0, "loaded": []}
