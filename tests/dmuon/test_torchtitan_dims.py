"""``dmuon.integrations.torchtitan`` without torchtitan: how torchtitan's ``ParallelDims`` map to
the mesh dims DMuon dedicates on, and the refusals that come before any collective or import.
The integration's training run on torchtitan itself: tests/distributed/parity/test_torchtitan.py."""

from types import SimpleNamespace

import pytest
import torch.nn as nn

from dmuon.integrations import torchtitan as dmt


def dims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, spmd_backend="partial_dtensor"):
    """The fields of torchtitan's ``ParallelDims`` that the mapping reads."""
    return SimpleNamespace(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp,
                           ep=ep, spmd_backend=spmd_backend)


@pytest.mark.parametrize("given, want", [
    (dims(dp_shard=4), (("fsdp",), None, ("fsdp",))),
    (dims(dp_shard=2, cp=2), (("fsdp",), None, ("fsdp",))),  # fsdp = dp_shard x cp
    (dims(dp_shard=2, tp=2), (("fsdp", "tp"), None, ("fsdp",))),
    (dims(dp_replicate=2, dp_shard=2), (("dp_replicate", "fsdp"), "dp_replicate", ("fsdp",))),
    (dims(dp_replicate=2, dp_shard=2, tp=2),
     (("dp_replicate", "fsdp", "tp"), "dp_replicate", ("fsdp",))),
    (dims(dp_shard=2, pp=2), (("fsdp",), None, ("fsdp",))),  # the stage's slice: no "pp"
    (dims(dp_shard=4, ep=2), (("efsdp", "ep"), None, ("efsdp", "ep"))),
    (dims(dp_replicate=2, dp_shard=2, ep=2),
     (("dp_replicate", "efsdp", "ep"), "dp_replicate", ("efsdp", "ep"))),
], ids=["fsdp", "fsdp-cp", "fsdp-tp", "hsdp", "hsdp-tp", "pp", "ep", "hsdp-ep"])
def test_mesh_dims_map_torchtitans_names(given, want):
    assert dmt.mesh_dims(given) == want


@pytest.mark.parametrize("given, match", [
    (dims(dp_shard=4, spmd_backend="spmd_types"), "spmd_backend='spmd_types'.*partial_dtensor"),
    (dims(dp_shard=4, spmd_backend="full_dtensor"), "spmd_backend='full_dtensor'"),
    (dims(dp_shard=2, tp=2, ep=2), "ep=2, tp=2.*tp=1"),
])
def test_mesh_dims_refuse_what_dmuon_cannot_dedicate(given, match):
    with pytest.raises(ValueError, match=match):
        dmt.mesh_dims(given)


def test_parallelize_fn_refuses_another_backend_before_running_anything():
    ran = []
    wrapped = dmt.parallelize_fn(lambda model, **kw: ran.append(model))
    with pytest.raises(ValueError, match="spmd_backend='spmd_types'"):
        wrapped(nn.Linear(2, 2), parallel_dims=dims(dp_shard=4),
                parallelism=SimpleNamespace(spmd_backend="spmd_types"))
    assert ran == []


def test_a_model_part_that_was_not_dedicated_is_named():
    with pytest.raises(ValueError, match="Invalid model part Linear.*parallelize_fn"):
        dmt.dedicated_of(nn.Linear(2, 2))


def test_unknown_hyperparameters_are_named():
    with pytest.raises(ValueError, match=r"Invalid DMuon hyperparameters \['betas'\]"):
        dmt._config({"lr": 0.02, "betas": (0.9, 0.95)})
