"""``verify-traffic --model pkg:factory`` at W=2 on the model structures of
(``examples/experts.py``, ``examples/structures.py``): 3-D expert stacks inside P_M with the
closed forms unchanged, a block run twice per forward (weight sharing: Z3 and FSDP2 send it
again, the P_M^r term), a plain MLP as an ``nn.ModuleList`` of bare ``nn.Linear`` (the naive
FSDP2 mode wraps each Linear once) and a conv net. Each run trains 2 + 2 steps per mode; the
default set runs the modes that exercise each structure, ``slow`` all of them."""

import pytest

from tests.distributed.phase_d import record_tasks
from verify.report.render import format_markdown
from verify.traffic.formulas import MODES

pytestmark = pytest.mark.distributed

TIMEOUT_S = 240
W2_MODES = tuple(m for m in MODES if "hsdp" not in m)


def _run(pool, tmp_path, modes, model, coalesce="auto"):
    report = pool.run_with_timeout(TIMEOUT_S, record_tasks.run_user_model, str(tmp_path), tuple(modes),
                                   model, False, coalesce)[0]
    assert report["pass"], [(r["mode"], r["missing"][:3], r["unexpected"][:3], r["loss_first"], r["loss_last"],
                             r["closed_form_matches"], {k: s["pass"] for k, s in r["sources"].items()}) for r in report["runs"]
                            if not r["pass"]]
    return report, {r["mode"]: r for r in report["runs"]}


@pytest.mark.parametrize("modes", [("dmuon-z3", "naive-fsdp2-z3", "zero1-muon"),
                                   pytest.param(W2_MODES, marks=pytest.mark.slow)], ids=["some", "all"])
def test_expert_stacks_are_inside_p_m_with_the_closed_forms_unchanged(pool2, tmp_path, modes):
    report, runs = _run(pool2, tmp_path, modes, "examples.experts:factory")
    # P_M = inp 24x20 + 2 layers x (router 5x24 + two 5x24x40 stacks) = 19,920
    assert {r["p_m"] for r in runs.values()} == {19_920}
    assert report["params"]["muon_elems"] == 19_920 and len(report["params"]["muon"]) == 7
    assert [e["name"] for e in report["params"]["adamw"]] == ["norm.weight", "norm.bias",
                                                              "head.weight", "head.bias"]
    # coalesce="auto": P_M's 79,680 fp32 bytes are one unit under gloo's 2 MB target, which Z3
    # keeps from forward into backward (docs/protocol.md step 2): P_M^L = P_M, so
    # 3(N-1)/N - (N-1)/N = 2(N-1)/N = 1.0 at N=2
    assert runs["dmuon-z3"]["p_m_kept"] == runs["dmuon-z3"]["p_m"]
    assert runs["dmuon-z3"]["ratio_to_p_m"] == pytest.approx(1.0)
    assert runs["dmuon-z3"]["closed_form"] == "3(N-1)/N − (N-1)/N·P_M^L"
    # Newton–Schulz per step: inp 1 + 2 x (router 1 + 5 + 5 expert slices), once each
    assert runs["dmuon-z3"]["ns_calls_per_step"] == 23
    assert runs["naive-fsdp2-z3"]["ns_calls_per_step"] == 2 * 23  # every rank, every matrix
    report.update(run_id="experts", created_utc="-")
    md = format_markdown(report)
    assert "## Muon and AdamW params" in md and "stack of 5 (24, 40) matrices (MoELayer)" in md
    assert "d_model" not in report["config"] and "seq_len" not in report["config"]


@pytest.mark.parametrize("modes", [("dmuon-z3", "naive-fsdp2-z2", "naive-fsdp2-z3"),
                                   pytest.param(W2_MODES, marks=pytest.mark.slow)], ids=["some", "all"])
def test_a_block_run_twice_per_forward_is_sent_again_as_predicted(pool2, tmp_path, modes):
    _, runs = _run(pool2, tmp_path, modes, "examples.structures:shared_block")
    block0 = 2 * 50 * 70  # blocks.0's two matrices run twice: P_M^r
    for mode in ("naive-fsdp2-z3", "naive-fsdp2-z2"):
        assert runs[mode]["p_m_reused"] == block0, mode
    # DMuon's coalesce="auto" makes inp, blocks.0 and blocks.1 one unit (15,000 fp32 elements,
    # under gloo's 2 MB), the last one, which Z3 keeps from its forward into the backward
    # (docs/protocol.md step 2): block 0's second run finds it valid and sends nothing,
    # and backward re-broadcasts nothing; forward and backward move P_M once each (Z2's 1.0)
    unit = 20 * 50 + 2 * block0
    assert runs["dmuon-z3"]["p_m_reused"] == 0 and runs["dmuon-z3"]["p_m_kept"] == unit == runs["dmuon-z3"]["p_m"]
    assert runs["dmuon-z3"]["closed_form"] == "3(N-1)/N − (N-1)/N·P_M^L"
    assert runs["dmuon-z3"]["ratio_to_p_m"] == pytest.approx(1.0)
    if "dmuon-z2" in runs:  # Z2 keeps the block between its two runs: nothing sent again
        assert runs["dmuon-z2"]["ratio_to_p_m"] == pytest.approx(1.0)


