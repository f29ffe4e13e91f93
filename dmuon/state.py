"""DMuon's training state: one explicit value per :class:`~dmuon.DedicatedParams`, with the
allowed transitions written down and asserted (the role of FSDP2's ``TrainingState``).

::

    IDLE ──forward──▶ FORWARD ──root forward returns──▶ FORWARD_DONE ──backward──▶ BACKWARD
      ▲                  │ (backward without a root forward: implicit end of forward)  │
      │                  └────────────────────────────────────────────▶ BACKWARD ◀──┘
      │                                                                   │ end of backward
      │                 FORWARD_DONE / BACKWARD_DONE ──forward──▶ FORWARD │ (queued callback)
      └──── step() / zero_grad() ◀──── BACKWARD_DONE ◀────────────────────┘

``recover`` (any state -> IDLE) is the one exit from a state an exception left behind: a
forward or backward that raised never reaches its end, so the next root forward,
``zero_grad()`` or ``step()`` finds ``FORWARD`` or ``BACKWARD`` and recovers first.
"""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    """Where one DedicatedParams is in the training step."""

    IDLE = "idle"  # between steps: no forward started since the last step / zero_grad
    FORWARD = "forward"  # a forward is running (root pre-hook fired, root post-hook not yet)
    FORWARD_DONE = "forward_done"  # forward returned; backward may follow (or another forward)
    BACKWARD = "backward"  # a backward is running (end-of-backward callback queued)
    BACKWARD_DONE = "backward_done"  # backward ended; grads reduced to owners unless no_sync


#: Allowed ordinary transitions (``recover`` may leave any state for IDLE).
TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = {
    TrainingState.IDLE: frozenset({TrainingState.FORWARD}),
    TrainingState.FORWARD: frozenset({TrainingState.FORWARD_DONE, TrainingState.BACKWARD}),
    TrainingState.FORWARD_DONE: frozenset(
        {TrainingState.FORWARD, TrainingState.BACKWARD, TrainingState.IDLE}
    ),
    TrainingState.BACKWARD: frozenset({TrainingState.BACKWARD_DONE}),
    TrainingState.BACKWARD_DONE: frozenset(
        {TrainingState.FORWARD, TrainingState.BACKWARD, TrainingState.IDLE}
    ),
}


class StateMachine:
    """The current :class:`TrainingState` and its asserted transitions."""

    def __init__(self) -> None:
        self.state = TrainingState.IDLE

    def to(self, new: TrainingState) -> None:
        """Move to ``new``; an internal invariant (not a user error) if not allowed."""
        assert new in TRANSITIONS[self.state], f"DMuon state {self.state.name} -> {new.name}"
        self.state = new

    def recover(self) -> TrainingState:
        """Back to IDLE from any state; returns the state left (for the caller's cleanup)."""
        old, self.state = self.state, TrainingState.IDLE
        return old

    def __repr__(self) -> str:
        return f"StateMachine({self.state.name})"
