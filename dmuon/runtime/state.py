"""DMuon's runtime states: one enum per question (the pass state, each bucket's copies,
replica and grads, the runtime's block-order, DDP and group checks), each with its allowed
transitions written down (:data:`TRANSITIONS`, :data:`RECOVERIES`, :data:`CREATED`) and
checked on every change (the role of FSDP2's ``TrainingState`` and ``ShardedState``).

What each state means, when it changes and the diagrams: ``docs/protocol.md``, "States" (the
one description; the tables here are the code). Every write of a state goes through
:func:`check`; a state's first value is set where its object is built. A change the tables do
not allow is a bug in DMuon: :func:`check` raises :class:`~dmuon.errors.DMuonInternalError`
naming the object and both states (an explicit raise, so the check holds under
``python -O``). :class:`StateMachine` holds the pass state of one
:class:`~dmuon.DedicatedParams`; the per-bucket states live in
:class:`dmuon.runtime.bucket.Bucket`, the runtime's own in
:class:`dmuon.runtime.runtime.Runtime`.
"""

from __future__ import annotations

import enum

from dmuon.errors import DMuonInternalError


class TrainingState(enum.Enum):
    """Where one DedicatedParams is in the training step."""

    IDLE = "idle"  # after step() (or construction): no forward since
    FORWARD = "forward"  # a forward is running (root pre-hook fired, root post-hook not yet)
    FORWARD_DONE = "forward_done"  # forward returned; backward may follow (or another forward)
    BACKWARD = "backward"  # a backward is running (end-of-backward callback queued)
    BACKWARD_DONE = "backward_done"  # backward ended; grads reduced to owners unless no_sync
    CLOSED = "closed"  # DedicatedParams.close() ran: terminal


class Copy(enum.Enum):
    """A bucket's copy on the ranks that do not hold it (``docs/protocol.md``, "States")."""

    FREED = "freed"  # no storage on non-holders; values stale
    STALE = "stale"  # allocated, older than the holder's values
    IN_FLIGHT = "in_flight"  # a broadcast from the holder is writing it
    VALID = "valid"  # equal to the holder's current values


class Replica(enum.Enum):
    """A holder's master copy under HSDP (``docs/protocol.md``, "States")."""

    CURRENT = "current"
    RECEIVING = "receiving"  # the owner's replicate broadcast is writing it


class Grads(enum.Enum):
    """A bucket's gradients (``docs/protocol.md``, "States")."""

    NONE = "none"  # no grad since the last zero_grad() / step consumed them
    LOCAL = "local"  # this rank's grads accumulated, not reduced (no_sync, or before the issue)
    REDUCING = "reducing"  # the shard reduce was issued, not waited
    REDUCED = "reduced"  # owners hold the averaged grads
    STEPPED = "stepped"  # step() consumed them; zero_grad() not called since


class BlockOrder(enum.Enum):
    """Whether the ranks agreed on the blocks' execution order (protocol step 7)."""

    RECORDING = "recording"  # model order; the first forward records the blocks' order
    AGREED = "agreed"  # the first step() agreed (and renumbered the buckets if it differed)


class DdpCheck(enum.Enum):
    """``rest="wrapper"``: whether the check that something averages the rest's grads ran
    (``rest.warn_if_not_averaged``, at the first ``step()`` that can tell)."""

    OFF = "off"  # rest="replicate": DMuon averages the rest itself
    LOOKING = "looking"  # no forward inside DistributedDataParallel seen yet
    SEEN = "seen"  # a forward ran inside DDP (``Runtime.ddp_size`` ranks)
    DONE = "done"  # checked (warned, or found averaged)


class GroupCheck(enum.Enum):
    """Whether the aligned groups were checked since a bucket was last re-bound."""

    CHECKED = "checked"
    PENDING = "pending"  # a move re-bound a bucket: Runtime.check_groups runs before the next call


S, C, R, G = TrainingState, Copy, Replica, Grads

