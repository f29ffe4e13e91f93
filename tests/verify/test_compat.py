"""The harness runs on torch 2.11 through the newest: every call to a
name newer than 2.11 goes through a fallback (``verify._compat``, DMuon's in
``dmuon.runtime.collectives``). On 2.11 a direct ``dist.all_gather_single(...)`` raised
AttributeError in every zero1 / TP baseline of verify-traffic; these tests catch such a call
on the pinned torch, where it would work."""

import ast
import importlib
from pathlib import Path

import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]
#: torch.distributed names torch 2.11 lacks (2.13 added them).
NEWER_ONLY = ("all_gather_single", "reduce_scatter_single")


def test_no_module_calls_a_torch_name_2_11_lacks_directly():
    """Fails before ``verify._compat``: verify/modes/baselines.py and verify/modes/tp.py called
    ``dist.all_gather_single`` / ``dist.reduce_scatter_single``."""
    direct = []
    for path in sorted(p for pkg in ("dmuon", "tracer", "verify")
                       for p in (REPO_ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in NEWER_ONLY
                    and isinstance(node.value, ast.Name) and node.value.id == "dist"):
                direct.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} dist.{node.attr}")
    assert direct == []


def test_fallbacks_take_the_older_names_where_torch_lacks_the_new(monkeypatch):
    """Torch 2.11 as a stand-in: the new names removed, the module picks the older ones."""
    import verify._compat as compat

    for name in NEWER_ONLY:
        monkeypatch.delattr(dist, name, raising=False)
    try:
        importlib.reload(compat)
        assert compat.all_gather_single is dist.all_gather_into_tensor
        assert compat.reduce_scatter_single is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(compat)
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13: the new, non-deprecated names
        assert compat.all_gather_single is dist.all_gather_single
        assert compat.reduce_scatter_single is dist.reduce_scatter_single
