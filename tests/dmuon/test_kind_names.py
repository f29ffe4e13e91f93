"""Only ``dmuon/placement/`` knows the kinds of dedicated params and the names of mesh dims: the
runtime, the optimizer, the ownership planner and the API ask a param's ``Placement`` and the
mesh layout, so no code outside that package names a model-parallel kind or axis (``tp``,
``ep``, ``cp``, ``TP_AXIS``, a ``tp_size``, a ``TPShard``, a string ``"tp"``...). Read from the
code (identifiers and string constants, docstrings excepted: prose may describe the kinds).
``dmuon/integrations/`` is exempt: an integration translates a client's own mesh dim names
(torchtitan's ``dp_replicate``, ``fsdp``, ``tp``, ``ep``...) into the dims DMuon is told
(``replicate_dim``, ``shard_dims``, model-parallel dims), and the runtime never reads them."""

import ast
import re
from pathlib import Path

DMUON = Path(__file__).resolve().parents[2] / "dmuon"

#: The parallel kinds and axes by name: model parallel ones, and torchtitan's dims.
KINDS = "tp|ep|cp|pp|efsdp|dp_shard|dp_replicate|dp_shard_cp"
#: An identifier naming one: ``tp``, ``tp_size``, ``is_ep_mesh``, ``TP_AXIS``, ``TPShard``.
IDENT = re.compile(rf"(?i:(?:^|_)(?:{KINDS})(?:_|$|\d))|(?:^|[a-z_])(?:TP|EP|CP)(?=[A-Z][a-z]|$)")
#: A string naming one as a word: ``"tp"``, ``mesh['ep']``, ``"a TP shard"``.
TEXT = re.compile(rf"(?i)(?<![\w-])(?:{KINDS})(?![\w-])")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def named_kinds(source: str, name: str) -> list[str]:
    """``name:line: what`` for every identifier or string constant of ``source`` that names a
    parallel kind or axis."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    bad = []
    for node in ast.walk(tree):
        idents = []
        if isinstance(node, ast.Name):
            idents = [node.id]
        elif isinstance(node, ast.Attribute):
            idents = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            idents = [node.name]
        elif isinstance(node, ast.arg):
            idents = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            idents = [node.arg]
        elif isinstance(node, ast.alias):
            idents = [node.name.rpartition(".")[2], node.asname or ""]
        elif isinstance(node, ast.ImportFrom) and node.module:
            idents = node.module.split(".")
        for ident in idents:
            if ident and IDENT.search(ident):
                bad.append(f"{name}:{node.lineno}: {ident}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if TEXT.search(node.value):
                bad.append(f"{name}:{node.lineno}: {node.value[:60]!r}")
    return bad


def test_no_kind_or_axis_name_outside_the_placement_package():
    bad = []
    for path in sorted(DMUON.rglob("*.py")):
        if {"placement", "integrations"} & set(path.relative_to(DMUON).parts):
            continue
        bad += named_kinds(path.read_text(), str(path.relative_to(DMUON)))
    assert bad == []


def test_the_check_sees_each_way_of_naming_a_kind():
    """The control: each way a kind's name came into the runtime before is caught."""
    planted = {
        "from dmuon.placement.tp import TP_AXIS": 2,  # the module and the constant
        "def f(p, tp_size=1): pass": 1,
        "x.tp_index = dm.layout.index": 1,
        "groups.tp.rank()": 1,
        "class TPShard: pass": 1,
        "is_ep_mesh(mesh)": 1,
        "names = ('shard', 'tp')": 1,
        "raise ValueError(f'no {n} on mesh[\"ep\"]')": 1,
        "m = mesh['dp_shard']": 1,
    }
    for source, count in planted.items():
        assert len(named_kinds(source, "planted")) == count, source
    clean = ('def step(ctx, params):\n    """Gathers TP shards over mesh["tp"]."""\n'
             '    return ctx.groups[key], "optimizer step", STEP_ORDER, keep, deep_copy\n')
    assert named_kinds(clean, "clean") == []
