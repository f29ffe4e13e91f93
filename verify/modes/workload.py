"""What a ``verify-traffic`` run builds, per parallel layout: one class per workload.

A run's parallel degrees (``--tp``, ``--ep``, ``--pp``, ``--cp``; the ``RunConfig`` fields of
the same names) select one :class:`Workload`: the dense one (this module's class, every
degree 1: ``verify.modes.build``) or the one whose :attr:`Workload.axes` are exactly the
degrees above 1 (``verify.modes.tp``, ``ep``, ``pp``, ``cp`` and the TP × EP one). The launcher,
the workers' argument check and the runner ask that object; none of them branches on a
degree. A new workload is one subclass in its own ``verify/modes/<kind>.py`` that sets the
class attributes below and implements :meth:`Workload.skip_reason` and :meth:`Workload.start`
(and :meth:`Workload.mesh_problem` / :meth:`Workload.source` where its mesh or model is its
own), plus one entry in ``verify.modes.workloads.workloads`` (docs/verify.md, "Workloads").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The parallel degrees a run has, in the order messages name them.
AXES = ("tp", "ep", "pp", "cp")


@dataclass
class Running:
    """One mode as a workload built it, ready to train.

    Attributes:
        built: model, optimizer, layout and ``DedicatedParams`` (``verify.modes.build.Built``).
        loss_fn: the step's loss for ``verify.run.runner.loss_step``; ``None`` where
            ``run_step`` runs the step.
        run_step: ``step -> loss or None`` that runs one whole training step (PP's schedule,
            CP's sequence split); ``None``: the runner's ``loss_step``.
        tagging: a context the measured steps run in (TP's phase tags).
        routing: EP's routing recorder (``verify.modes.ep.RoutingRecorder``), whose window the
            layout's ``ep_routing`` gets; ``None`` without experts.
    """

    built: Any
    loss_fn: Callable | None
    run_step: Callable[[int], Any] | None = None
    tagging: Any = field(default_factory=contextlib.nullcontext)
    routing: Any = None


class Workload:
    """A workload; this class itself is the dense one: every degree 1, a data-parallel mesh
    (``verify.modes.build``), any ``--model``.

    Class attributes a subclass sets (``None``: allowed):
        axes: the degrees above 1 that select it (``()``: the dense one).
        model_why: why it takes no ``--model`` (its model is fixed).
        flat_why, mixed_precision_why, qk_clip_why: why it takes no ``--hierarchy flat``,
            ``--mixed-precision``, ``--qk-clip``.
        rest: the rest it runs (``None``: ``--rest``); rest_why: why, where ``--rest`` must
            be that value.
        numerics_why: why the numerics probe does not apply (``verify.measure.numerics``).
        whole_model: each rank holds the whole model on one data-parallel mesh: DMuon's memory
            meter and the reference mode's probe loss apply (a subclass sets ``False``).
    """

    axes: tuple[str, ...] = ()
    model_why: str | None = None
    flat_why: str | None = None
    mixed_precision_why: str | None = None
    qk_clip_why: str | None = None
    rest: str | None = None
    rest_why: str | None = None
    numerics_why: str | None = None
    whole_model = True

    def degrees(self, cfg) -> dict[str, int]:
        """``{axis: degree}`` of :attr:`axes` in ``cfg`` (parsed args or a ``RunConfig``)."""
        return {a: getattr(cfg, a) for a in self.axes}

    def flags(self, cfg) -> str:
        """``"--tp 2 --ep 2"``: this workload's flags as ``cfg`` gives them."""
        return " ".join(f"--{a} {d}" for a, d in self.degrees(cfg).items())

    def skip_reason(self, mode: str, world_size: int, cfg) -> str | None:
        """Why ``mode`` cannot run at W = ``world_size`` under ``cfg`` (``None``: it can)."""
        from verify.workload.usermodel import skip_reasons

        return skip_reasons([mode], world_size).get(mode)

    def skip_reasons(self, modes, world_size: int, cfg) -> dict[str, str]:
        """``{mode: reason}`` of the ``modes`` that cannot run (:meth:`skip_reason`)."""
        reasons = {m: self.skip_reason(m, world_size, cfg) for m in modes}
        return {m: why for m, why in reasons.items() if why}

    def mesh_problem(self, world_size: int, cfg, *, global_batch: int, seq_len: int,
                     where: str = "") -> str | None:
        """Why W = ``world_size`` cannot hold this workload's mesh, or split a step of
        ``global_batch`` sequences of ``seq_len`` tokens over it, under ``cfg`` (one line
        naming the flag, W, the constraint and the fix; ``where`` follows ``W=...``, e.g.
        ``" (--nproc)"``), or ``None``. Checked by the launcher and by every worker."""
        return None

    def usage_problem(self, cfg) -> str | None:
        """Why this workload does not run with the other flags of ``cfg`` (parsed args or a
        ``RunConfig``): ``--model``, ``--hierarchy flat``, ``--mixed-precision``,
        ``--qk-clip`` or ``--rest`` where its class attributes fix them. One line, or ``None``."""
        from verify.workload.usermodel import BUILTIN

        qk = getattr(cfg, "qk_clip", getattr(cfg, "qk_clip_tau", None))
        fixed = [(self.model_why, cfg.model != BUILTIN, f"--model {cfg.model}"),
                 (self.qk_clip_why, qk is not None, "--qk-clip"),
                 (self.mixed_precision_why, cfg.mixed_precision is not None,
                  f"--mixed-precision {cfg.mixed_precision}"),
                 (self.flat_why, cfg.hierarchy == "flat", "--hierarchy flat"),
                 (self.rest_why, self.rest is not None and cfg.rest != self.rest, f"--rest {cfg.rest}")]
        for why, bad, flag in fixed:
            if why is not None and bad:
                return f"{self.flags(cfg)} runs without {flag}: {why}."
        return None

    def source(self, config, global_batch: int):
        """The run's model (``verify.workload.usermodel.ModelSource``), or ``None``: ``--model``."""
        return None

    def start(self, mode: str, config, *, make_model: Callable, made: list, corpus,
              global_batch: int) -> Running:
        """Build ``mode`` under ``config`` (a ``verify.run.runner.RunConfig``).

        Args:
            make_model: builds a fresh model (seeded) and appends ``(model, loss_fn)`` to ``made``.
            corpus: the byte corpus (``verify.workload.data.ByteCorpus``) or ``None``.
            global_batch: sequences per step over all ranks.

        Raises:
            ValueError: ``config`` asks for what this workload does not run (:meth:`usage_problem`).
        """
        from verify.modes.build import build

        self.check(config)
        built = build(mode, make_model, config.device, config.mixed_precision, config.coalesce,
                      config.rest, config.hierarchy, qk_clip_tau=config.qk_clip_tau)
        return Running(built, made[-1][1])

    def check(self, config) -> None:
        """Raise ``ValueError`` with :meth:`usage_problem`'s line where ``config`` has one
        (the library-level guard of what the CLI refuses)."""
        why = self.usage_problem(config)
        if why is not None:
            raise ValueError(f"Invalid RunConfig: {why}")