def test_a_reused_block_is_sent_again_unless_its_unit_is_kept(pool2, tmp_path):
    """shared_block with one unit per block (coalesce="block"): blocks.0 runs twice and is freed
    after its first run, so Z3 broadcasts it again (P_M^r); blocks.1, the last unit, is kept
    from its forward into the backward and not re-broadcast (P_M^L;
    docs/protocol.md steps 2-3)."""
    _, runs = _run(pool2, tmp_path, ("dmuon-z3",), "examples.structures:shared_block", coalesce="block")
    run, block = runs["dmuon-z3"], 2 * 50 * 70  # blocks.0 and blocks.1 alike
    assert run["p_m"] == 20 * 50 + 2 * block and run["p_m_reused"] == run["p_m_kept"] == block
    assert run["closed_form"] == "3(N-1)/N + (N-1)/N·P_M^r − (N-1)/N·P_M^L"
    # at N=2: forward P_M + blocks.0 again, backward a re-broadcast of all but blocks.1 + a reduce
    phases = run["phases"]
    assert phases["forward"]["measured_avg_elems"] == pytest.approx(0.5 * (run["p_m"] + block))
    assert phases["backward"]["measured_avg_elems"] == pytest.approx(0.5 * (2 * run["p_m"] - block))


@pytest.mark.parametrize("model", ["linear_list", "conv_net"])
def test_bare_linear_list_and_conv_net(pool2, tmp_path, model):
    _, runs = _run(pool2, tmp_path, ("naive-fsdp2-z3", "dmuon-z3"), f"examples.structures:{model}")
    # linear_list: 4 Linear weights (20-48-40-48-10); conv_net: 2 Conv2d, 1 Conv1d (head: AdamW)
    p_m = {"linear_list": 48 * 20 + 40 * 48 + 48 * 40 + 10 * 48, "conv_net": 6 * 9 + 8 * 6 * 9 + 8 * 8 * 3}
    assert runs["dmuon-z3"]["p_m"] == p_m[model]


@pytest.mark.parametrize("modes", [("dmuon-ddp", "dmuon-z3"), pytest.param(W2_MODES, marks=pytest.mark.slow)],
                         ids=["some", "all"])
def test_hf_qwen3_moe(pool2, tmp_path, modes):
    """transformers 5's Qwen3-MoE: fused 3-D experts and routers inside P_M; its rotary buffers
    make DDP broadcast from rank 0 before every forward (predicted: RunLayout.ddp_buffers)."""
    pytest.importorskip("transformers")
    report, runs = _run(pool2, tmp_path, modes, "examples.hf_moe:factory")
    muon = {e["name"]: e for e in report["params"]["muon"]}
    assert {n for n in muon if ".mlp." in n} == {
        f"model.layers.{i}.mlp.{p}" for i in range(2)
        for p in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")}
    # coalesce="auto": the tiny model's fp32 Muon params fit gloo's 2 MB unit target, so they
    # are one unit, which Z3 keeps (P_M^L = P_M): 3(N-1)/N - (N-1)/N = 1.0 at N=2
    assert 4 * report["params"]["muon_elems"] <= 2_000_000
    assert runs["dmuon-z3"]["p_m_kept"] == runs["dmuon-z3"]["p_m"]
    assert runs["dmuon-z3"]["ratio_to_p_m"] == pytest.approx(1.0)


def test_equal_blocks_move_as_one_aligned_unit(pool2, tmp_path):
    """Four identical blocks at W=2: one unit under coalesce="auto" whose buckets (one per
    owner, 4 matrices each) move in one all_gather per forward, checked like every layout:
    measured = predicted = closed form, three sources one to one."""
    _, runs = _run(pool2, tmp_path, ("dmuon-ddp", "dmuon-z3"), "examples.structures:equal_blocks")
    assert runs["dmuon-z3"]["p_m"] == 4 * 2 * 50 * 70
    for mode in ("dmuon-ddp", "dmuon-z3"):  # 2 measured steps x 2 ranks x one all_gather
        assert runs[mode]["phases"]["forward"]["collectives_measured"] == 4
    # Z3 keeps the one unit from forward into backward (docs/protocol.md step 2): no
    # backward all_gather, only the reduce_scatter (2 steps x 2 ranks)
    assert runs["dmuon-z3"]["phases"]["backward"]["collectives_measured"] == 4
    assert runs["dmuon-z3"]["closed_form"] == "3(N-1)/N − (N-1)/N·P_M^L"


def test_a_frozen_layer_is_gathered_but_not_reduced_as_predicted(pool2, tmp_path):
    """A frozen input Linear (requires_grad=False): DDP leaves it out of its buckets, FSDP2
    all_gathers it but reduce-scatters no grad for it. Before the predictor knew
    (``RunLayout.frozen_names``), every mode failed on it."""
    _, runs = _run(pool2, tmp_path, ("ddp-muon", "naive-fsdp2-z2", "dmuon-z2"), "examples.structures:frozen_input")
    assert runs["dmuon-z2"]["p_m"] == 4 * 2 * 50 * 70  # the frozen inp is not dedicated


def test_a_frozen_layer_leaves_the_replicated_rest_all_reduce(pool2, tmp_path):
    """rest="replicate": the frozen input Linear is not dedicated and has no grad, so it is not
    in DMuon's all_reduce of the rest (the prediction leaves it out; a wrong count would fail)."""
    from tests.distributed.phase_d import traffic_tasks

    report = pool2.run_with_timeout(TIMEOUT_S, traffic_tasks.verdict, str(tmp_path), ("dmuon-z2", "dmuon-z3"),
                                    model="examples.structures:frozen_input", rest="replicate",
                                    profiler=False)[0]
    assert report["pass"], report["failures"]
