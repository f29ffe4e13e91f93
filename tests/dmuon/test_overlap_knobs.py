"""The overlap knobs are validated locally, before any collective (no process group needed)."""

import pytest
import torch.nn as nn

import dmuon


@pytest.mark.parametrize("depth", [-1, 1.5, True, "1"])
def test_bad_prefetch_depth_raises_before_any_collective(depth):
    with pytest.raises(ValueError, match=r"Invalid prefetch_depth=.*Must be an int >= 0"):
        dmuon.dedicate_params(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), None,
                              prefetch_depth=depth)


@pytest.mark.parametrize("cap", [0, -1, float("inf"), True, "25"])
def test_bad_bucket_cap_raises_before_any_collective(cap):
    with pytest.raises(ValueError, match=r"Invalid bucket_cap_mb=.*Must be a positive number"):
        dmuon.dedicate_params(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), None,
                              bucket_cap_mb=cap)
