"""A HF Llama script written the FSDP2 way trains under DMuon in Z2, Z3 and HSDP: param
groups without weight decay on norms and embeddings, ``torch.nn.utils.clip_grad_norm_``, a
post-step clamp hook, MuonClip, and with FSDP2's bf16 policy and compiled layers
(``script_tasks`` has the script and its oracle).

After each of :data:`STEPS` steps, every param (Frobenius |p - oracle| / |oracle - init|)
lands within the bound of that step's noise floor (``noise_floor``: the oracle against its
nudged runs; in bf16 also the oracle with each rank's batch run as two halves), every rank
holds the same params after ``dm.sync_params()``, and torch's clip returns the oracle's norm
on every rank, within the bound of the norm's own floor.

Measured on a 2-core AMD EPYC: DMuon bit-identical to the fp32 oracle, whose floor is 1.5 %
after one step and 4-9 % after two, but 43 % (max norm) after three (an embedding row under
AdamW), as far as removing the clip moves it: no third step is compared. The control without
the clip lands at 19 %, beyond the first step's bound. In bf16 the params are ill-conditioned
at this size (the bf16 oracle's own floor is 20 % after one step, as far as the fp32 oracle
lies from it), so there the params are checked only against that floor, and what tells the bf16
policy from fp32 is the first step's grad norm (floor 2e-5; fp32's norm lies 2.4e-4 to 4.4e-4
off, checked as the control). Compiled layers (``aot_eager``) give the eager run's params bit
for bit.
"""

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed import noise_floor as NF  # noqa: E402
from tests.distributed.parity import script_tasks as S  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT_S = 180
STEPS = 2
MODES = {"z2": 2, "z3": 2, "hsdp-z3": 4}  # world size (HSDP: 2 replicas of 2 shards)


class _Oracles(dict):
    """(world size, bf16) -> the oracle run with its per-step floors of the params (``floors``)
    and of the clip's norm (``norm_floors``), computed on first use (the bf16 W = 2 one only
    where a slow test asks)."""

    def __missing__(self, key):
        w, bf16 = key
        ref = S.oracle(w, STEPS, bf16=bf16)
        nudged = {n: S.oracle(w, STEPS, bf16=bf16, nudge=n)
                  for n in NF.NUDGES + (("halves",) if bf16 else ())}
        ref["floors"] = NF.floors(ref, nudged, norm="fro")
        ref["norm_floors"] = NF.scalar_floors(ref["norms"], {n: r["norms"] for n, r in nudged.items()})
        self[key] = ref
        return ref


@pytest.fixture(scope="module")
def oracles():
    return _Oracles()


def _params(results: list[dict], step: int) -> dict:
    """Rank 0's full params after step ``step`` (0-based), after checking every rank holds the
    same ones and each owner's dedicated params are them."""
    full = results[0]["steps"][step]
    for r in results:
        assert all(torch.equal(r["steps"][step][n], full[n]) for n in full), "ranks differ"
        assert all(torch.equal(t, full[n]) for n, t in r["owned_steps"][step].items())
    return full


def _distances(params: dict, ref: dict, step: int) -> dict[str, float]:
    return NF.distances(params, ref["steps"][step], ref["init"], norm="fro")


def _assert_on_oracle(ref: dict, results: list[dict], what: str) -> None:
    for step, floor in enumerate(ref["floors"]):
        dist = _distances(_params(results, step), ref, step)
        NF.assert_within(dist, floor, f"{what}, step {step + 1}")
        worst = max(dist, key=dist.get)
        print(f"{what}, step {step + 1}: worst {worst} {dist[worst]:.3g}; {floor}")  # pytest -rA
    for r in results:  # torch's clip: the global norm, on every rank
        for got, want, floor in zip(r["norms"], ref["norms"], ref["norm_floors"]):
            assert abs(got - want) <= floor.bound * want, (got, want, str(floor))


@pytest.mark.slow  # the oracle's own sensitivity; each habit's parity runs in make test
def test_the_habits_bite_in_the_oracle(oracles):
    for ref in (oracles[(2, False)], oracles[(4, False)], oracles[(4, True)]):
        assert all(n > 2 * S.MAX_NORM for n in ref["norms"]), ref["norms"]  # the clip scales
        assert all(c > 0 for c in ref["clamped"]), ref["clamped"]  # the clamp changes entries


@pytest.mark.parametrize("mode", list(MODES))
def test_fp32_script_lands_on_the_oracle(pool2, pool4, oracles, mode):
    world = MODES[mode]
    ref = oracles[(world, False)]
    results = (pool4 if world == 4 else pool2).run_with_timeout(TIMEOUT_S, S.train, mode, STEPS)
    _assert_on_oracle(ref, results, f"fp32 {mode}")
    _assert_same_start(ref, results)


