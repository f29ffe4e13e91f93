"""``dmuon.integrations.torchtitan.dedicating_mesh`` under pipeline parallelism, without
torchtitan: meshes built as torchtitan 0.3.0's ``ParallelDims.build_mesh`` builds them (a 1-D
``("world",)`` mesh unflattened into ``("pp", "fsdp")``), whose slices all have the world mesh
as root. DMuon tells a pipeline stage's data-parallel mesh by a root over the world with a
``"pp"`` dim (``dmuon.ownership.topology.stage_ranks``), so torchtitan's own ``fsdp`` mesh is
no stage slice to it (the control; ``dedicate_params`` refused it as a mesh that does not span
the world), while the integration's mesh is: the same ranks, torchtitan's own process group.
The training run on torchtitan's pipeline: tests/distributed/parity/test_torchtitan_pp.py."""

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.distributed


def stage_meshes() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import torchtitan as dmt
    from dmuon.ownership.topology import stage_ranks

    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    dense = world._unflatten(0, (2, 2), ("pp", "fsdp"))  # as torchtitan's build_mesh
    meshes = {("pp",): dense["pp"], ("fsdp",): dense["fsdp"], ("pp", "fsdp"): dense}
    dims = SimpleNamespace(pp=2, get_mesh=lambda d: meshes[(d,) if isinstance(d, str) else tuple(d)])
    theirs = dims.get_mesh("fsdp")
    ours = dmt.dedicating_mesh(dims, ("fsdp",))
    dmt.dedicating_mesh(dims, ("fsdp",))
    flat = SimpleNamespace(pp=1, get_mesh=dims.get_mesh)
    return {"theirs": stage_ranks(theirs), "ours": stage_ranks(ours),
            "ranks": ours.mesh.tolist(), "their_ranks": theirs.mesh.tolist(),
            "same_group": ours.get_group() is theirs.get_group(),
            "roots": len(vars(dims)[dmt.STAGE_ROOTS_ATTR]),
            "no_pp": dmt.dedicating_mesh(flat, ("fsdp",)) is theirs}


def test_a_torchtitan_stage_mesh_is_a_stage_slice_to_dmuon(pool4):
    results = pool4.run(stage_meshes)
    for rank, r in enumerate(results):
        stage = [0, 1] if rank < 2 else [2, 3]
        assert r["theirs"] is None  # the control: torchtitan's mesh, as it comes
        assert r["ours"] == tuple(stage) and r["ranks"] == r["their_ranks"] == stage
        assert r["same_group"] and r["roots"] == 1 and r["no_pp"]
