"""``dmuon-plan``'s input: its argument parser, ``--mesh`` and ``--dtype`` parsing, the bounds
it accepts and the warnings it gives (used by :mod:`verify.plan.cli`).

Every bad input is a :class:`UsageError` (one line; ``dmuon-plan`` prints it on stderr and
exits 2): an unknown flag or a flag's bad value (argparse), a mesh that is not ``N`` or
``RxN`` of positive integers, a mesh above :data:`MAX_WORLD_SIZE` ranks (the job's W with
``--tp`` / ``--ep`` / ``--pp`` / ``--cp``: checked by each kind, :mod:`verify.plan.kind`), an unknown
``--dtype``, a non-finite or non-positive bandwidth / TFLOP rate.

Warnings (stderr, exit 0) mark meshes the α-β model of :class:`verify.traffic.scale.CostModel`
does not describe well (:func:`mesh_warnings`; W = R·N·T with ``--tp T``): W = 1 (no
collectives), a shard size that is neither a divisor nor a multiple of the GPUs per node
(groups straddle nodes, or a node is partly used), shard size 1 with R > 1 (HSDP without a
shard axis), and W above :data:`LARGE_WORLD_SIZE`.
"""

from __future__ import annotations

import argparse
import math
import re
import textwrap

#: Largest world size dmuon-plan plans (ranks): the plan and the per-shard tallies grow with
#: W (about 20 s for llama-tiny at W = 2**20 on one core, the memory table included); above it, exit 2.
MAX_WORLD_SIZE = 2**20
#: Above this many ranks a warning: the cost model has one flat network tier (every GPU its
#: own NIC at full bandwidth, one latency per call), while clusters that large add tiers.
LARGE_WORLD_SIZE = 32_768

#: ``--dtype`` values: the dtype every param carries in the collectives -> bytes per element.
DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
#: Accepted short names of :data:`DTYPES`.
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
    "fp32": "float32", "f32": "float32", "float": "float32",
    "fp64": "float64", "f64": "float64", "double": "float64",
}
#: ``--dtype model``: keep each param's own dtype.
MODEL_DTYPE = "model"


class UsageError(ValueError):
    """A bad ``dmuon-plan`` input; its message is the one line printed on stderr (exit 2)."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help text wrapped at spaces only, so that names like ``llama-tiny`` stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise :class:`UsageError` (one line, no usage block)."""

    def error(self, message: str):  # noqa: D401 (argparse's name)
        raise UsageError(f"{message.rstrip('.')}. See dmuon-plan --help.")


def parse_dtype(text: str) -> str:
    """``--dtype``: a name of :data:`DTYPES`, an alias, or ``model``; returns the canonical
    name.

    Raises:
        argparse.ArgumentTypeError: anything else (the message lists the valid ones).
    """
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name != MODEL_DTYPE and name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid dtype {text!r}: must be one of {', '.join([MODEL_DTYPE, *DTYPES])} "
            f"(or {', '.join(DTYPE_ALIASES)})")
    return name


def parse_mesh(text: str) -> tuple[int, int]:
    """``"N"`` -> (1, N); ``"RxN"`` -> (R, N), positive integers, R·N at most
    :data:`MAX_WORLD_SIZE`.

    Raises:
        ValueError: anything else.
    """
    parts = text.strip().lower().split("x")
    sizes = [int(p) for p in parts if _DIGITS.fullmatch(p.strip())]
    if len(sizes) != len(parts) or len(sizes) not in (1, 2) or any(s < 1 for s in sizes):
        raise ValueError(
            f"Invalid mesh={text!r}. Must be N (a 1-D mesh of N ranks) or RxN (HSDP: R replicas "
            "of N-way shards), positive integers, e.g. 64 or 128x8."
        )
    r, n = (1, sizes[0]) if len(sizes) == 1 else (sizes[0], sizes[1])
    if r * n > MAX_WORLD_SIZE:
        raise ValueError(f"Invalid mesh={text!r}: W = {r * n:,} ranks. Must be at most "
                         f"{MAX_WORLD_SIZE:,} (dmuon-plan's bound: time and memory grow with W).")
    return r, n


