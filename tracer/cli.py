"""``dmuon-trace``: turn raw traces into canonical events and check them against a prediction.

Subcommands (each module registers its own, see ``register_cli`` in it):

- ``nccl PATH... --out events.parquet``: NCCL_DEBUG=INFO logs (``tracer.nccl_log``)
- ``fr PATH... --out events.parquet``: PyTorch Flight Recorder dumps (``tracer.flight_recorder``)
- ``nsys REPORT.sqlite --out events.parquet``: Nsight Systems SQLite exports (``tracer.nsys``)
- ``profiler TRACE... --out events.parquet``: torch.profiler Chrome traces (``tracer.profiler``)
- ``check EVENTS --against REPORT_OR_RUN``: compare events with a predicted run (``verify.check``)
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that provide ``register_cli(subparsers)``; each sets ``func`` on its parser.
_SUBCOMMAND_MODULES = (
    "tracer.nccl_log",
    "tracer.flight_recorder",
    "tracer.nsys",
    "tracer.profiler",
    "verify.check",
)


def build_parser() -> argparse.ArgumentParser:
    """The full ``dmuon-trace`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="dmuon-trace",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        module = importlib.import_module(name)
        module.register_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dmuon-trace``; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