#: Allowed ordinary transitions of each state kind (self-transitions are no-ops, always allowed;
#: ``recover`` may also leave any pass state for IDLE).
TRANSITIONS: dict[type, dict[enum.Enum, frozenset]] = {
    S: {
        S.IDLE: frozenset({S.FORWARD, S.CLOSED}),
        S.FORWARD: frozenset({S.FORWARD_DONE}),
        S.FORWARD_DONE: frozenset({S.FORWARD, S.BACKWARD, S.IDLE, S.CLOSED}),
        S.BACKWARD: frozenset({S.BACKWARD_DONE}),
        S.BACKWARD_DONE: frozenset({S.FORWARD, S.BACKWARD, S.IDLE, S.CLOSED}),
        S.CLOSED: frozenset(),
    },
    C: {
        C.FREED: frozenset({C.IN_FLIGHT, C.VALID, C.STALE}),
        C.STALE: frozenset({C.IN_FLIGHT, C.VALID, C.FREED}),
        C.IN_FLIGHT: frozenset({C.VALID}),
        C.VALID: frozenset({C.STALE, C.FREED}),
    },
    R: {R.CURRENT: frozenset({R.RECEIVING}), R.RECEIVING: frozenset({R.CURRENT})},
    G: {
        G.NONE: frozenset({G.LOCAL, G.REDUCING}),
        G.LOCAL: frozenset({G.REDUCING, G.NONE}),
        G.REDUCING: frozenset({G.REDUCED, G.NONE}),
        G.REDUCED: frozenset({G.STEPPED, G.NONE}),
        G.STEPPED: frozenset({G.NONE}),
    },
    BlockOrder: {BlockOrder.RECORDING: frozenset({BlockOrder.AGREED}),
                 BlockOrder.AGREED: frozenset()},
    DdpCheck: {
        DdpCheck.OFF: frozenset(),
        DdpCheck.LOOKING: frozenset({DdpCheck.SEEN, DdpCheck.DONE}),
        DdpCheck.SEEN: frozenset({DdpCheck.DONE}),
        DdpCheck.DONE: frozenset(),
    },
    GroupCheck: {GroupCheck.CHECKED: frozenset({GroupCheck.PENDING}),
                 GroupCheck.PENDING: frozenset({GroupCheck.CHECKED})},
}

#: ``recover``'s transitions (``docs/protocol.md``, "Outside the step"): the pass states an exception
#: leaves behind, back to IDLE. Only :meth:`StateMachine.recover` takes them.
RECOVERIES: dict[enum.Enum, frozenset] = {S.FORWARD: frozenset({S.IDLE}),
                                           S.BACKWARD: frozenset({S.IDLE})}

#: The values an optional state (``Bucket.master``: mixed precision only) may be created with
#: (``None -> value``, a new master copy); dropping one (``value -> None``, mixed precision off
#: after a move) is allowed from any value but a call in flight.
CREATED: dict[type, frozenset] = {C: frozenset({C.FREED, C.STALE})}


def _name(state) -> str:
    return "None" if state is None else state.name


def check(what: str, old: enum.Enum | None, new: enum.Enum | None,
          table: dict | None = None) -> enum.Enum | None:
    """``new`` if ``old -> new`` is allowed: ``old is new`` (not with a ``table``), or listed
    in ``table`` (default :data:`TRANSITIONS` for ``old``'s kind); for an optional state,
    ``None -> new`` in :data:`CREATED` and ``old -> None`` from any value but ``IN_FLIGHT``.

    Args:
        what: names the object and the state (``"bucket 3 ('blocks.1') grads"``).
        table: ``old`` -> allowed new values (:data:`RECOVERIES` for ``recover``).

    Raises:
        DMuonInternalError: the transition is not allowed (a bug in DMuon; the message names
            ``what``, both states and says to report it). Holds under ``python -O``.
    """
    if old is new and table is None:  # recover's table lists no self-transition
        return new
    if old is None:
        allowed = new in CREATED.get(type(new), ())
    elif new is None:
        allowed = old is not Copy.IN_FLIGHT
    else:
        rows = TRANSITIONS[type(old)] if table is None else table
        allowed = type(new) is type(old) and new in rows.get(old, ())
    if not allowed:
        raise DMuonInternalError(f"{what}: illegal state transition {_name(old)} -> {_name(new)}")
    return new


class StateMachine:
    """The current :class:`TrainingState` and its checked transitions."""

    def __init__(self) -> None:
        self.state = TrainingState.IDLE

    def to(self, new: TrainingState) -> None:
        """Move to ``new`` (checked: :data:`TRANSITIONS`).

        Raises:
            DMuonInternalError: the transition is not allowed.
        """
        self.state = check("pass state", self.state, new)

    def recover(self) -> TrainingState:
        """Back to IDLE from the FORWARD or BACKWARD an exception left (checked:
        :data:`RECOVERIES`); returns the state left (for the caller's cleanup).

        Raises:
            DMuonInternalError: the state is not FORWARD or BACKWARD.
        """
        old = self.state
        self.state = check("pass state (recover)", old, TrainingState.IDLE, RECOVERIES)
        return old

    def __repr__(self) -> str:
        return f"StateMachine({self.state.name})"
