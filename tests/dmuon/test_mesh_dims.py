"""Which mesh dims are data parallel (``dmuon/placement/dims.py``): the default names, a
declaration, and the errors (local: no process group needed; the mesh is a stand-in with a
DeviceMesh's names, ndim and shape)."""

from types import SimpleNamespace

import pytest

from dmuon.placement.dims import resolve


def _mesh(names, shape):
    return SimpleNamespace(mesh_dim_names=names, ndim=len(shape), shape=shape)


@pytest.mark.parametrize("names, shape, replicate, shard, model", [
    (None, (4,), None, ("0",), ()),
    (("dp",), (4,), None, ("dp",), ()),
    (("replicate", "shard"), (2, 2), "replicate", ("shard",), ()),
    (("shard", "tp"), (2, 2), None, ("shard",), ("tp",)),
    (("replicate", "shard", "tp"), (2, 1, 2), "replicate", ("shard",), ("tp",)),
    (("shard", "ep"), (2, 2), None, ("shard", "ep"), ()),
    (("replicate", "shard", "ep"), (2, 1, 2), "replicate", ("shard", "ep"), ()),
])
def test_the_default_names_keep_their_meaning(names, shape, replicate, shard, model):
    dims = resolve(_mesh(names, shape), None, None)
    assert (dims.replicate, dims.shard, dims.model) == (replicate, shard, model)


def test_declared_dims_in_mesh_order_and_the_rest_model_parallel():
    mesh = _mesh(("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2))
    dims = resolve(mesh, "dp_replicate", ("cp", "dp_shard"))
    assert (dims.replicate, dims.shard, dims.model) == ("dp_replicate", ("dp_shard", "cp"), ("tp",))
    assert dims.size(dims.shard) == 4 and dims.replicate_size == 2
    assert resolve(mesh, None, "dp_shard").model == ("dp_replicate", "cp", "tp")


@pytest.mark.parametrize("names, shape, rep, shard, text", [
    (("dp_shard", "tp"), (2, 2), None, None, "Must be ('shard', 'tp')"),
    (("dp_replicate", "fsdp"), (2, 2), None, None, "declare the data-parallel dims"),
    (("a", "b", "c"), (1, 2, 2), None, None, "ndim=3"),
    (("dp_shard", "tp"), (2, 2), None, ("dp_shard", "x"), "Must name distinct dims of the mesh"),
    (("dp_shard", "tp"), (2, 2), "dp_shard", "dp_shard", "Must name distinct dims of the mesh"),
    (("dp_shard", "tp"), (2, 2), None, (), "Must name distinct dims of the mesh"),
    (("dp_replicate", "dp_shard"), (2, 2), "dp_replicate", None, "without shard_dims"),
])
def test_a_mesh_the_names_cannot_tell_or_a_bad_declaration_is_refused(names, shape, rep, shard, text):
    with pytest.raises(ValueError, match=None) as err:
        resolve(_mesh(names, shape), rep, shard)
    assert text in str(err.value)
