"""Every rank builds the same DMuon: the optimizer's setup agreement and its frozen-params check.

``dmuon.dedicate_params`` agrees on the ownership plan and its knobs; the optimizer's
hyper-parameters and which params it trains are just as much a part of what must match. Under
DDP a different ``lr`` on one rank splits the replicated weights silently; under FSDP2 each
matrix quietly takes its owner's ``lr``. And a param frozen (``requires_grad=False``) on one
rank only keeps being stepped by its owner for everyone. :func:`agree` settles both when the
optimizer is built; :func:`check_frozen` catches a freeze made after that, at each ``step()``.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from dmuon.runtime import collectives

#: What the optimizer's agreement covers, for its messages.
OPTIMIZER_WHAT = ("optimizer setup (each param group's hyper-parameters: lr, weight_decay, momentum, "
                  "nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn, betas; its params' shapes, "
                  "dtypes and requires_grad)")


def _value(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return v


def describe(param_groups: list[dict], names: dict[int, str]) -> list[dict]:
    """Plain data of ``param_groups`` (what :func:`agree` compares): per group every key but
    ``params``, and per param its name (dedicated params; others by position), global shape,
    dtype and ``requires_grad``."""
    out = []
    for g in param_groups:
        entry = {k: _value(v) for k, v in sorted(g.items()) if k != "params"}
        entry["params"] = [[names.get(id(p), i), list(p.shape), str(p.dtype), p.requires_grad]
                           for i, p in enumerate(g["params"])]
        out.append(entry)
    return json.loads(json.dumps(out, default=str))  # tuples as lists: what every rank compares


def digest_of(described: list[dict]) -> str:
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def first_difference(mine: list[dict], theirs: list[dict]) -> str:
    """The first key (``param_groups[i]['lr']``, a param's ``requires_grad``) where two
    descriptions differ, with both values."""
    if len(mine) != len(theirs):
        return f"{len(mine)} vs {len(theirs)} param groups"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        for key in sorted(set(a) | set(b)):
            if key == "params" or a.get(key) == b.get(key):
                continue
            return f"param_groups[{i}][{key!r}]: {a.get(key)!r} vs {b.get(key)!r}"
        for pa, pb in zip(a["params"], b["params"]):
            if pa != pb:
                what = "requires_grad" if pa[:3] == pb[:3] else "name, shape or dtype"
                return f"param_groups[{i}] param {pa[0]!r} ({what}): {pa[1:]} vs {pb[1:]}"
        if len(a["params"]) != len(b["params"]):
            return f"param_groups[{i}]: {len(a['params'])} vs {len(b['params'])} params"
    return "none found"


def agree(described: list[dict] | None, mesh=None) -> None:
    """Raise on every rank unless every rank built the same optimizer.

    One all_gather of 32 bytes per rank on the default group (phase ``"setup"``, span
    ``dmuon.optimizer_agreement``); where the digests differ, one more ``all_gather_object``
    of the descriptions names the first difference. A rank whose own checks raised passes
    ``None`` (it takes part, then re-raises its own error). Nothing without
    ``torch.distributed``. With a pipeline stage's ``mesh`` (the handles' mesh,
    ``DedicatedParams.stage_mesh``) the agreement stays inside the stage
    (``collectives.gather_stage_digests``; a difference is then named by the ranks holding
    each digest).

    Raises:
        RuntimeError: another rank raised while building its DMuon (names those ranks), or
            the ranks' hyper-parameters or params differ (names the ranks, the key and both
            values, and the fix).
    """
    if not dist.is_initialized():
        return
    mine = collectives.INVALID_SETUP if described is None else digest_of(described)
    ranks, digests = collectives.agree_digests(mine, mesh, "dmuon.optimizer_agreement")
    if described is None:
        return
    invalid = [r for r, d in zip(ranks, digests) if d == collectives.INVALID_SETUP]
    if invalid:
        raise RuntimeError(
            f"DMuon optimizer setup failed on ranks {invalid}: dmuon.DMuon(...) raised an error "
            "there (see those ranks' output), so no rank goes on. Build it on every rank with "
            "the same arguments.")
    if len(set(digests)) == 1:
        return
    if mesh is not None and ranks != list(range(dist.get_world_size())):
        raise RuntimeError(
            f"DMuon {OPTIMIZER_WHAT} differs across the ranks of this pipeline stage "
            f"({collectives.ranks_by_digest(digests, ranks)}). Every rank of a stage must build "
            "DMuon with the same hyper-parameters and param groups, and freeze the same params "
            "before building it.")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, described)
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    raise RuntimeError(
        f"DMuon {OPTIMIZER_WHAT} differs across ranks ({collectives.ranks_by_digest(digests)}); "
        f"first difference, rank 0 vs rank {other}: {first_difference(everyone[0], everyone[other])}. "
        "Every rank must build DMuon with the same hyper-parameters and param groups, and freeze "
        "(requires_grad=False) the same params on every rank before building it: under DDP "
        "different values split the replicated weights, under FSDP2 each matrix would take its "
        "owner's value.")


def requires_grad_of(param_groups: list[dict]) -> list[bool]:
    return [p.requires_grad for g in param_groups for p in g["params"]]


def check_frozen(param_groups: list[dict], agreed: list[bool], names: dict[int, str]) -> None:
    """At each ``step()``: ``requires_grad`` of every param is still what the ranks agreed on
    when the optimizer was built. Local, no collective.

    Raises:
        RuntimeError: a param was frozen or unfrozen since (names it and the fix). A freeze
            made on every rank raises on every rank; one made on one rank raises there, and
            the other ranks wait in their next collective until the group's timeout.
    """
    now = requires_grad_of(param_groups)
    if now == agreed:
        return
    flat = [p for g in param_groups for p in g["params"]]
    i = next(i for i, (a, b) in enumerate(zip(now, agreed)) if a != b)
    name = names.get(id(flat[i]), f"param {i} of the optimizer's params")
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise RuntimeError(
        f"DMuon: {name!r} has requires_grad={now[i]} on rank {rank} at step(), but it was "
        f"{agreed[i]} when DMuon was built (every rank agreed on it then). Freezing or "
        "unfreezing after DMuon is built is not followed (an owner steps its matrices for every "
        "rank): set requires_grad on every rank, then build a new dmuon.dedicate_params and "
        "DMuon (or freeze before building them).")
