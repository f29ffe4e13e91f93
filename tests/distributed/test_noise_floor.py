"""The parity tests' noise-floor helper (``noise_floor.py``) on hand-made runs."""

import pytest
import torch

from tests.distributed import noise_floor as NF


def _run(init: float, *steps: float) -> dict:
    return {"init": {"w": torch.tensor([init])}, "steps": [{"w": torch.tensor([s])} for s in steps]}


def test_nudge_moves_every_param_one_ulp_each_way():
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    NF.nudge_init_(model, "ulp+")
    for b, p in zip(before, model.parameters()):
        assert torch.equal(p.detach(), torch.nextafter(b, torch.full_like(b, float("inf"))))
    NF.nudge_init_(model, "ulp-")
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    NF.nudge_init_(model, "threads")  # a thread nudge leaves the values
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="Invalid nudge='ulp'"):
        NF.nudge_init_(model, "ulp")


def test_oracle_threads_sets_and_restores_the_thread_count():
    before = torch.get_num_threads()
    with NF.oracle_threads("threads"):
        assert torch.get_num_threads() == NF.OTHER_THREADS
    with NF.oracle_threads(None):
        assert torch.get_num_threads() == NF.RANK_THREADS
    assert torch.get_num_threads() == before


def test_floors_take_the_worst_nudge_per_step_and_the_least_floor():
    ref = _run(0.0, 1.0, 2.0)
    floors = NF.floors(ref, {"a": _run(0.0, 1.1, 2.0), "b": _run(0.0, 1.05, 2.6)})
    assert floors[0].value == pytest.approx(0.1) and floors[0].where == "a on w"
    assert floors[1].value == pytest.approx(0.3) and floors[1].where == "b on w"
    assert floors[1].bound == pytest.approx(NF.FACTOR * 0.3)
    same = NF.floors(ref, {"a": ref})[0]  # every nudged run rounds alike: the least floor
    assert same.value == 0.0 and same.bound == NF.FACTOR * NF.MIN_FLOOR


def test_within_passes_at_the_bound_and_a_control_beyond_it_fails_it():
    floor = NF.Floor(0.01, "test")
    NF.assert_within({"w": 0.04}, floor)
    with pytest.raises(AssertionError, match="lands off the oracle"):
        NF.assert_within({"w": 0.041, "v": 0.0}, floor)
    NF.assert_beyond({"w": 0.05}, floor)
    with pytest.raises(AssertionError, match="lands within the bound"):
        NF.assert_beyond({"w": 0.05, "v": 0.04}, floor)


def test_distance_norms():
    got, want, init = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])
    assert NF.distance(got, want, init) == pytest.approx(1.0)
    assert NF.distance(got, want, init, "fro") == pytest.approx(1.0 / 2**0.5)
    with pytest.raises(ValueError, match="Invalid norm='l1'"):
        NF.distance(got, want, init, "l1")
