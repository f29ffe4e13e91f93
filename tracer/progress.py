"""Progress bars: tqdm on stderr, only where stderr is a terminal.

Parsers show a bar for inputs over ~50 MB (:func:`byte_progress`); verify-traffic shows its
training steps (:func:`terminal_bar`). Every run whose stderr is a file or a pipe (CI, a log,
``2>&1 | tee``) shows nothing; tqdm is imported only when a bar is shown.
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


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` is an open terminal (False for files, pipes, a closed stream)."""
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def wants_progress(total_bytes: int, enabled: bool = True) -> bool:
    """Whether to show a bar: ``enabled``, ``total_bytes`` >= :data:`PROGRESS_MIN_BYTES`, and
    stderr is a terminal."""
    return enabled and total_bytes >= PROGRESS_MIN_BYTES and stderr_is_terminal()


def terminal_bar(total: int, *, desc: str, unit: str):
    """A ``tqdm`` bar of ``total`` ``unit`` on stderr where :func:`stderr_is_terminal`, else
    ``None`` (callers skip their updates)."""
    if not stderr_is_terminal():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


class _Bar:
    """Advances by each finished file's size (no-op when no bar is shown)."""

    def __init__(self, bar) -> None:
        self._bar = bar

    def update(self, path: str | Path) -> None:
        if self._bar is not None:
            self._bar.update(_size(Path(path)))


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
