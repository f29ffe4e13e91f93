"""The harness asks a layout kind or a workload, never a parallel degree: outside each kind's
own modules (``verify/{modes,traffic,plan}/<kind>.py``), no code of ``verify/`` compares a
degree (``tp``, ``ep``, ``pp``, ``cp``; ``config.tp > 1``, ``args.ep == 1``, ``tp > 1``). The
launcher, the workers and the runner ask ``verify.modes.workloads.workload_of``; the predictor
asks the ``RunLayout`` subclass (docs/verify.md, "Layout kinds"). Read from the code (ast)."""

import ast
from pathlib import Path

VERIFY = Path(__file__).resolve().parents[2] / "verify"

#: The parallel degrees, as the CLI and ``RunConfig`` name them.
DEGREES = {"tp", "ep", "pp", "cp"}
#: Each kind's own modules may compare its degree: ``<folder>/<kind>.py``, TP x EP's included.
KIND_STEMS = DEGREES | {"tpep"}


def _names_degree(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in DEGREES) or \
        (isinstance(node, ast.Name) and node.id in DEGREES)


def degree_branches(source: str, name: str) -> list[str]:
    """``name:line: text`` of every comparison in ``source`` with a parallel degree as an operand."""
    return [f"{name}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and any(map(_names_degree, [node.left, *node.comparators]))]


def test_the_check_finds_a_branch_on_a_degree():
    planted = "if config.tp > 1 and args.ep == 1:\n    pass\nif tp > 1:\n    pass\n"
    assert len(degree_branches(planted, "x.py")) == 3
    assert degree_branches("if workload.whole_model and world % n:\n    pass\n", "x.py") == []


def test_no_module_outside_the_kinds_branches_on_a_parallel_degree():
    found = []
    for path in sorted(VERIFY.rglob("*.py")):
        if path.stem in KIND_STEMS:
            continue
        found += degree_branches(path.read_text(), str(path.relative_to(VERIFY.parent)))
    assert not found, ("branches on a parallel degree outside the kinds' modules (ask the layout "
                       "kind or verify.modes.workloads.workload_of instead):\n" + "\n".join(found))
