"""Input files shared by the ``dmuon-trace`` parsers: gzip known by its first bytes, and
folder listings that name every entry they leave out.

- :func:`is_gzip`: a file starting with ``1f 8b`` (RFC 1952) is read decompressed by every
  parser of text or JSON (NCCL logs, Flight Recorder dumps, profiler traces), whatever its
  name; :func:`read_bytes` returns a file's bytes so.
- :func:`not_regular`: why a folder entry is not a file to read (a FIFO, a socket, a device,
  a folder behind a symlink, a broken symlink), without opening it (opening a FIFO blocks).
- :func:`folder_entries`: the non-hidden entries of a folder that are not folders (symlinks to
  folders included, to be named): a parser reads each one or names it with its reason.

No parser state: plain functions. Nothing here imports torch, ``dmuon`` or ``verify``.
"""

from __future__ import annotations

import gzip
import stat
import zlib
from pathlib import Path

#: The two first bytes of a gzip file (RFC 1952).
GZIP_MAGIC = b"\x1f\x8b"
#: What reading a gzip stream can raise besides ``OSError`` (truncated, damaged).
GZIP_ERRORS = (OSError, EOFError, zlib.error)


def is_gzip(path: str | Path) -> bool:
    """Whether the file starts with :data:`GZIP_MAGIC` (``OSError`` when it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def gzip_problem(exc: BaseException) -> str:
    """A reader's words for what reading a gzip stream raised."""
    if isinstance(exc, EOFError):
        return f"the gzip stream ends early (a truncated file?): {exc}"
    if isinstance(exc, (zlib.error, gzip.BadGzipFile)):
        return f"damaged gzip data: {exc}"
    return f"{type(exc).__name__}: {exc}"


def read_bytes(path: str | Path, what: str = "file") -> bytes:
    """The bytes of ``path``, decompressed when it is gzip (:func:`is_gzip`).

    Raises:
        OSError: the file cannot be read.
        ValueError: its gzip stream is truncated or damaged (the message names ``what`` and
            the file).
    """
    raw = Path(path).read_bytes()
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except GZIP_ERRORS as exc:
        raise ValueError(f"Invalid {what} {str(path)!r}: {gzip_problem(exc)}. Must be complete "
                         "(decompress it with gunzip to see what is left).") from None


def not_regular(path: Path) -> str | None:
    """Why ``path`` is not a regular file to read (``None`` when it is one), without opening
    it: ``"broken symlink"``, ``"not a regular file (a FIFO)"``, ..."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "broken symlink" if path.is_symlink() else "vanished while listing"
    except OSError as exc:
        return f"cannot read ({exc})"
    if stat.S_ISREG(mode):
        return None
    kind = ("a folder behind a symlink (not followed)" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
    return f"not a regular file ({kind})"


def folder_entries(folder: Path, *, recursive: bool = False, glob: str = "*") -> list[Path]:
    """Entries of ``folder`` matching ``glob`` (recursively with ``recursive``), sorted, that
    are not folders (a symlink to a folder is listed: it is not followed, and is to be named)
    and not hidden (no path part below ``folder`` starts with ``.``)."""
    found = folder.rglob(glob) if recursive else folder.glob(glob)
    return sorted(q for q in found
                  if not any(part.startswith(".") for part in q.relative_to(folder).parts)
                  and (q.is_symlink() or not q.is_dir()))
