"""DMuon under pipeline parallelism (``pp_tasks.py``): each stage module dedicated on its
stage's ``mesh["dp_shard"]`` slice of a ``("pp", "dp_shard")`` mesh, torch's schedules run
inside ``dmuon.pipeline_step``, at W = 4 on gloo (2 stages x 2 data-parallel ranks; the
interleaved schedule: 4 virtual stages on the 2 pipeline ranks, one DMuon over both parts).

Parity: after STEPS = 2 steps of M = 2 micro-batches every param lands within the bound of the
single-process oracle's measured noise floor (``noise_floor``: the oracle on the whole batch
against its nudged runs; Frobenius, times FACTOR). The control of each schedule (one pipeline
rank never steps) must land beyond it. Traffic: Z3 inside a pipeline step moves exactly Z2's
calls, and each dedicated grad is reduced once per step (the calls of one plain backward); the
control (Z3 freeing after every micro-batch, as outside a pipeline step) moves more.
"""

import pytest
import torch

from tests.distributed import noise_floor as NF
from tests.distributed.parity import pp_tasks as P

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120
STEPS = 2


@pytest.fixture(scope="module")
def oracle():
    """(init, the oracle's params after STEPS steps, its noise floor)."""
    init = P.make_model().state_dict()
    ref = NF.floored(lambda nudge: NF.final_only(init, P.oracle(STEPS, nudge=nudge)), norm="fro")
    return init, ref["final"], ref["floors"][0]


def _dist(params: dict, init: dict, ref: dict) -> dict[str, float]:
    return NF.distances(params, ref, init, names=list(params), norm="fro")


def _check(pool, oracle, schedule: str, z3: bool, layout: str = "dp") -> None:
    init, ref, floor = oracle
    results = pool.run_with_timeout(TIMEOUT_S, P.train, schedule, STEPS, z3, None, layout)
    if layout.startswith("hsdp/"):
        assert all(r["flat"] == (layout == "hsdp/flat") for r in results)
    seen = set()
    for r in results:
        NF.assert_within(_dist(r["params"], init, ref), floor, f"{schedule} z3={z3} stages {r['stages']}")
        seen |= set(r["params"])
    assert seen == set(ref), "every param of the model is in some stage"
    # the control: pipeline rank 1 (stages 1, and 3 when interleaved) never steps
    planted = pool.run_with_timeout(TIMEOUT_S, P.train, schedule, STEPS, z3, 1, layout)
    skipped = {n: d for r in planted if 1 in r["stages"] for n, d in _dist(r["params"], init, ref).items()}
    NF.assert_beyond({"worst of the skipped stage": min(skipped.values())}, floor, "stage 1 skipped")


@pytest.mark.parametrize("schedule,z3", [("gpipe", True), pytest.param("1f1b", False, marks=pytest.mark.slow),
                                         ("interleaved", False)])
def test_schedules_land_on_the_whole_batch_oracle(pool4, oracle, schedule, z3):
    _check(pool4, oracle, schedule, z3)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,z3", [("gpipe", False), ("1f1b", True), ("interleaved", True)])
def test_schedules_land_on_the_oracle_in_the_other_mode(pool4, oracle, schedule, z3):
    _check(pool4, oracle, schedule, z3)


@pytest.mark.slow
@pytest.mark.parametrize("hierarchy", ["flat", "hierarchical"])
def test_hsdp_stages_land_on_the_oracle(pool4, oracle, hierarchy):
    """Each stage an HSDP slice mesh["dp_replicate", "dp_shard"] of a (2, 2, 1) mesh (R = 2,
    N = 1), moved flat (the stage's 2 ranks as one shard axis) or hierarchically."""
    _check(pool4, oracle, "gpipe", True, f"hsdp/{hierarchy}")


def test_z3_keeps_copies_for_the_step_and_reduces_once(pool4):
    """Z3 inside a pipeline step issues Z2's calls (a forward broadcast of the stage's
    matrices, one reduce), the reduces of one plain backward: once per step, not per
    micro-batch. The control (non-holders free after each micro-batch) re-broadcasts."""
    z2 = pool4.run_with_timeout(TIMEOUT_S, P.step_traffic, "gpipe", False)
    z3 = pool4.run_with_timeout(TIMEOUT_S, P.step_traffic, "gpipe", True)
    for a, b in zip(z2, z3):
        assert a["events"] == b["events"]
        assert not [e for e in b["events"] if e[0] in P.BROADCASTS and e[1] == "backward"]
        assert [e for e in b["events"] if e[0] in P.REDUCES] == b["reference_reduces"]
        assert b["reference_reduces"]
    planted = pool4.run_with_timeout(TIMEOUT_S, P.step_traffic, "gpipe", True, False)
    for a, b in zip(z3, planted):
        assert len([e for e in b["events"] if e[0] in P.BROADCASTS]) > len(
            [e for e in a["events"] if e[0] in P.BROADCASTS])


