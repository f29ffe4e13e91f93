"""``dedicate_params``' knobs as one validated value (dmuon/options.py): every bad value a
ValueError naming the argument, its value and the values allowed, raised by
``dedicate_params`` before it needs a process group; the resolved choices made once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import dmuon
from dmuon.options import DedicateOptions
from dmuon.ownership.buckets import LINK_COSTS, bucket_layout
from dmuon.ownership.plan import plan_ownership, specs_from_named_parameters

BAD = [
    ("reshard_after_forward", 1, r"Invalid reshard_after_forward=1\. Must be True \(Z3"),
    ("reshard_after_forward", "yes", r"Invalid reshard_after_forward='yes'"),
    ("mp_policy", torch.bfloat16, r"Invalid mp_policy=torch\.bfloat16: not a mixed-precision policy.*"
                                  r"MixedPrecisionPolicy\(param_dtype="),
    ("mp_policy", MixedPrecisionPolicy(param_dtype=torch.int8),
     r"Invalid mp_policy\.param_dtype=torch\.int8: must be None or a floating torch\.dtype"),
    ("bucket_cap_mb", float("nan"), r"Invalid bucket_cap_mb=nan\. Must be a positive number of MiB"),
    ("prefetch_depth", -1, r"Invalid prefetch_depth=-1\. Must be an int >= 0"),
    ("coalesce", "blocks", r"Invalid coalesce='blocks'\. Must be one of \('auto', 'block', 'all'\)"),
    ("coalesce", -5, r"Invalid coalesce=-5\."),
    ("rest", "ddp", r"Invalid rest='ddp'\. Must be 'wrapper'"),
    ("hierarchy", "tree", r"Invalid hierarchy='tree'\. Must be one of \('auto', 'hierarchical', 'flat'\)"),
    ("link", "mpi", r"Invalid link='mpi'\. Must be one of \('auto', 'nccl', 'gloo'\)"),
]


@pytest.mark.parametrize("field,value,message", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_each_bad_knob_raises_naming_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        DedicateOptions(**{field: value})
    # the same error from dedicate_params, with no process group (local, before any collective)
    with pytest.raises(ValueError, match=message):
        dmuon.dedicate_params(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), None, **{field: value})


def test_defaults_are_valid_and_frozen():
    opts = DedicateOptions()
    assert (opts.reshard_after_forward, opts.prefetch_depth, opts.coalesce, opts.rest) == (True, 1, "auto", "wrapper")
    assert opts.bucket_cap_bytes == 25 * 1024 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.prefetch_depth = 2  # type: ignore[misc]


def test_policy_dtypes_resolved_once():
    assert DedicateOptions().param_dtype is None and DedicateOptions().reduce_dtype is None
    bf16 = DedicateOptions(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert bf16.param_dtype is torch.bfloat16 and bf16.reduce_dtype is torch.bfloat16  # FSDP2's default
    mixed = DedicateOptions(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32))
    assert mixed.reduce_dtype is torch.float32


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)])


def _resolve(opts: DedicateOptions, backend: str | None, **kw):
    model = _TwoBlocks()
    specs = specs_from_named_parameters(model.named_parameters())
    plan = plan_ownership(specs, kw.pop("mesh_shape", (2, 1)))
    args = dict(backend=backend, joins_blocks=True, hsdp=True, allows_flat=True, specs=specs, plan=plan)
    return opts.resolve(**{**args, **kw}), specs, plan


def test_resolve_makes_the_auto_choices():
    gloo, specs, plan = _resolve(DedicateOptions(), "gloo")
    assert gloo.link_policy == "gloo" and gloo.coalescing.target_bytes == LINK_COSTS["gloo"].half_bytes
    assert gloo.reduce_by_gather and gloo.flat  # gloo: one unit of two small blocks moves flat
    assert len({b.module for b in bucket_layout(specs, plan, gloo.bucket_cap_bytes,
                                                 gloo.coalescing.target_bytes, True)}) == 1
    nccl, _, _ = _resolve(DedicateOptions(), "nccl")
    assert not nccl.reduce_by_gather and not nccl.flat
    # link names the policy: the backend is not asked (None), whatever it would be
    forced, _, _ = _resolve(DedicateOptions(link="nccl"), None)
    assert forced.link_policy == "nccl" and not forced.reduce_by_gather
    # a mesh kind that joins no blocks: one unit per block, whatever coalesce says
    per_block, _, _ = _resolve(DedicateOptions(coalesce="all"), "gloo", joins_blocks=False)
    assert per_block.coalescing.target_bytes == 0
    # a 1-D mesh never moves flat; "hierarchical" never does either
    assert not _resolve(DedicateOptions(), "gloo", hsdp=False)[0].flat
    assert not _resolve(DedicateOptions(hierarchy="hierarchical"), "gloo")[0].flat


def test_rest_names_kept_only_under_replicate():
    assert _resolve(DedicateOptions(), "gloo", rest_names=["norm.weight"])[0].rest_names == ()
    rep = _resolve(DedicateOptions(rest="replicate"), "gloo", rest_names=["norm.weight"])[0]
    assert rep.rest_names == ("norm.weight",) and rep.rest == "replicate"


def test_runtime_classes_take_the_one_options_object():
    """DedicatedParams, Runtime, Schedule and Bucket take the resolved options, not the knobs
    re-listed (the control: the old keyword would be a parameter)."""
    import inspect

    from dmuon.runtime.bucket import Bucket
    from dmuon.runtime.dedicated_params import DedicatedParams
    from dmuon.runtime.runtime import Runtime
    from dmuon.runtime.schedule import Schedule

    knobs = {"reshard_after_forward", "mp_policy", "bucket_cap_bytes", "prefetch_depth", "coalescing",
             "hierarchy", "flat", "link", "rest", "frees", "reduce_dtype", "reduce_by_gather"}
    for cls in (DedicatedParams, Runtime, Schedule, Bucket):
        params = set(inspect.signature(cls.__init__).parameters)
        assert "options" in params and not params & knobs, (cls.__name__, params & knobs)
