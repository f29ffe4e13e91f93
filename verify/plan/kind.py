"""The parallel kinds of ``dmuon-plan`` (``--tp``, ``--ep``, ``--pp``, ``--cp``): what each
answers the CLI.

Each kind's module (:mod:`verify.plan.tp`, :mod:`~verify.plan.ep`, :mod:`~verify.plan.pp`,
:mod:`~verify.plan.cp`) defines ``KIND``, a :class:`PlanKind`; :mod:`verify.plan.cli` loops over
them and holds no rule of its own about a kind. Per kind: its flag, the flags and inputs it
refuses (:meth:`PlanKind.refusal`), its world size W against
:data:`verify.plan.args.MAX_WORLD_SIZE` (:meth:`PlanKind.world_error`), the (R, N) mesh the
report's table is planned on (:meth:`PlanKind.table_mesh`), its report section
(:meth:`PlanKind.section`, JSON-able, under ``reports[0][flag]``) and that section as text
(:meth:`PlanKind.format`). A kind is given when its degree (``args.<flag>``) is above 1.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable

from verify.plan.args import MAX_WORLD_SIZE


def given(args: argparse.Namespace, flag: str) -> bool:
    """Whether the kind of ``flag`` (``"tp"``, ``"ep"``, ``"pp"``, ``"cp"``) is in the layout:
    its degree is above 1."""
    return getattr(args, flag) > 1


@dataclass(frozen=True)
class PlanContext:
    """What a kind's section is computed from.

    Attributes:
        args: dmuon-plan's parsed arguments.
        ml: the model (:class:`verify.plan.cli.ModelLayout`).
        config: the model's ``config`` attribute, or ``None``.
        mesh: the (R, N) of ``--mesh``, as given (``None`` under ``--sweep``).
        table_mesh: the (R, N) the report's table is planned on (``mesh`` after every given
            kind's :meth:`PlanKind.table_mesh`).
        coalesce_bytes: DMuon's unit target in bytes (``coalesce="auto"``, the table's).
        dtype_bytes: bytes per element of ``--dtype`` (``None`` under ``--dtype model``).
        tflops: the cost model's NS rate, TFLOP/s.
        report: ``(ModelLayout, (R, N)) -> dict``, the mesh report of the table
            (:func:`verify.plan.cli.report` with the cost model).
    """

    args: argparse.Namespace
    ml: object
    config: object
    mesh: tuple[int, int] | None
    table_mesh: tuple[int, int] | None
    coalesce_bytes: int
    dtype_bytes: int | None
    tflops: float
    report: Callable[[object, tuple[int, int]], dict]


class PlanKind:
    """One parallel kind of dmuon-plan (module docstring). Subclasses set :attr:`flag`,
    :attr:`world_formula`, :attr:`world_fix` and define :meth:`section` and :meth:`format`."""

    #: the flag without dashes, also the key of the section in ``reports[0]``
    flag: str = ""
    #: the other degrees the job's W multiplies by, flag -> letter, e.g. ``{"tp": "T"}``:
    #: W = degree·R·N·∏ them (the error names those given, and their letters)
    times: dict[str, str] = {}
    #: W's formula in the too-large error without :attr:`times`' letters, e.g. ``"R·N·T"``
    world_formula: str = ""
    #: what follows "Must be at most <bound>" in that error, through its final period
    world_fix: str = "."
    #: compute the section before the report's table, so that a bad degree for this model
    #: exits without planning the table
    before_table: bool = False

    def degree(self, args: argparse.Namespace) -> int:
        return getattr(args, self.flag)

    def given(self, args: argparse.Namespace) -> bool:
        """Whether this kind is in the layout (:func:`given`)."""
        return given(args, self.flag)

    def refusal(self, args: argparse.Namespace) -> str | None:
        """The error line when this kind cannot be planned with the other flags (checked before
        the model is built, only when the kind is given), or ``None``."""
        return None

    def _with(self, args: argparse.Namespace, other: str, usage: str) -> str:
        return f"Invalid --{self.flag} {self.degree(args)} with {other}. {usage}"

    def world_error(self, args: argparse.Namespace, mesh: tuple[int, int] | None) -> str | None:
        """The error line when the job's W on ``mesh`` (the table's (R, N) so far) exceeds
        :data:`verify.plan.args.MAX_WORLD_SIZE`, or ``None`` (also with no mesh)."""
        if mesh is None:
            return None
        r, n = mesh
        given = {flag: getattr(args, flag) for flag in self.times if getattr(args, flag) != 1}
        w = self.degree(args) * r * n * math.prod(given.values())
        if w <= MAX_WORLD_SIZE:
            return None
        also = "".join(f" --{flag} {d}" for flag, d in given.items())
        formula = self.world_formula + "".join(f"·{self.times[flag]}" for flag in given)
        return (f"Invalid --{self.flag} {self.degree(args)} on mesh {r}x{n}{also}: W = "
                f"{formula} = {w:,} ranks. Must be at most {MAX_WORLD_SIZE:,}{self.world_fix}")

    def table_mesh(self, args: argparse.Namespace, mesh: tuple[int, int]) -> tuple[int, int]:
        """The (R, N) the report's table is planned on when this kind is given (default:
        ``mesh`` unchanged)."""
        return mesh

    def section(self, ctx: PlanContext) -> dict:
        """This kind's report section (JSON-able).

        Raises:
            ValueError: an input this kind cannot plan (a :class:`verify.plan.args.UsageError`
                for a bad flag value).
        """
        raise NotImplementedError

    def format(self, section: dict) -> str:
        """:meth:`section`'s result as the text printed under the table."""
        raise NotImplementedError
