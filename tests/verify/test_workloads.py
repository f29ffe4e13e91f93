"""``verify.modes.workloads.workload_of``: the parallel degrees above 1 select exactly one
workload, refusals name the flags and the sets that run; a workload's fixed flags come from
its class attributes (``Workload.usage_problem``). No processes."""

from types import SimpleNamespace

import pytest

from verify.modes.workload import AXES, Workload
from verify.modes.workloads import workload_of, workloads
from verify.workload.usermodel import BUILTIN


def cfg(**degrees):
    base = dict(tp=1, ep=1, pp=1, cp=1, model=BUILTIN, qk_clip=None, mixed_precision=None,
                hierarchy="auto", rest="wrapper")
    return SimpleNamespace(**{**base, **degrees})


def test_each_workload_has_its_own_set_of_degrees_and_every_axis_runs_alone():
    sets = [tuple(sorted(w.axes)) for w in workloads()]
    assert len(sets) == len(set(sets)) and () in sets
    assert all((a,) in sets for a in AXES)


@pytest.mark.parametrize("axis", AXES)
def test_one_degree_above_1_selects_its_workload(axis):
    assert workload_of(cfg(**{axis: 2})).axes == (axis,)
    assert type(workload_of(cfg())) is Workload  # every degree 1: the dense one


def test_degrees_no_workload_runs_together_are_refused_with_the_sets_that_run():
    with pytest.raises(ValueError, match=r"--pp 2 and --cp 2 do not run together\. .*--tp \| --ep"):
        workload_of(cfg(pp=2, cp=2))
    with pytest.raises(ValueError, match=r"Invalid --ep 0\. Must be >= 1"):
        workload_of(cfg(ep=0))


def test_a_workload_names_the_flag_it_runs_without_and_why():
    tp = workload_of(cfg(tp=2))
    assert tp.usage_problem(cfg(tp=2)) is None
    assert tp.usage_problem(cfg(tp=2, rest="replicate")) == (
        f"--tp 2 runs without --rest replicate: {tp.rest_why}.")
    ep = workload_of(cfg(ep=2))
    assert ep.usage_problem(cfg(ep=2, rest="wrapper")) is None  # EP runs its own rest
    assert ep.usage_problem(cfg(ep=2, mixed_precision="bf16")).startswith(
        "--ep 2 runs without --mixed-precision bf16:")
    assert Workload().usage_problem(cfg(model="gpt2-small", hierarchy="flat")) is None
    with pytest.raises(ValueError, match="Invalid RunConfig: --ep 2 runs without --hierarchy flat"):
        ep.check(cfg(ep=2, hierarchy="flat"))


def test_tp_and_ep_together_select_the_tp_x_ep_workload():
    """--tp with --ep is the TP x EP run (verify/modes/tpep.py): its mesh, modes and fixed flags."""
    from verify.modes.tpep import TPEPWorkload

    both = workload_of(cfg(tp=2, ep=2))
    assert type(both) is TPEPWorkload and both.flags(cfg(tp=2, ep=2)) == "--tp 2 --ep 2"
    assert both.usage_problem(cfg(tp=2, ep=2)) is None
    assert both.usage_problem(cfg(tp=2, ep=2, rest="replicate")).startswith(
        "--tp 2 --ep 2 runs without --rest replicate:")
    assert both.mesh_problem(4, cfg(tp=2, ep=2), global_batch=8, seq_len=64) is None
    assert "E·T = 4 must divide W" in both.mesh_problem(6, cfg(tp=2, ep=2), global_batch=12, seq_len=64)
    assert both.skip_reasons(["dmuon-z2", "dmuon-z3", "dmuon-ddp"], 4, cfg(tp=2, ep=2)) == {
        "dmuon-ddp": "no TP x EP variant (--tp with --ep runs dmuon-z2, dmuon-z3)"}
