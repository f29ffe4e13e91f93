"""Mode variants: a mode of :data:`verify.traffic.formulas.MODES` run with other DMuon knobs.

``make verify-traffic``'s default run trains the tuned defaults of every mode (on gloo the
built-in TinyGPT is one DMuon unit: its dedicated params move by aligned all_to_alls, flat
under HSDP) *and* these variants, so that every path of DMuon's protocol runs and is gated in
the default run (docs/verify.md, "What the default run covers"):

- ``dmuon-z3[block]``: ``coalesce="block"``, one unit per block: per-owner forward
  broadcasts, per-owner reduces (gathers on gloo) and Z3's backward re-broadcast of every
  unit but the kept one;
- ``dmuon-hsdp-z3[hierarchical]``: ``hierarchy="hierarchical"`` on the 2 x W/2 mesh: the
  shard-axis aligned calls plus the replicate-axis reduce and the owner's replicate
  broadcast.

A variant's label (``<mode>[<name>]``) is its name everywhere a mode's is (``--modes``,
``<out>/<label>/``, report.json ``runs[].mode``, failures); the predictor sees the base mode
and the overridden knobs through the run's :class:`~verify.traffic.predict.RunLayout`.
"""

from __future__ import annotations

from verify.traffic.formulas import MODES

#: label -> (base mode, DMuon knobs it overrides: RunConfig / dedicate_params field names).
MODE_VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "dmuon-z3[block]": ("dmuon-z3", {"coalesce": "block"}),
    "dmuon-hsdp-z3[hierarchical]": ("dmuon-hsdp-z3", {"hierarchy": "hierarchical"}),
}

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


def base_mode(label: str) -> str:
    """The mode of :data:`verify.traffic.formulas.MODES` a label runs (:func:`split_mode`)."""
    return split_mode(label)[0]
