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


def test_pipelining_fn_refuses_a_schedule_without_torchs_shape_inference():
    wrapped = dmt.pipelining_fn(lambda model, **kw: (object(), [model], True, True))
    with pytest.raises(ValueError, match="type object.*_initialize_pp_stages.*input_args"):
        wrapped(nn.Linear(2, 2))


def test_pipelining_fn_names_a_model_part_that_was_not_dedicated():
    schedule = SimpleNamespace(_initialize_pp_stages=lambda *a, **k: (True, True),
                               step=lambda *a, **k: None)
    wrapped = dmt.pipelining_fn(lambda model, **kw: (schedule, [model], True, True))
    with pytest.raises(ValueError, match="Invalid model part Linear.*parallelize_fn"):
        wrapped(nn.Linear(2, 2))


class _Decoder(nn.Module):
    """torchtitan's decoder's shape: ``tok_embeddings``, ``layers`` (a dict), ``norm``."""

    def __init__(self, layers):
        super().__init__()
        self.tok_embeddings = nn.Embedding(4, 2)
        self.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in layers})
        self.norm = nn.LayerNorm(2)


def _pipeline_part(whole, keep):
    """A part as torchtitan's ``pipeline_llm`` cuts it: a copy of ``whole`` with the modules
    of ``keep`` (the rest ``None``, the layers it does not hold dropped)."""
    import copy
    part = copy.deepcopy(whole)
    for name in ("tok_embeddings", "norm"):
        if name not in keep:
            setattr(part, name, None)
    for i in list(part.layers):
        if f"layers.{i}" not in keep:
            del part.layers[i]
    return part


def test_parts_holder_names_each_param_by_its_fqn_in_its_part():
    """One DMuon steps both parts of a rank; DCP's optimizer state dict needs one module whose
    names are the parts' own (per part it raised KeyError on the other part's params)."""
    whole = _Decoder(range(4))
    parts = [_pipeline_part(whole, ["tok_embeddings", "layers.0"]),
             _pipeline_part(whole, ["layers.2", "norm"])]
    holder = dmt.parts_holder(parts)
    want = {n: p for part in parts for n, p in part.named_parameters()}
    got = dict(holder.named_parameters())
    assert sorted(got) == sorted(want) == sorted(
        ["tok_embeddings.weight", "layers.0.weight", "layers.0.bias", "layers.2.weight",
         "layers.2.bias", "norm.weight", "norm.bias"])
    assert all(got[n] is p for n, p in want.items())
    assert holder.get_submodule("layers.0") is parts[0].layers["0"]  # the parts' own modules
    assert dmt.parts_holder(parts[:1]) is parts[0]


def test_parts_holder_refuses_one_name_in_two_parts():
    whole = _Decoder(range(2))
    parts = [_pipeline_part(whole, ["layers.0"]), _pipeline_part(whole, ["layers.0"])]
    with pytest.raises(ValueError, match="two parts hold a param named 'layers.0.weight'"):
        dmt.parts_holder(parts)
