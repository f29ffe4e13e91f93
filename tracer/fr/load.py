"""Load one Flight Recorder dump file, JSON or pickle, without running anything it names.

A pickle goes through a restricted pure-Python unpickler (:data:`PICKLE_ALLOWED_GLOBALS`);
the parser of the loaded dict is :mod:`tracer.fr.parse`.
"""

from __future__ import annotations

import io
import json
import pickle
import reprlib
from pathlib import Path

from tracer.inputs import read_bytes

#: Globals a pickled dump may name. torch 2.13's ``_dump_fr_trace()`` pickle and
#: :func:`dump_flight_recorder`'s re-pickled dump name none at all (dicts, lists, strings,
#: numbers, None, booleans have their own opcodes); sets are the only builtin a Python pickle of
#: plain data may reach through ``builtins``. Anything else (``os.system``, ``builtins.eval``,
#: any class) is refused.
PICKLE_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("builtins", "set"), ("builtins", "frozenset"), ("__builtin__", "set"),
     ("__builtin__", "frozenset")})


class PickleRefused(ValueError):
    """A pickled dump names a global outside :data:`PICKLE_ALLOWED_GLOBALS` (nothing was run)."""


class _Short(reprlib.Repr):
    """Bounded reprs for messages about hostile values (a pickle can share one list so often
    that a full ``repr`` would never end; ints past 4,300 digits have no ``repr`` at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict, self.maxtuple = 2, 4, 4, 4
        self.maxstring, self.maxother, self.maxlong = 60, 60, 40

    def repr_int(self, x, level):
        return super().repr_int(x, level) if x.bit_length() < 128 else f"<int of {x.bit_length()} bits>"


_short = _Short().repr


class _RestrictedUnpickler(pickle._Unpickler):
    # The pure-Python unpickler on purpose: its memo is a dict, where the C one allocates an
    # array up to the largest memo index a file names (a damaged LONG_BINPUT asked for 8 GB).
    def find_class(self, module: str, name: str):
        if (module, name) in PICKLE_ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise PickleRefused(f"the pickle references {module}.{name}, which a Flight Recorder "
                            "dump never contains")

    def persistent_load(self, pid):
        raise PickleRefused(f"the pickle holds a persistent id {_short(pid)}, which a Flight "
                            "Recorder dump never contains")


def load_dump(path: str | Path, *, allow_pickle: bool = False) -> dict:
    """Load one FR dump: JSON, pickle (``_dump_fr_trace``), or a pickle re-serialised as JSON;
    any of them gzipped (known by its first bytes, whatever the file's name).

    A file whose first byte is 0x80 is read as a pickle, through an unpickler that refuses
    every global outside :data:`PICKLE_ALLOWED_GLOBALS` (pure Python, so a damaged memo index
cannot make it allocate gigabytes), so a crafted file runs nothing (with
    ``allow_pickle`` it goes to :func:`pickle.loads` unrestricted, after a ``UserWarning``:
    only for files you trust). JSON is decoded as UTF-8; invalid bytes inside strings are kept
    as lone surrogates so that only the entries holding them are lost (reported per entry by
    :func:`read_flight_recorder`).

    Raises:
        PickleRefused: (a ``ValueError``) the pickle names a refused global; nothing ran.
        ValueError: the file is neither JSON nor pickle (or a truncated or damaged gzip of
            one), or is not a dict with the
            ``version`` / ``pg_status`` keys of a dump, or its ``entries`` is not a list.
    """
    path = Path(path)
    raw = read_bytes(path, "Flight Recorder dump")  # gzip by its first bytes, any name
    try:
        if raw[:1] == b"\x80":
            if allow_pickle:
                import warnings

                warnings.warn(f"Loading pickle {str(path)!r} without restrictions "
                              "(allow_pickle=True): it can run any code.", stacklevel=2)
                dump = pickle.loads(raw)
            else:
                dump = _RestrictedUnpickler(io.BytesIO(raw)).load()
        else:
            dump = json.loads(raw.decode("utf-8", errors="surrogateescape"))
    except PickleRefused as exc:
        raise PickleRefused(
            f"Invalid Flight Recorder dump {str(path)!r}: refused to unpickle it ({exc}); "
            "nothing was run. Must be a dump written by _dump_fr_trace() or "
            "dump_flight_recorder(); pass --allow-pickle (allow_pickle=True) only for a file "
            "you trust.") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure: re-raised with the file named
        raise ValueError(
            f"Invalid Flight Recorder dump {str(path)!r}: not JSON or pickle "
            f"({type(exc).__name__}: {', '.join(_short(x) for x in exc.args[:2])}). Must be "
            "written by "
            "_dump_fr_trace_json(), _dump_fr_trace() or dump_flight_recorder()."
        ) from None
    if not isinstance(dump, dict) or "pg_status" not in dump or "version" not in dump:
        raise ValueError(
            f"Invalid Flight Recorder dump {str(path)!r}: missing keys 'version'/'pg_status'. "
            "Must be a dump of torch.distributed's Flight Recorder."
        )
    if not isinstance(dump.get("entries", []), list):
        raise ValueError(
            f"Invalid Flight Recorder dump {str(path)!r}: entries="
            f"{_short(dump['entries'])} ({type(dump['entries']).__name__}). Must be a list "
            "of entries (absent when dumped without collectives).")
    return dump