def _assert_same_start(ref: dict, results: list[dict]) -> None:
    """Once ``DMuon`` is built, each owner's dedicated params are the oracle's init (rank 0's)."""
    for rank, r in enumerate(results):
        for n, t in r["start"].items():
            assert torch.equal(t, ref["init"][n]), (rank, n)
    assert {n for r in results for n in r["start"]} == set(ref["muon"])


#: (mode, W) of the script's port checks: every FSDP2 mode at W = 2 and 4 (HSDP: 2 x 2).
PORT_CASES = [("z2", 2), ("z3", 2), ("z2", 4), ("z3", 4), ("hsdp-z2", 4), ("hsdp-z3", 4)]


@pytest.mark.slow  # make test runs the script's parity above (z2, z3 at W = 2, hsdp-z3)
@pytest.mark.parametrize("mode,world", PORT_CASES, ids=[f"{m}-w{w}" for m, w in PORT_CASES])
def test_fsdp2_script_port_in_every_mode(pool2, pool4, tmp_path, oracles, mode, world):
    """The script as a real job runs it, in every FSDP2 mode at W = 2 and 4, for 4 steps: on
    the oracle after each of the first 2 (as above), the same start on every rank, a
    ``TrafficWindow`` over its fourth step passing (QK-clip's MAX all_reduce predicted; torch's
    clip's all_reduce, which DTensor issues inside the norm's dispatch, is not recorded:
    docs/verify.md; the script has no gradient accumulation), and a DCP save after step 1 whose resume
    ends bit for bit where the run did (no silent partial state)."""
    ref = oracles[(world, False)]
    pool = pool4 if world == 4 else pool2
    results = pool.run_with_timeout(TIMEOUT_S, S.train, mode, STEPS + 2, False, None, True, str(tmp_path))
    assert [r["window"] for r in results] == ["pass"] * world, results[0]["window"]
    _assert_on_oracle(ref, results, f"fp32 {mode}, W={world}")
    _assert_same_start(ref, results)
    for rank, r in enumerate(results):
        for n, t in r["full"].items():
            assert torch.equal(r["resumed"][n], t), (rank, n, "the resume left the run")


@pytest.mark.slow
def test_control_resume_without_the_optimizer_state_leaves_the_run(pool2, tmp_path):
    """The control of the resume check: the DCP resume loading the model's state only (the
    momentum and AdamW's moments lost) ends elsewhere."""
    results = pool2.run_with_timeout(TIMEOUT_S, S.train, "z3", STEPS + 2, False, None, True,
                                     str(tmp_path), ("no-opt-state",))
    for rank, r in enumerate(results):
        assert any(not torch.equal(r["resumed"][n], t) for n, t in r["full"].items()), rank


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_without_the_clip_the_comparison_fails(pool2, pool4, oracles, world):
    """The control: without torch's clip the first step lands beyond its bound (on the params
    as a whole: the clip scales every grad, and Muon's update is blind to that scale)."""
    ref = oracles[(world, False)]
    results = (pool4 if world == 4 else pool2).run_with_timeout(TIMEOUT_S, S.train, "z2", 1, clip=False)
    dist = _distances(_params(results, 0), ref, 0)
    NF.assert_beyond({"worst param": max(dist.values())}, ref["floors"][0], "without the clip")


#: bf16 under Z2 is slow (``make test-all``): Z3 runs the same bf16 policy and frees on top,
#: and Z2's fp32 script runs in make test.
@pytest.mark.parametrize("mode", [pytest.param("z2", marks=pytest.mark.slow), "z3", "hsdp-z3"])
def test_bf16_script_within_the_oracle_noise(pool2, pool4, oracles, mode):
    world = MODES[mode]
    results = (pool4 if world == 4 else pool2).run_with_timeout(TIMEOUT_S, S.train, mode, STEPS, True)
    _assert_on_oracle(oracles[(world, True)], results, f"bf16 {mode}")


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_the_bf16_norm_tells_the_policy_from_fp32(oracles, world):
    """The control of the bf16 comparison: the first step's grad norm in fp32 (which the fp32
    script returns, test above) lands beyond the bf16 norm's bound."""
    bf16, fp32 = oracles[(world, True)], oracles[(world, False)]
    got, want, floor = fp32["norms"][0], bf16["norms"][0], bf16["norm_floors"][0]
    assert abs(got - want) > floor.bound * want, (got, want, str(floor))


@pytest.mark.slow  # compiling the layers takes 6 s; test_compile.py covers bf16 + compile in make test
def test_bf16_compiled_layers_match_eager_bit_for_bit(pool2):
    eager = _params(pool2.run_with_timeout(TIMEOUT_S, S.train, "z3", STEPS, True), STEPS - 1)
    compiled = _params(pool2.run_with_timeout(TIMEOUT_S, S.train, "z3", STEPS, True, "aot_eager"),
                       STEPS - 1)
    assert all(torch.equal(eager[n], compiled[n]) for n in eager)
