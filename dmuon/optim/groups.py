"""Param groups the torch way: the user's groups split into DMuon's Muon and AdamW groups (pure).

``DMuon(params, dedicated=dm, **defaults)`` takes what a torch optimizer takes: an iterable of
params, or an iterable of dicts (``{"params": [...], <hyper-parameter>: value, ...}``). Each
user group ``i`` becomes, in this order, its **Muon part** (the group's params that ``dm``
dedicates) and its **AdamW part** (the others); a part with no params is left out, so a flat
iterable gives ``[Muon, AdamW]`` as before. Every part carries ``algorithm`` (``"muon"`` /
``"adamw"``) and ``group`` (``i``, the user group it came from).

Which value each part takes (the group's own value first, then the constructor's):

===============  ==============================================  ==================================
hyper-parameter  Muon part                                       AdamW part
===============  ==============================================  ==================================
lr               ``lr``                                          ``adamw_lr``, else ``lr``
weight_decay     ``weight_decay``                                ``adamw_weight_decay``, else
                                                                 ``weight_decay``
eps              ``eps``                                         ``adamw_eps``, else ``eps``
betas            —                                               ``adamw_betas``, else ``betas``
Muon only        ``momentum, nesterov, ns_coefficients,          —
                 ns_steps, adjust_lr_fn``
===============  ==============================================  ==================================

so ``{"params": no_decay, "weight_decay": 0.0}`` exempts those params in both optimizers (the
standard no-decay grouping) and ``{"params": [emb], "lr": 1e-3}`` sets the lr of whichever
optimizer steps ``emb``. Other keys (a group's ``name``, a scheduler's ``initial_lr``) are kept
in both parts, as torch keeps them. Keys that would change AdamW's math in a way DMuon does not
implement (``amsgrad``, ``maximize``, ``differentiable``, ``decoupled_weight_decay=False``)
raise, as do the reserved ``algorithm`` / ``group``.
"""

from __future__ import annotations


import torch

#: Muon's keys (``torch.optim.Muon``'s constructor arguments), in the Muon part only.
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
             "adjust_lr_fn")
#: AdamW part key -> (the group's AdamW-only key, the shared key it falls back to).
ADAMW_KEYS = {"lr": ("adamw_lr", "lr"), "weight_decay": ("adamw_weight_decay", "weight_decay"),
              "eps": ("adamw_eps", "eps"), "betas": ("adamw_betas", "betas")}
#: Every key with a meaning to DMuon (a group may hold any of them).
KNOWN = frozenset(MUON_KEYS) | {k for pair in ADAMW_KEYS.values() for k in pair} | {"params"}
#: torch AdamW switches DMuon's AdamW does not implement, with the value DMuon's math equals.
UNSUPPORTED = {"amsgrad": False, "maximize": False, "differentiable": False,
               "decoupled_weight_decay": True}
RESERVED = ("algorithm", "group")


def user_groups(params) -> tuple[list[dict], bool]:
    """The user's groups: ``params`` as torch's ``Optimizer`` reads it (one flat iterable of
    tensors is one group ``{"params": [...]}``), and whether they were given as dicts.

    Raises:
        ValueError: ``params`` mixes tensors and dicts, a dict has no ``"params"``, a group's
            ``params`` is a set (no order; torch refuses it too), or holds a non-tensor.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    items = list(params)
    dicts = [x for x in items if isinstance(x, dict)]
    if not dicts:
        return [{"params": items}], False
    if len(dicts) != len(items):
        raise ValueError(
            f"Invalid params: {len(dicts)} param-group dicts mixed with {len(items) - len(dicts)} "
            "tensors. Must be either an iterable of params (model.parameters()) or a list of "
            "dicts, each with a 'params' list, as torch optimizers take.")
    groups = []
    for i, d in enumerate(dicts):
        if "params" not in d:
            raise ValueError(f"Invalid params[{i}]: keys {sorted(d)}. A param group must have "
                             "'params' (a list of tensors).")
        ps = d["params"]
        if isinstance(ps, set):
            raise ValueError(f"Invalid params[{i}]['params']: a set. Must be a list (an ordered "
                             "sequence: the optimizer state is matched by position).")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        bad = next((type(p).__name__ for p in ps if not isinstance(p, torch.Tensor)), None)
        if bad is not None:
            raise ValueError(f"Invalid params[{i}]['params']: holds a {bad}. Must hold tensors only.")
        groups.append({**d, "params": ps})
    return groups, True


def _check_keys(i: int, group: dict) -> None:
    for key in RESERVED:
        if key in group:
            raise ValueError(
                f"Invalid params[{i}]['{key}']={group[key]!r}: '{key}' is DMuon's own key (which "
                "optimizer steps a part, and its user group). Must not be given.")
    for key, ok in UNSUPPORTED.items():
        if key in group and group[key] != ok:
            raise ValueError(
                f"Invalid params[{i}]['{key}']={group[key]!r}. DMuon's AdamW is torch.optim.AdamW "
                f"with {key}={ok} only; must be {ok} or left out.")


def split(groups: list[dict], dedicated, defaults: dict, adamw_defaults: dict) -> list[dict]:
    """DMuon's param groups from the user's (module docstring).

    Args:
        groups: from :func:`user_groups`.
        dedicated: the ``DedicatedParams`` (``p in dedicated`` says which part ``p`` joins).
        defaults: the constructor's Muon values (keys :data:`MUON_KEYS`).
        adamw_defaults: the constructor's AdamW values (keys of :data:`ADAMW_KEYS`).

    Returns:
        The parts, Muon then AdamW per user group, empty parts left out; a Muon part's params
        in ``dedicated``'s order, an AdamW part's in the order the user gave them.

    Raises:
        ValueError: a reserved or unsupported key (named with its group), or a param in two
            groups (torch's rule).
    """
    seen: dict[int, int] = {}
    parts: list[dict] = []
    for i, g in enumerate(groups):
        _check_keys(i, g)
        for p in g["params"]:
            if id(p) in seen:
                raise ValueError(
                    f"Invalid params[{i}]: a param of shape {tuple(p.shape)} is also in "
                    f"params[{seen[id(p)]}]. Each param must be in exactly one group.")
            seen[id(p)] = i
        extra = {k: v for k, v in g.items() if k not in KNOWN}
        mine = {id(p) for p in g["params"]}
        muon = [p for p in dedicated.params if id(p) in mine]  # the plan's order, as before
        adamw = [p for p in g["params"] if p not in dedicated]
        if muon:
            parts.append({**extra, "params": muon, "algorithm": "muon", "group": i,
                          **{k: g.get(k, defaults[k]) for k in MUON_KEYS}})
        if adamw:
            values = {}
            for key, (own, shared) in ADAMW_KEYS.items():
                values[key] = g[own] if own in g else g.get(shared, adamw_defaults[key])
            parts.append({**extra, "params": adamw, "algorithm": "adamw", "group": i, **values})
    return parts


def taken_by_fsdp(dedicated, names: list[str]) -> list[str]:
    """Those of ``names`` (dedicated params) whose module now registers a DTensor in their
    place: FSDP2's ``fully_shard`` managed them (no ``ignored_params``)."""
    from torch.distributed.tensor import DTensor

    where = {n: (b.param_modules[i], n.rpartition(".")[2])
             for b in dedicated.buckets for i, n in enumerate(b.names)}
    return [n for n in names if isinstance(getattr(*where[n], None), DTensor)]