#: An unsigned decimal integer of at most 18 ASCII digits (Python's int() also takes other
#: scripts' digits and underscores; the mesh and GPU count are plain numbers).
_DIGITS = re.compile(r"[0-9]{1,18}")


def _mesh(text: str) -> tuple[int, int]:
    try:
        return parse_mesh(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _number(kind: str, positive: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                f"invalid {kind} {text!r}: must be a finite number {'> 0' if positive else '>= 0'}")
        return value
    return parse


def _gpus(text: str) -> int:
    if not _DIGITS.fullmatch(text.strip()) or not 1 <= int(text) <= 999_999_999:
        raise argparse.ArgumentTypeError(f"invalid GPU count {text!r}: must be an integer "
                                         "from 1 to 999,999,999")
    return int(text)


def mesh_warnings(mesh: tuple[int, int], gpus_per_node: int,
                  model_parallel: dict[str, int] | None = None) -> list[str]:
    """The warnings for an (R, N) mesh times the ``model_parallel`` degrees (flag -> degree,
    e.g. ``{"tp": T}``: the job has W = R·N·T ranks) on nodes of ``gpus_per_node`` GPUs
    (module docstring), one line each; ``[]`` for a mesh the cost model describes."""
    r, n = mesh
    degrees = {flag: d for flag, d in (model_parallel or {}).items() if d > 1}
    w, g = r * n * math.prod(degrees.values()), gpus_per_node
    text = " ".join([f"{r}x{n}" if r > 1 else str(n), *(f"--{flag} {d}" for flag, d in degrees.items())])
    out = []
    if w == 1:
        out.append(f"mesh {text}: W = 1 has no collectives; every traffic and communication "
                   "figure is 0 (the cost model describes W >= 2).")
    if r > 1 and n == 1:
        out.append(f"mesh {text}: shard size 1, so the HSDP modes have no shard axis (every "
                   f"rank holds everything); a 1-D mesh of {w} plans the DDP modes.")
    if r * n > g and n % g and g % n:  # the (R, N) table's groups
        what = "shard groups straddle nodes" if r > 1 else "the last node is partly used"
        out.append(f"mesh {text}: shard size {n} is neither a divisor nor a multiple of "
                   f"{g} GPUs per node ({what}); the cost model prices any group that leaves a "
                   "node at the network rate.")
    if w > LARGE_WORLD_SIZE:
        out.append(f"mesh {text}: W = {w:,} > {LARGE_WORLD_SIZE:,}; the cost model has one flat "
                   "network tier, so times at this scale are optimistic.")
    return out


def build_parser(defaults, presets, sweep_worlds) -> argparse.ArgumentParser:
    """dmuon-plan's parser. ``defaults``: a :class:`verify.traffic.scale.CostModel` (flag
    defaults); ``presets``: names for ``--model``'s help; ``sweep_worlds``: ``--sweep``'s W."""
    d = defaults
    p = _Parser(
        prog="dmuon-plan",
        formatter_class=_Formatter,
        description="Size a DMuon job before running it: NS balance, traffic, calls, memory and\n"
                    "time per mode. Results for the presets: docs/scaling.md. Traffic model:\n"
                    "docs/spec.md §2 and docs/traffic-model.md.",
        epilog=f"exit codes:\n"
               f"  0  a plan was printed (warnings, if any, on stderr; a model without\n"
               f"     Muon-target params gets an empty plan that says so)\n"
               f"  2  bad input: one line on stderr\n"
               f"bounds and warnings:\n"
               f"  W = R·N (R·N·T with --tp) at most {MAX_WORLD_SIZE:,} ranks (exit 2 above).\n"
               f"  Warnings (W = R·N·T with --tp) for W = 1, a shard size N that is neither\n"
               f"  a divisor nor a multiple of --gpus-per-node (when R·N exceeds one node),\n"
               f"  N = 1 with R > 1, and W > {LARGE_WORLD_SIZE:,}.",
    )
    p.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(presets)}) or pkg.module:factory (called on the "
                        "meta device; it must return an nn.Module)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--mesh", type=_mesh, metavar="N|RxN",
                      help="N: a 1-D mesh of N ranks (DDP / FSDP2 modes); RxN: HSDP, R replicas "
                           f"of N-way shards; W = R·N at most {MAX_WORLD_SIZE:,}")
    what.add_argument("--sweep", action="store_true",
                      help=f"W = {sweep_worlds[0]}..{sweep_worlds[-1]}: 1-D and, above one node, "
                           "HSDP with N = --gpus-per-node")
    p.add_argument("--tp", type=_gpus, default=1, metavar="T",
                   help="tensor-parallel degree: the mesh is R x N x T (W = R·N·T) and the report "
                        "adds the TP terms and the NS balance with TP (verify/plan/tp.py)")
    p.add_argument("--ep", type=_gpus, default=1, metavar="E",
                   help="expert-parallel degree: the mesh is R x N x E (x T with --tp; W = R·N·E·T), "
                        "expert stacks sharded over E, and the report adds the EP section; the "
                        "table above it is the same W without EP (verify/plan/ep.py)")
    p.add_argument("--pp", type=_gpus, default=1, metavar="S",
                   help="pipeline stages: the mesh is S x R x N (x T with --tp), the model's blocks "
                        "cut into S contiguous stages, each planned on its own (R, N) slice; the "
                        "report adds the PP section (verify/plan/pp.py)")
    p.add_argument("--microbatches", type=_gpus, default=8, metavar="M",
                   help="micro-batches per step with --pp (default %(default)s)")
    p.add_argument("--microbatch-tokens", type=_gpus, default=4096, metavar="TOKENS",
                   help="tokens of one micro-batch on one data-parallel rank, for the stage-to-stage "
                        "send/recv with --pp (default %(default)s)")
    p.add_argument("--cp", type=_gpus, default=1, metavar="C",
                   help="context-parallel degree: the mesh is R x N x C (x T with --tp), cp declared "
                        "a shard dim, so the table is the mesh R x N·C (DMuon's N_eff = N·C) and the "
                        "report adds the CP section (verify/plan/cp.py)")
    p.add_argument("--cp-tokens", type=_gpus, default=8192, metavar="TOKENS",
                   help="tokens of one rank's part of its sequences per step, for the attention's K/V "
                        "exchange with --cp (default %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print JSON (schema_version, dtype, element_bytes, units, warnings, "
                        "cost_model, reports) instead of the table")
    p.add_argument("--png", metavar="PATH", help="plot bytes and NS time against W (sweeps the W range)")
    p.add_argument("--dtype", default="bfloat16", type=parse_dtype, metavar="DTYPE",
                   help=f"dtype of every param in the collectives: {', '.join(DTYPES)} (or "
                        f"{', '.join(DTYPE_ALIASES)}), or '{MODEL_DTYPE}' to keep the model's "
                        "(default %(default)s)")
    p.add_argument("--gpus-per-node", type=_gpus, default=d.gpus_per_node, metavar="GPUS",
                   help="GPUs per node (default %(default)s)")
    p.add_argument("--intra-gbps", type=_number("bandwidth", True), default=d.intra_gbps,
                   metavar="GBPS",
                   help="NVLink GB/s (default %(default)s)")
    p.add_argument("--inter-gbps", type=_number("bandwidth", True), default=d.inter_gbps,
                   metavar="GBPS",
                   help="per-GPU network GB/s (default %(default)s)")
    p.add_argument("--intra-alpha-us", type=_number("latency", False), default=d.intra_alpha_us,
                   metavar="US",
                   help="µs per call within a node (default %(default)s)")
    p.add_argument("--inter-alpha-us", type=_number("latency", False), default=d.inter_alpha_us,
                   metavar="US",
                   help="µs per call across nodes (default %(default)s)")
    p.add_argument("--tflops", type=_number("rate", True), default=d.tflops, metavar="TFLOPS",
                   help="NS TFLOP/s (default %(default)s)")
    return p
