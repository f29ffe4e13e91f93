"""Progress bars for big inputs: tqdm on stderr, only for a terminal and inputs over ~50 MB.

Parsers of small files (and every run whose stderr is a file or a pipe, as in CI) show
nothing; tqdm is imported only when a bar is shown.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: Inputs smaller than this (bytes, all files together) get no progress bar.
PROGRESS_MIN_BYTES = 50 * 1024 * 1024


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def wants_progress(total_bytes: int, enabled: bool = True) -> bool:
    """Whether to show a bar: ``enabled``, ``total_bytes`` >= :data:`PROGRESS_MIN_BYTES`, and
    stderr is a terminal."""
    return (enabled and total_bytes >= PROGRESS_MIN_BYTES
            and hasattr(sys.stderr, "isatty") and sys.stderr.isatty())


class _Bar:
    """Advances by each finished file's size (no-op when no bar is shown)."""

    def __init__(self, bar) -> None:
        self._bar = bar

    def update(self, path: str | Path) -> None:
        if self._bar is not None:
            self._bar.update(_size(Path(path)))

    def advance(self, n_bytes: int) -> None:
        if self._bar is not None:
            self._bar.update(n_bytes)


@contextmanager
def byte_progress(files: Sequence[str | Path], *, desc: str,
                  enabled: bool = True) -> Iterator[_Bar]:
    """A bar over the total size of ``files`` (bytes, on stderr), if :func:`wants_progress`."""
    total = sum(_size(Path(f)) for f in files)
    if not wants_progress(total, enabled):
        yield _Bar(None)
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr) as bar:
        yield _Bar(bar)
