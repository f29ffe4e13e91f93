"""``bin/dmuon-ci``: the CI entry point of Phase D's runs, whose exit status is the run's own.

GNU make can only exit 0 or 2 (its manual, "Exit Status"), so ``make verify-traffic``,
``make gpu-check`` and ``make nsys-verify`` keep pass / fail and lose which failure it was.
Every run therefore records its exit code in its output folder, in the file ``exit_code``
(one line, the number), and prints it on stderr; ``bin/dmuon-ci TOOL [ARGS...]`` runs the
tool directly (no make) and exits with that code exactly::

    bin/dmuon-ci verify-traffic --nproc 4      # = make verify-traffic ARGS="--nproc 4"
    bin/dmuon-ci gpu-check                      # = make gpu-check
    bin/dmuon-ci nsys-verify                    # = make nsys-verify

Exit codes (:data:`MEANINGS`): 0 pass, 1 a check failed (a run that crashed, hung or was
interrupted included), 2 bad input (usage), 3 missing hardware or tools (nothing run), 4
(nsys-verify only) a step of the pipeline failed, 5 the output could not be written (the disk
holding the output folder is full, or a quota or permission refused a write). A code found later
in a folder is read with :func:`read_exit_code` (``bin/dmuon-ci code DIR``).

A full disk must still leave a code to read: a launcher reserves ``exit_code`` when its run
starts (:func:`reserve_exit`, a placeholder of :data:`RESERVED_BYTES` bytes) and every later
write of a code rewrites those bytes in place (:func:`write_code`), which needs no new block on
the filesystem. A folder whose ``exit_code`` still holds the placeholder is a run that did not
end (still running, or killed).

Nothing here imports torch: ``bin/dmuon-ci code`` works anywhere.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path

#: File in a run's output folder holding its exit code.
EXIT_FILE = "exit_code"
#: Exit codes and what they mean (docs/verify.md, "Exit codes and CI").
MEANINGS = {0: "pass", 1: "a check failed", 2: "bad input", 3: "missing hardware or tools",
            4: "a step failed", 5: "output not written"}
#: The code of a run whose output could not be written (:func:`is_disk_full`, :func:`disk_full_text`).
EXIT_OUTPUT = 5
#: What a reserved ``exit_code`` holds until the run writes its code (:func:`reserve_exit`).
RESERVED = "running"
#: Bytes reserved: the placeholder padded, more than any code and its newline.
RESERVED_BYTES = 16
#: ``OSError.errno`` values that mean the filesystem refused to grow a file.
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: ``bin/dmuon-ci`` tools: name -> module whose ``main(argv) -> int`` runs it.
TOOLS = {"verify-traffic": "verify.run.launch", "gpu-check": "verify.run.gpu_check",
         "nsys-verify": "verify.sources.nsys_verify"}


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a filesystem refusing to grow a
    file: no space left, a quota exceeded, a file-size limit (:data:`FULL_ERRNOS`)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_text(path: Path, exc: BaseException) -> str:
    """One line for a write refused for lack of space: the file, the error, the free bytes of
    its filesystem (``shutil.disk_usage``) and the fix."""
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        free = f"{shutil.disk_usage(folder).free:,} bytes free on the filesystem of {folder}"
    except OSError:
        free = f"free space of {folder} unknown"
    return (f"the disk is full: writing {path} failed ({exc}; {free}). Free space there or pass "
            "--out-dir on another filesystem, then run again.")


def write_code(path: Path, code: int | str) -> None:
    """Write ``code`` and a newline into ``path`` in place (no truncation first, then cut to its
    length), so a file reserved by :func:`reserve_exit` takes it on a full filesystem.

    Raises:
        OSError: the file cannot be opened or written.
    """
    data = f"{code}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def reserve_exit(out_dir: Path) -> None:
    """Reserve ``<out_dir>/exit_code`` (:data:`RESERVED` padded to :data:`RESERVED_BYTES`),
    so that the run's code can be written there even once its disk is full.

    Raises:
        OSError: the folder cannot be written.
    """
    write_code(Path(out_dir) / EXIT_FILE, RESERVED.ljust(RESERVED_BYTES - 1))


def read_code(out_dir: Path) -> int | None:
    """The code in ``<out_dir>/exit_code``, or ``None`` where there is none yet (no file, the
    reserved placeholder, or text that is not a code)."""
    try:
        text = (Path(out_dir) / EXIT_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) in MEANINGS else None


def record_exit(out_dir: Path, code: int, prog: str) -> int:
    """Write ``code`` to ``<out_dir>/exit_code`` (creating the folder; in place where
    :func:`reserve_exit` reserved it), print ``"<prog>: exit code <code> (<meaning>), in
    <path>"`` on stderr and return ``code``.

    A folder that cannot be written is said on stderr; the code is still returned.
    """
    path = Path(out_dir) / EXIT_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_code(path, code)
        where = f"in {path}"
    except OSError as exc:
        where = f"not recorded ({exc})"
    print(f"{prog}: exit code {code} ({MEANINGS.get(code, 'unknown')}), {where}",
          file=sys.stderr, flush=True)
    return code


def read_exit_code(out_dir: Path) -> int:
    """The code recorded in ``<out_dir>/exit_code``.

    Raises:
        ValueError: no such file, or it does not hold one of :data:`MEANINGS`' codes.
    """
    path = Path(out_dir) / EXIT_FILE
    if not path.is_file():
        raise ValueError(f"Invalid run folder {out_dir}: no {EXIT_FILE} file in it (the run did "
                         "not get as far as its output folder, or this is not a run's folder).")
    text = path.read_text().strip()
    if text == RESERVED:
        raise ValueError(f"Invalid run folder {out_dir}: its run has not ended ({path} still holds "
                         f"{RESERVED!r}: the run is still going, or it was killed before it "
                         "could write its code).")
    if not text.isdigit() or int(text) not in MEANINGS:
        raise ValueError(f"Invalid {path}: holds {text!r}. Must be one of {sorted(MEANINGS)}.")
    return int(text)


USAGE = ("usage: dmuon-ci {verify-traffic,gpu-check,nsys-verify} [ARGS...] | dmuon-ci code DIR\n"
         "Runs the tool and exits with its own code: 0 pass, 1 a check failed, 2 bad input, "
         "3 missing hardware or tools, 4 a step failed (nsys-verify), 5 the output could not be written (disk full); `code DIR` "
         "exits with the code recorded in DIR/exit_code.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    tool, rest = argv[0], argv[1:]
    if tool == "code":
        if len(rest) != 1:
            print(f"dmuon-ci: error: `code` takes one folder, got {rest}\n{USAGE}", file=sys.stderr)
            return 2
        try:
            return read_exit_code(Path(rest[0]))
        except ValueError as exc:
            print(f"dmuon-ci: error: {exc}", file=sys.stderr)
            return 2
    if tool not in TOOLS:
        print(f"dmuon-ci: error: Invalid tool {tool!r}. Must be one of {sorted(TOOLS)} or "
              f"'code'.\n{USAGE}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(TOOLS[tool])
    try:
        return int(module.main(rest))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
