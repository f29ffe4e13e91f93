"""The layout kinds the harness knows, and the loader of a run's ``layout.json``.

A kind is a subclass of :class:`verify.traffic.predict.RunLayout` that answers the harness's
questions itself (its class docstring; docs/verify.md, "Layout kinds"); nothing in the harness
branches on the kind. A new kind is one more subclass and one more entry in
:data:`LAYOUT_KINDS`.
"""

from __future__ import annotations

from verify.traffic.cp import CPRunLayout
from verify.traffic.ep import EPRunLayout
from verify.traffic.pp import PPRunLayout
from verify.traffic.predict import RunLayout
from verify.traffic.tp import TPRunLayout
from verify.traffic.tpep import TPEPRunLayout

#: ``kind`` -> class: ``"dense"`` (a data-parallel mesh), ``"tp"`` (an R × N × T mesh),
#: ``"ep"`` (an R × N × E expert-parallel mesh), ``"pp"`` (an S × N pipeline mesh),
#: ``"cp"`` (an N × C context-parallel mesh), ``"tpep"`` (an N × E × T mesh: TP × EP).
LAYOUT_KINDS: dict[str, type[RunLayout]] = {cls.kind: cls for cls in (RunLayout, TPRunLayout, EPRunLayout,
                                                                      PPRunLayout, CPRunLayout, TPEPRunLayout)}


def layout_kind(d: dict) -> str:
    """The kind of a :meth:`RunLayout.to_dict` ``d``: its ``"kind"``; a ``layout.json`` written
    before that key is ``"tp"`` when it has ``tp_size`` (the only other kind then), else
    ``"dense"``."""
    if "kind" in d:
        return d["kind"]
    return TPRunLayout.kind if "tp_size" in d else RunLayout.kind


def layout_from_dict(d: dict) -> RunLayout:
    """A ``layout.json``'s layout, as the class of its kind (:func:`layout_kind`).

    Raises:
        ValueError: an unknown kind, or the class's ``from_dict`` refuses ``d``.
    """
    kind = layout_kind(d)
    if not isinstance(kind, str) or kind not in LAYOUT_KINDS:
        raise ValueError(f"Invalid layout kind={kind!r}. Must be one of {sorted(LAYOUT_KINDS)} "
                         "(verify.traffic.layouts.LAYOUT_KINDS): a layout.json written by verify-traffic.")
    return LAYOUT_KINDS[kind].from_dict(d)
