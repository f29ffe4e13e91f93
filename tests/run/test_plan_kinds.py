"""dmuon-plan's parallel kinds (verify/plan/kind.py): the CLI composes its checks and sections
from the kinds' table alone (a kind added to the table is checked, planned and printed with no
change to the CLI), the first kind in the check order whose rule fails gives the one error
line, and the CLI holds no per-kind branch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import verify.plan.cli as cli
from verify.plan.args import MAX_WORLD_SIZE
from verify.plan.kind import PlanKind


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["--model", "llama-tiny", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


class _Nodes(PlanKind):
    """A made-up kind on an existing flag (--gpus-per-node G): the table is the mesh (R, N·G),
    it refuses --sweep, W = G·R·N."""

    flag = "gpus_per_node"
    world_formula = "G·R·N"
    world_fix = "; give a smaller G."

    def refusal(self, args):
        return self._with(args, "--sweep", "Give --mesh.") if args.sweep else None

    def table_mesh(self, args, mesh):
        return mesh[0], mesh[1] * self.degree(args)

    def section(self, ctx):
        return {"g": self.degree(ctx.args), "mesh": list(ctx.mesh), "table_mesh": list(ctx.table_mesh)}

    def format(self, section):
        return f"nodes section: g = {section['g']}"


@pytest.fixture
def with_nodes(monkeypatch):
    kind = _Nodes()
    monkeypatch.setattr(cli, "KINDS", (*cli.KINDS, kind))
    monkeypatch.setattr(cli, "CHECK_ORDER", (*cli.CHECK_ORDER, kind))
    return kind


def test_a_kind_in_the_table_is_checked_planned_and_printed(with_nodes, capsys):
    rc, out, _ = _run(capsys, "--mesh", "2", "--gpus-per-node", "2", "--json")
    assert rc == 0
    rep = json.loads(out)["reports"][0]
    assert rep["gpus_per_node"] == {"g": 2, "mesh": [1, 2], "table_mesh": [1, 4]}
    assert rep["mesh"] == {"replicate": 1, "shard": 4}  # the table on the kind's mesh
    rc, out, _ = _run(capsys, "--mesh", "2", "--gpus-per-node", "2")
    assert rc == 0 and out.rstrip().endswith("nodes section: g = 2")
    # the control: degree 1 is no kind (no section, the table on --mesh)
    rc, out, _ = _run(capsys, "--mesh", "2", "--gpus-per-node", "1", "--json")
    rep = json.loads(out)["reports"][0]
    assert "gpus_per_node" not in rep and rep["mesh"] == {"replicate": 1, "shard": 2}


def test_a_kind_in_the_table_refuses_and_bounds_w(with_nodes, capsys):
    rc, _, err = _run(capsys, "--sweep", "--gpus-per-node", "2")
    assert rc == 2 and err == "dmuon-plan: Invalid --gpus_per_node 2 with --sweep. Give --mesh.\n"
    rc, _, err = _run(capsys, "--mesh", "1024x1024", "--gpus-per-node", "2")
    assert rc == 2 and err == (f"dmuon-plan: Invalid --gpus_per_node 2 on mesh 1024x1024: W = G·R·N = "
                               f"{2 * 1024 * 1024:,} ranks. Must be at most {MAX_WORLD_SIZE:,}; give a smaller G.\n")


@pytest.mark.parametrize("argv, first", [
    # --pp is checked before --cp and --ep: its rule gives the line, though theirs fail too
    (["--sweep", "--cp", "2", "--pp", "2"], "Invalid --pp 2 with --sweep or no --mesh."),
    (["--mesh", "1024x1024", "--pp", "2", "--cp", "2"], "Invalid --pp 2 on mesh 1024x1024: W = S·R·N ="),
    (["--mesh", "1024x512", "--pp", "4", "--ep", "2"], "Invalid --pp 4 with --ep."),
    # --cp before --ep; --ep's bound before --tp's
    (["--mesh", "4", "--cp", "2", "--ep", "2"], "Invalid --cp 2 with --ep."),
    (["--mesh", "1024x1024", "--ep", "2", "--tp", "2"], "Invalid --ep 2 on mesh 1024x1024 --tp 2: W = R·N·E·T ="),
    (["--mesh", "1024x1024", "--tp", "2"], "Invalid --tp 2 on mesh 1024x1024: W = R·N·T"),
])
def test_the_first_kind_in_the_check_order_gives_the_error(argv, first, capsys):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and err.startswith(f"dmuon-plan: {first}") and err.count("\n") == 1


def test_every_kind_is_in_both_orders_once():
    flags = [k.flag for k in cli.KINDS]
    assert sorted(flags) == sorted(k.flag for k in cli.CHECK_ORDER) == sorted(set(flags))
    assert flags == ["tp", "ep", "pp", "cp"]  # the sections' order in the report


#: A per-kind branch: a comparison of a kind's degree, or a section looked up by its key.
_BRANCH = re.compile(r"args\.(tp|ep|pp|cp)\s*(>|<|==|!=)|[\"'](tp|ep|pp|cp)[\"']\s+in\b|\b(tp|ep|pp|cp)_report\(")


def test_the_cli_has_no_per_kind_branch():
    text = Path(cli.__file__).read_text()
    assert _BRANCH.findall(text) == []
    # the control: the branches the CLI would hold without the kinds are found
    planted = 'if args.tp > 1:\n    x = 1\nif "ep" in reports[0]:\n    y = cp_report(m)\n'
    assert len(_BRANCH.findall(planted)) == 3