def test_stages_set_up_and_train_without_waiting_for_each_other(pool4):
    """Stage 1 starts only after stage 0 has set up DMuon, built its optimizer and stepped:
    a world-wide call anywhere there would hang (timeout). DMuon's groups are the stage's."""
    groups = pool4.run_with_timeout(60, P.stages_never_wait)
    for rank, g in enumerate(groups):
        stage = [0, 1] if rank < 2 else [2, 3]
        assert g == {"reduce": stage, "world": stage}


def test_without_stage_slices_the_sub_mesh_is_refused(pool4):
    """The control of the test above: with stage slices not recognised, the same mesh is
    refused by the whole-world rule (its error on every rank, no hang)."""
    texts = pool4.run_with_timeout(60, P.plain_sub_mesh_error)
    assert all("must equal the world size 4" in t for t in texts), texts


#: The cases the default suite runs (the others: ``-m slow``).
DEFAULT_ERRORS = ("stage_without_matrix", "mismatched_parts", "mesh_across_stages", "not_a_schedule")

ERRORS = {
    "stage_without_matrix": (("", "", "ValueError", "ValueError"), "no dedicated matrix"),
    "mismatched_parts": (("ValueError",) * 4, "mismatched stage meshes"),
    "mesh_across_stages": (("ValueError",) * 4, "the dim 'pp' is pipeline parallel"),
    "dynamic_stage": (("ValueError",) * 4, "built without input_args and output_args"),
    "foreign_stage": (("ValueError",) * 4, "has no DedicatedParams among the 1 given"),
    "not_a_schedule": (("ValueError",) * 4, "DMuon cannot see its micro-batches"),
    "empty_parts": (("ValueError",) * 4, "Invalid dedicated=[] (no handle)"),
    "lr_mismatch": (("RuntimeError", "RuntimeError", "", ""), "differs across the ranks of this pipeline stage"),
    "repeated_part": (("ValueError",) * 4, "the handle at index 1 is also at index 0"),
}


@pytest.mark.parametrize("case", [c if c in DEFAULT_ERRORS else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(ERRORS)])
def test_bad_pipeline_setup_raises_on_every_rank_of_the_stage(pool4, case):
    kinds, text = ERRORS[case]
    for rank, (kind, message) in enumerate(zip(kinds, pool4.run_with_timeout(60, P.error_case, case))):
        if not kind:
            assert message == "", (rank, message)
        else:
            assert message.startswith(kind) and text in message, (rank, message)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_dcp_checkpoint_resumes_at_another_data_parallel_size(pool4, pool2, oracle, tmp_path, schedule):
    """Save after step 1 at 2 stages x 2 data-parallel ranks, resume at 2 stages x 1: the
    loaded params are the saved ones, and the resumed run lands on the oracle after step 2
    (interleaved: one optimizer over each rank's two parts)."""
    init, ref, floor = oracle
    root = str(tmp_path / "ckpt")
    saved = pool4.run_with_timeout(TIMEOUT_S, P.dcp_save, root, 1, schedule)
    resumed = pool2.run_with_timeout(TIMEOUT_S, P.dcp_resume, root, 1, STEPS, schedule)
    by_stage = {0: saved[0]["params"], 1: saved[2]["params"]}
    for stage, r in enumerate(resumed):
        assert set(r["loaded"]) == set(by_stage[stage])
        for n, t in r["loaded"].items():
            assert torch.equal(t, by_stage[stage][n]), n
        NF.assert_within(_dist(r["params"], init, ref), floor, f"resumed stage {stage}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_clip_grad_norm_with_pipeline_group_is_the_whole_models_norm(pool4, schedule):
    """``opt.clip_grad_norm_(..., pipeline_group=...)`` returns the oracle's norm of every grad of
    the model, on every rank (bound: the oracle's nudged norms, ``noise_floor.scalar_floors``);
    the control (no ``pipeline_group``: each stage's own norm) lands beyond it."""
    want = P.oracle_total()
    floor = NF.scalar_floors([want], {n: [P.oracle_total(n)] for n in NF.NUDGES})[0]
    got = pool4.run_with_timeout(TIMEOUT_S, P.clip_total, schedule)
    for total in got:
        assert abs(total - want) / want <= floor.bound, (got, want, str(floor))
    planted = pool4.run_with_timeout(TIMEOUT_S, P.clip_total, schedule, False)
    assert all(abs(t - want) / want > floor.bound for t in planted), (planted, want)
