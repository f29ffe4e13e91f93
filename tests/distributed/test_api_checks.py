"""Validation on every rank, before any collective (issue 13, failures 6 and 9)."""

import pytest

from tests.distributed import api_tasks as A

pytestmark = pytest.mark.distributed


def test_bad_hyperparameters_raise_on_every_rank_including_idle_owners(pool4):
    results = pool4.run_with_timeout(60, A.bad_hyperparameters)
    assert sorted(r["owned"] for r in results) == [0, 0, 1, 1]  # two ranks own nothing
    for rank, r in enumerate(results):
        for key, (_, text) in A.BAD_HYPERPARAMETERS.items():
            assert r[key].startswith("ValueError: ") and text in r[key], (rank, key, r[key])
        assert "Invalid param_groups[0].weight_decay=-1.0" in r["step"], (rank, r["step"])
