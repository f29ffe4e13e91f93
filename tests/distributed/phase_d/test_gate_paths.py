"""The default run's variants for the paths it did not run before: a change
planted in each path fails the gate, in a real run (``run_all`` on every rank,
``gate_tasks.mutation``).

- ``dmuon-z2[nccl+largest]``: the aligned all_gather / reduce_scatter form NCCL jobs run
  (``link="nccl"``: no reduce by gather; the largest Muon targets, one equal share per owner).
  W = 2 (two equal shares per owner) is the cheapest world that shows it.
- ``dmuon-hsdp-z3[block+hierarchical]``: the per-owner replicate-axis reduce and broadcast
  (one bucket per owner per block on the 2 x 2 mesh), W = 4.

Each negative control runs the same mutation on the modes the default run had before these
variants: the gate PASSes there, which is why the variants were added (without them the
planted change goes unnoticed, so each ``*_caught`` test fails without its variant).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
import pytest

from tests.distributed.phase_d import gate_tasks
from verify.report.checks import final_line
from verify.run.main import parse_args

pytestmark = pytest.mark.distributed

ALIGNED = "dmuon-z2[nccl+largest]"
REPLICATE = "dmuon-hsdp-z3[block+hierarchical]"


def _report(pool, mutated: str, modes: tuple[str, ...], out_dir: str | None = None) -> dict:
    out_dir = out_dir or tempfile.mkdtemp(prefix="dmuon-gate-")
    return pool.run_with_timeout(240, gate_tasks.gate, out_dir, modes, mutated,
                                 numerics=mutated == "none")[0]


def _failed(report: dict) -> dict[tuple[str, str], str]:
    return {(f["mode"], f["check"]): f["detail"] for f in report["failures"]}


def test_default_run_has_the_new_variants():
    modes = parse_args(["--out-dir", "x"]).modes.split(",")
    assert ALIGNED in modes and REPLICATE in modes


def test_aligned_variant_runs_nccl_calls_and_passes(pool2):
    """Clean: the variant's DMuon calls are the aligned all_gather and the real
    reduce_scatter (not gloo's all_to_all), and every gate holds."""
    out = tempfile.mkdtemp(prefix="dmuon-gate-")
    report = _report(pool2, "none", (ALIGNED,), out)
    assert report["pass"], final_line(report)
    events = pd.read_parquet(Path(out) / ALIGNED / "events_rank0.parquet")
    dmuon_ops = events[events["module"] == "blocks.0"].groupby(["phase", "op"]).size().to_dict()
    # one unit (blocks.0): one aligned call per channel and measured step (2 steps)
    assert dmuon_ops == {("forward", "all_gather"): 2, ("backward", "reduce_scatter"): 2}, dmuon_ops


def test_aligned_reduce_scatter_twice_caught(pool2):
    failed = _failed(_report(pool2, "reduce_scatter_twice", (ALIGNED,)))
    detail = failed[(ALIGNED, "collectives")]
    assert detail.startswith("+24.1% bytes, 1.25× calls (10 vs 8 per step)"), detail


@pytest.mark.slow  # the negative control of the plant beside it
def test_aligned_reduce_scatter_twice_passes_the_old_default_modes(pool2):
    """Negative control: gloo's own modes never call a reduce_scatter of DMuon's."""
    report = _report(pool2, "reduce_scatter_twice", ("dmuon-z2", "dmuon-z3[block]"))
    assert report["pass"], final_line(report)


def test_link_policy_ignored_caught(pool2):
    """The runtime reduces by gather although link='nccl' says not to: same bytes, other
    calls (an all_to_all where the prediction has a reduce_scatter)."""
    failed = _failed(_report(pool2, "link_ignored", (ALIGNED,)))
    detail = failed[(ALIGNED, "collectives")]
    assert detail.startswith("same bytes, 1× calls (8 vs 8 per step); 4 missing and 4 unexpected"), detail


@pytest.mark.slow  # the replicate-axis plant in make test: the reduce sent to the wrong rank
def test_replicate_broadcast_twice_caught(pool4):
    report = _report(pool4, "replicate_broadcast_twice", (REPLICATE,))
    detail = _failed(report)[(REPLICATE, "collectives")]
    assert detail.startswith("+10.8% bytes, 1.12× calls (108 vs 96 per step); 0 missing and 24 "
                             "unexpected"), detail
    assert detail.endswith("(phases: replicate)"), detail


def test_replicate_reduce_to_wrong_rank_caught(pool4):
    """Same bytes and calls, other roots: the owners check names the param and the rank."""
    failed = _failed(_report(pool4, "replicate_reduce_to_0", (REPLICATE,)))
    assert failed[(REPLICATE, "collectives")].startswith("same bytes, 1× calls (96 vs 96 per step)")
    assert ("owner of blocks.1.mlp.fc1.weight: expected rank 2, traffic shows rank 0 (backward gather)"
            in failed[(REPLICATE, "owners")]), failed


@pytest.mark.slow
def test_replicate_mutations_pass_the_old_hierarchical_variant(pool4):
    """Negative control: the aligned hierarchical variant moves the replicate axis by
    all_to_alls, never by a per-owner broadcast or reduce."""
    report = _report(pool4, "replicate_broadcast_twice", ("dmuon-hsdp-z3[hierarchical]",))
    assert report["pass"], final_line(report)
