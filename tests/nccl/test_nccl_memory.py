"""Memory on one hostile physical line: the traced peak of
``write_nccl_parquet`` (what ``dmuon-trace nccl`` runs) on a 2-3 MB line of each shape of
``tests/tools/nccl_hostile.py`` (16 MB in the ``slow`` run) stays within

    3 x the line's size + a fixed 6 MiB (12 MiB with 65,536-row Parquet row groups)
    (+ 0.5 KiB per distinct communicator the line names)

Why those terms: the file's bytes and the line's text are held while it is parsed (2x: a
long non-ASCII line is held one byte per character, ``tracer.nccl.formats.ByteLine``), a
line with terminal colours is cleaned into a copy (the third 1x), and the rest is bounded
whatever the line's size: records are resolved 4096 at a time, issues keep excerpts, and the
Parquet writer holds one row group of rows (the fixed term covers it and one flush of
records). Communicators are state kept
for the whole parse (the summary lists each one), so a line naming thousands of distinct
ones costs that too. Without that bound a 50 MB line cost up to 24x its size (1,216 MiB).

tracemalloc counts Python objects and numpy arrays (Arrow's own pool is not traced), which
makes the check deterministic; ``benchmarks/bench_nccl_parser.py --line-mb 50`` measures the
peak RSS of a child process on 50 MB lines.
"""

from __future__ import annotations

import tracemalloc

import pytest

from tests.tools import nccl_hostile as H
from tracer.nccl import log as nccl_log
from tracer.nccl.log import write_nccl_parquet

FACTOR, FIXED, PER_COMM = 3.0, 6 * 2**20, 512
#: Rows per Parquet row group here (the writer's default holds 65,536 rows, about 10 MiB of
#: arrays: a constant, but one that would hide a multiple of a 3 MB line).
ROW_GROUP_ROWS = 8192
#: Line size per shape in ``make test``: 3 MB, and 2 MB for the shapes with a record every
#: few bytes (slow under tracemalloc). Either tells the old 6-24x from the bound; the
#: ``slow`` variant runs every shape at 16 MB with the writer's own row groups.
SIZES = {name: 3_000_000 for name in H.NAMES} | {
    "markers": 2_000_000, "prefixed markers": 2_000_000, "op heads": 2_000_000}


def _peak(tmp_path, shape: str, size: int, fixed: int = FIXED) -> None:
    path = tmp_path / "line.log"
    size = H.write_line(path, shape, size)
    warm = tmp_path / "warm.log"
    H.write_line(warm, "records", 4000)
    write_nccl_parquet([warm], tmp_path / "warm.parquet")  # imports and caches first
    tracemalloc.start()
    try:
        res = write_nccl_parquet([path], tmp_path / "out.parquet", max_issues=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = FACTOR * size + fixed + PER_COMM * len(res.comms)
    assert peak <= bound, (f"{shape}: peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB "
                           f"({peak / size:.2f}x the line)")
    assert res.stats.lines == 1 and len(res.issues) <= 10


#: The shapes slowest under tracemalloc (5-7 s each on 2 cores) run in ``make test-all`` only;
#: the 16 MB variant below covers every shape there.
SLOW_SHAPES = {"op heads", "markers", "zero-width op names", "INIT lines", "records of distinct comms",
               "records without prefix", "prefixed markers", "colours"}


@pytest.mark.parametrize("shape", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SHAPES else n
                                   for n in H.NAMES])
def test_peak_memory_on_one_hostile_line_is_bounded(tmp_path, monkeypatch, shape):
    monkeypatch.setattr(nccl_log, "ROW_GROUP_ROWS", ROW_GROUP_ROWS)
    _peak(tmp_path, shape, SIZES[shape])


@pytest.mark.slow
@pytest.mark.parametrize("shape", H.NAMES)
def test_peak_memory_on_one_16_mb_line_is_bounded(tmp_path, shape):
    _peak(tmp_path, shape, 16_000_000, 12 * 2**20)
