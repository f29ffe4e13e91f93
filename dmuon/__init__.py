"""DMuon: Muon with one owner rank per weight matrix, under DDP, FSDP2 and HSDP.

Typical use (every rank, before wrapping)::

    mesh = init_device_mesh("cuda", (world_size,))
    dm = dmuon.dedicate_params(model, mesh, reshard_after_forward=True)   # Z3
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=set(dm))
    fully_shard(model, mesh=mesh, ignored_params=set(dm))
    opt = dmuon.DMuon(model.parameters(), dedicated=dm, lr=0.02, adamw_lr=3e-4)
    ...                                                                   # train
    dm.close()  # every rank: hooks, class swaps and DMuon's process groups go

See docs/user-guide.md for DDP and HSDP, docs/architecture.md for the runtime's structure.
"""

from dmuon.annotate import phase, span
from dmuon.api import dedicate_params
from dmuon.runtime.dedicated_params import DedicatedParams
from dmuon.ownership.select import default_predicate
from dmuon.optim.optimizer import DMuon
from dmuon.pipeline import pipeline_step

__all__ = ["DMuon", "DedicatedParams", "dedicate_params", "default_predicate", "phase",
           "pipeline_step", "span"]
