"""``dmuon-trace``: turn raw traces into canonical events (Parquet, ``tracer.events``).

Subcommands (each module registers its own parser, see ``register_cli`` in it):

- ``nccl PATH... --out events.parquet``: NCCL_DEBUG=INFO logs (``tracer.nccl.log``)
- ``fr PATH... --out events.parquet``: PyTorch Flight Recorder dumps (``tracer.fr.parse``)
- ``nsys REPORT.sqlite --out events.parquet``: Nsight Systems SQLite exports (``tracer.nsys.parse``)
- ``profiler TRACE... --out events.parquet``: torch.profiler Chrome traces (``tracer.profiler``)

Comparing events with a prediction is ``dmuon-verify check`` (``verify/cli.py``): the tracer
never imports the harness.

Exit status, every subcommand: 0 events written, every input read; 1 events written but
some lines, entries or rows of the inputs were dropped as issues (listed in the summary; an
impossible call, e.g. a root outside its communicator or ``[nranks=0]``, is one) unless
``--lenient``, which accepts them with exit 0; 2 bad input or arguments
(a missing path, a damaged export, ``--out`` a folder or unwritable, ``--strict`` and a damaged
entry: nothing written), or an input file not read or not read to its end (binary, not the
format, unreadable, a truncated gzip, a FIFO: the events of the other files are written and
the summary names each such file with its reason); 3 nothing found (no events in the
readable inputs, or no readable input: nothing written). Gzipped inputs (known by their
first bytes, whatever the name) are read decompressed by nccl, fr and profiler. Errors go
to stderr, summaries to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

#: Exit codes shared by every subcommand (see the module docstring).
EXIT_OK, EXIT_DROPPED, EXIT_BAD_INPUT, EXIT_NOTHING_FOUND = 0, 1, 2, 3

#: Subcommand -> (module with ``register_cli(subparsers)``, one-line help). A module is
#: imported only when its subcommand runs, so ``--help`` and each parser start fast; adding a
#: source is one line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "nccl": ("tracer.nccl.log", "NCCL_DEBUG=INFO logs -> events.parquet"),
    "fr": ("tracer.fr.parse", "PyTorch Flight Recorder dumps -> events.parquet"),
    "nsys": ("tracer.nsys.parse", "Nsight Systems SQLite export -> events.parquet"),
    "profiler": ("tracer.profiler", "torch.profiler (Kineto) Chrome traces -> events.parquet"),
}

#: Argument names that are output files, checked before any parsing starts.
OUTPUT_ARGS = ("out", "details_out", "kernels_out")


def output_path_problem(path: str | Path, flag: str = "--out") -> str | None:
    """Why ``path`` cannot be written as an output file, or ``None`` when it can.

    It must not be a folder; its nearest existing ancestor must be a writable folder (missing
    folders are created by the writers); an existing file must be writable.
    """
    path = Path(path)
    if path.is_dir():
        return (f"Invalid {flag} {str(path)!r}: it is a folder. Must be a file path, e.g. "
                f"{str(path / 'events.parquet')!r}.")
    if path.exists():
        if not os.access(path, os.W_OK):
            return f"Invalid {flag} {str(path)!r}: the file is not writable. Must be writable."
        return None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return (f"Invalid {flag} {str(path)!r}: {str(parent)!r} is not a folder. Must be a "
                "path under a folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        return (f"Invalid {flag} {str(path)!r}: folder {str(parent)!r} is not writable. Must "
                "be a path you can write.")
    return None


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first non-option word), if it is a known one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in SUBCOMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``dmuon-trace`` parser; only ``command``'s module is imported (all with ``"*"``)."""
    parser = argparse.ArgumentParser(
        prog="dmuon-trace",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_line) in SUBCOMMANDS.items():
        if command in (name, "*"):
            importlib.import_module(module).register_cli(subparsers)
            subparsers.choices[name].add_argument(
                "--lenient", action="store_true",
                help="exit 0 even when lines, entries or rows were dropped as issues "
                     "(default: exit 1; they are listed in the summary either way)")
        else:  # listed in --help without importing the parser behind it
            subparsers.add_parser(name, help=help_line)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dmuon-trace``; returns the process exit code (see module docstring).

    Raises:
        SystemExit: (2) from argparse on unknown arguments, as every argparse program does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_command_of(argv)).parse_args(argv)
    prog = f"dmuon-trace {args.command}"
    for name in OUTPUT_ARGS:
        value = getattr(args, name, None)
        problem = value is not None and output_path_problem(value, "--" + name.replace("_", "-"))
        if problem:
            print(f"{prog}: error: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if getattr(args, "strict", False) and args.lenient:
        print(f"{prog}: error: --strict and --lenient exclude each other (--strict stops at the "
              "first issue, --lenient accepts every issue); pass one", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        code = int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # user-facing: a damaged or unwritable file
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    dropped, first = getattr(args, "dropped", (0, ""))  # set by the subcommand's parser
    if code == EXIT_OK and dropped and not args.lenient:
        print(f"{prog}: error: {dropped} line(s), entries or rows dropped as issues (listed "
              f"above; first: {first}); the other events were written. Fix the input, or pass "
              "--lenient to accept the loss", file=sys.stderr)
        return EXIT_DROPPED
    return code


if __name__ == "__main__":
    sys.exit(main())
