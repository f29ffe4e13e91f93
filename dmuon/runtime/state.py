"""DMuon's runtime states: one value per question, each with its allowed transitions written
down (:data:`TRANSITIONS`) and asserted on every change (the role of FSDP2's ``TrainingState``
and ``ShardedState``).

**Pass state** (:class:`TrainingState`, one per :class:`~dmuon.DedicatedParams`, ``dm.state``)::

                          ┌───────────────── another forward ─────────────────┐
                          ▼                                                   │
    IDLE ───forward───▶ FORWARD ───root post-forward (or the first grad)───▶ FORWARD_DONE
     ▲                    ▲                                                   │
     │                    │ next forward                              first grad
     │                    │                                                   ▼
     │              BACKWARD_DONE ◀──────── end of backward ─────────────── BACKWARD
     │                │    │         (queued callback)                        ▲
     │                │    └────────── another backward (retained graph) ─────┘
     │      step()    │
     └────────────────┴──── FORWARD_DONE too (IDLE stays IDLE)

    IDLE / FORWARD_DONE / BACKWARD_DONE ───close()───▶ CLOSED (terminal)

"forward" is the root's pre-forward, or a driver's when the forward did not enter through
the root. ``zero_grad()`` does not change the pass state (``loss = model(x);
opt.zero_grad(); loss.backward()`` is a valid order). ``recover`` (any state -> IDLE) is the
one exit from a state an exception left behind: a forward or backward that raised never
reaches its end, so the next root forward, ``zero_grad()``, ``step()``, ``sync_params()`` or
``close()`` finds ``FORWARD`` or ``BACKWARD`` outside autograd and recovers first. Entering
``FORWARD`` or ``BACKWARD`` resets the pass's cursors (``schedule.Cursors``), nowhere else.

**Per bucket** (:class:`dmuon.runtime.copies.Bucket`):

- :class:`Copy` ``copy``: the compute copy on the bucket's *non-holders*. Every rank tracks
  the same value for every bucket, holders included, because it decides the collectives
  (it changes only at points every rank passes). Non-holders' storage is allocated exactly
  when it is not ``FREED``::

                      issue (forward, Z3 backward)            wait
        FREED, STALE ─────────────────────────────▶ IN_FLIGHT ─────▶ VALID
        FREED, STALE ──── sync_params (synchronous) ───────────────▶ VALID
               STALE ──── params_loaded ───────────────────────────▶ VALID
        VALID, STALE ──── Z3 free (after a block's forward, the end ▶ FREED
                          of forward / backward, step(), recovery)
               VALID ──── step(), a move ──────────────────────────▶ STALE
               FREED ──── a move that re-allocates (values, or meta) ▶ STALE

  A free or a move waits an in-flight broadcast first (IN_FLIGHT -> VALID). Z2 never frees.
- :class:`Copy` ``master`` (mixed precision only; ``None`` otherwise): the non-holders'
  master copy (the registered, e.g. ``float32``, params). ``FREED`` from construction on;
  ``VALID`` after ``sync_params`` (a synchronous broadcast: never ``IN_FLIGHT``) or
  ``params_loaded``; ``STALE`` after ``step()``; ``FREED`` again at the next forward.
- :class:`Replica` ``replica``: this rank's master copy as a holder under HSDP: ``RECEIVING``
  from ``step()`` (the owner's asynchronous replicate broadcast) until it is waited (the
  bucket's next forward issue, ``sync_params``, ``params_loaded``, ``step()``, a move,
  ``close()``). Local: non-holders stay ``CURRENT``.
- :class:`Grads` ``grads``: the bucket's gradient lifecycle (the same on every rank except
  ``NONE`` / ``LOCAL``, which follow this rank's own grads)::

        NONE ──grad hook──▶ LOCAL ──reduce issued──▶ REDUCING ──waited──▶ REDUCED ──step()──▶ STEPPED
        NONE ──reduce issued (no local grad: zeros)──▶ REDUCING
        any ──zero_grad() / recover from an aborted backward──▶ NONE

  ``LOCAL`` persists across ``no_sync()`` backward passes (``step()`` in ``LOCAL`` raises).
  A backward that starts in ``REDUCED`` (no step since) or ``STEPPED`` (no ``zero_grad()``
  since) raises, naming the cause.
"""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    """Where one DedicatedParams is in the training step."""

    IDLE = "idle"  # after step() (or construction): no forward since
    FORWARD = "forward"  # a forward is running (root pre-hook fired, root post-hook not yet)
    FORWARD_DONE = "forward_done"  # forward returned; backward may follow (or another forward)
    BACKWARD = "backward"  # a backward is running (end-of-backward callback queued)
    BACKWARD_DONE = "backward_done"  # backward ended; grads reduced to owners unless no_sync
    CLOSED = "closed"  # DedicatedParams.close() ran: terminal


class Copy(enum.Enum):
    """A bucket's copy on the ranks that do not hold it (module docstring)."""

    FREED = "freed"  # no storage on non-holders; values stale
    STALE = "stale"  # allocated, older than the holder's values
    IN_FLIGHT = "in_flight"  # a broadcast from the holder is writing it
    VALID = "valid"  # equal to the holder's current values


class Replica(enum.Enum):
    """A holder's master copy under HSDP (module docstring)."""

    CURRENT = "current"
    RECEIVING = "receiving"  # the owner's replicate broadcast is writing it


class Grads(enum.Enum):
    """A bucket's gradients (module docstring)."""

    NONE = "none"  # no grad since the last zero_grad() / step consumed them
    LOCAL = "local"  # this rank's grads accumulated, not reduced (no_sync, or before the issue)
    REDUCING = "reducing"  # the shard reduce was issued, not waited
    REDUCED = "reduced"  # owners hold the averaged grads
    STEPPED = "stepped"  # step() consumed them; zero_grad() not called since


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
}


def check(what: str, old: enum.Enum, new: enum.Enum) -> enum.Enum:
    """``new`` if ``old -> new`` is allowed (or ``old is new``); an internal invariant (not a
    user error) otherwise. ``what`` names the object for the message."""
    assert old is new or new in TRANSITIONS[type(old)][old], f"DMuon {what}: {old.name} -> {new.name}"
    return new


class StateMachine:
    """The current :class:`TrainingState` and its asserted transitions."""

    def __init__(self) -> None:
        self.state = TrainingState.IDLE

    def to(self, new: TrainingState) -> None:
        """Move to ``new`` (asserted: :data:`TRANSITIONS`)."""
        self.state = check("state", self.state, new)

    def recover(self) -> TrainingState:
        """Back to IDLE from any state; returns the state left (for the caller's cleanup)."""
        old, self.state = self.state, TrainingState.IDLE
        return old

    def __repr__(self) -> str:
        return f"StateMachine({self.state.name})"
