"""Mode variants: a mode of :data:`verify.traffic.formulas.MODES` run with other DMuon knobs.

``make verify-traffic``'s default run trains the tuned defaults of every mode (on gloo the
built-in TinyGPT is one DMuon unit: its dedicated params move by all_to_alls, its owners'
shares being unequal at W = 4, flat under HSDP) *and* these variants, so that every path of
DMuon's protocol runs and is gated in the default run (docs/verify.md, "What the default run
covers"):

- ``dmuon-z3[block]``: ``coalesce="block"``, one unit per block: per-owner forward
  broadcasts, per-owner reduces (gathers on gloo) and Z3's backward re-broadcast of every
  unit but the kept one;
- ``dmuon-hsdp-z3[hierarchical]``: ``hierarchy="hierarchical"`` on the 2 x W/2 mesh, one
  aligned group: the shard axis's all_gather (equal held shares) and all_to_all reduce, the
  replicate axis's aligned all_to_alls;
- ``dmuon-hsdp-z3[block+hierarchical]``: both knobs: one bucket per owner per block, so the
  replicate axis carries the per-owner reduce (a gather on gloo) to the owner and the owner's
  per-owner replicate broadcast;
- ``dmuon-z2[nccl+largest]``: ``link="nccl"`` (NCCL's link policy on any backend: no reduce
  by gather, aligned groups only of equal buckets) with the largest Muon targets dedicated
  (``targets="largest"``: on TinyGPT its four MLP matrices, one equal share per owner at
  W = 4 and two at W = 2): the aligned all_gather and the real reduce_scatter NCCL jobs run.

A variant's label (``<mode>[<name>]``, knobs joined by ``+``: ``--modes`` splits at commas) is its name everywhere a mode's is (``--modes``,
``<out>/<label>/``, report.json ``runs[].mode``, failures); the predictor sees the base mode
and the overridden knobs through the run's :class:`~verify.traffic.predict.RunLayout`.

Knobs (what :func:`split_mode` returns): ``coalesce``, ``hierarchy``, ``link`` (the
``dedicate_params`` arguments of those names) and ``targets`` (which Muon targets are
dedicated: ``"largest"``, :func:`variant_targets`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from verify.traffic.formulas import MODES

#: label -> (base mode, DMuon knobs it overrides: RunConfig / dedicate_params field names, and
#: ``targets``, :func:`variant_targets`).
MODE_VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "dmuon-z3[block]": ("dmuon-z3", {"coalesce": "block"}),
    "dmuon-hsdp-z3[hierarchical]": ("dmuon-hsdp-z3", {"hierarchy": "hierarchical"}),
    "dmuon-hsdp-z3[block+hierarchical]": ("dmuon-hsdp-z3", {"coalesce": "block", "hierarchy": "hierarchical"}),
    "dmuon-z2[nccl+largest]": ("dmuon-z2", {"link": "nccl", "targets": "largest"}),
}

#: ``targets`` knob values (:func:`variant_targets`).
TARGET_RULES = ("all", "largest")

#: Every name ``--modes`` accepts and a report may carry, in run order: the modes, then the variants.
RUN_MODES: tuple[str, ...] = MODES + tuple(MODE_VARIANTS)


def split_mode(label: str) -> tuple[str, dict[str, str]]:
    """``(base mode, overridden knobs)`` of a ``--modes`` entry (``{}`` for a plain mode).

    Raises:
        ValueError: ``label`` is neither a mode nor a variant (one of :data:`RUN_MODES`).
    """
    if label in MODES:
        return label, {}
    if label in MODE_VARIANTS:
        base, knobs = MODE_VARIANTS[label]
        return base, dict(knobs)
    raise ValueError(f"Invalid mode={label!r}. Must be one of {list(RUN_MODES)}.")


def variant_targets(rule: str, names: Sequence[str], numels: Mapping[str, int]) -> tuple[str, ...]:
    """The Muon targets a variant dedicates, in ``names``' (model) order.

    Args:
        rule: ``"all"`` (every name) or ``"largest"`` (those of the largest element count:
            on TinyGPT the ``mlp.fc1`` / ``mlp.fc2`` weights, 4·D² each, whose greedy plan
            gives every owner an equal share when W divides their number).
        names: the default Muon targets (``verify.modes.build.muon_names``).
        numels: element count of each name.

    Raises:
        ValueError: ``rule`` is not one of :data:`TARGET_RULES`, or ``names`` is empty.
    """
    if rule not in TARGET_RULES:
        raise ValueError(f"Invalid targets={rule!r}. Must be one of {TARGET_RULES}.")
    if not names:
        raise ValueError("Invalid names=(): a variant dedicates some of the model's Muon targets, "
                         "and the model has none. Run the plain modes (--modes) instead.")
    if rule == "all":
        return tuple(names)
    most = max(numels[n] for n in names)
    return tuple(n for n in names if numels[n] == most)
