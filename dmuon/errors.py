"""DMuon's error policy, and the one exception class it adds.

- A **user mistake** (a bad argument, a model or mesh DMuon cannot handle, a call at the wrong
  time) raises ``ValueError`` / ``TypeError`` (bad input) or ``RuntimeError`` (a wrong order of
  calls, a collective that failed), naming the object, its value, the constraint and the fix;
  where the ranks must agree, on every rank before any collective.
- A **broken invariant** (a state transition the tables of ``dmuon/runtime/state.py`` do not
  allow, cursors or indices out of step) is a bug in DMuon: it raises
  :class:`DMuonInternalError`, explicitly, never with a bare ``assert`` (which ``python -O``
  strips, letting a wrong state through to the collectives).
"""

from __future__ import annotations


class DMuonInternalError(AssertionError):
    """An invariant of DMuon's runtime does not hold: a bug in DMuon, not in the caller's use.

    A subclass of ``AssertionError``: it means what a failed ``assert`` means (as FSDP2's
    explicit ``raise AssertionError``), and it is not a ``RuntimeError``, which DMuon's callers
    catch for failed collectives (``DedicatedParams.sync_params`` re-raises those as a
    user-facing error naming the calls to make on every rank), so a bug is never reported as a
    user's mistake. Raised explicitly, so it survives ``python -O``. The message names the
    object, what was found and asks for a report.
    """

    def __init__(self, what: str) -> None:
        super().__init__(f"DMuon internal error: {what}. This is a bug in DMuon, not in your "
                         "code: please report it with this message and the traceback.")


def invariant(holds: bool, what) -> None:
    """Raise :class:`DMuonInternalError` unless ``holds``. ``what``: the message (a string,
    or a callable returning one, evaluated only on failure)."""
    if not holds:
        raise DMuonInternalError(what() if callable(what) else what)
