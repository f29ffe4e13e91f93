"""Real text with no download: the bytes of Python's standard library sources.

Corpus rule (:meth:`ByteCorpus.from_stdlib`): every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]``, excluding anything under a ``site-packages`` or
``dist-packages`` directory (some installs, e.g. pyenv, keep third-party packages inside the
stdlib folder), sorted by its relative POSIX path, concatenated until ``max_bytes``; the last
file is cut at the limit. Identical on every machine with the same Python version and the same
distribution packaging (Debian-style installs split ``test/`` and ``idlelib/`` out into separate
packages, which changes the bytes): compare :attr:`ByteCorpus.sha256` when that matters.

Tokens are the raw bytes (vocab 256). The last ``eval_fraction`` of the bytes is the held-out
split (``split="eval"``); the rest is ``split="train"``.

Batching (:meth:`ByteCorpus.global_batch`): the *global* batch of a step is a pure function of
``(seed, step, split)`` via a ``torch.Generator``, so every rank of any world size draws the same
global batch and takes its own rows with :func:`local_slice`: rank r of W takes rows
``[r * B / W, (r + 1) * B / W)``. Under HSDP every one of the W ranks is a data-parallel rank
(both mesh axes), so pass the global rank and world size.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "ByteCorpus",
    "DEFAULT_MAX_BYTES",
    "global_batch_size",
    "local_slice",
    "stdlib_source_files",
]

#: Default corpus size: 4 MiB of source text (about 1 s to read, 4 MiB of uint8 tokens).
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

_SPLITS = ("train", "eval")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_source_files(stdlib_dir: str | Path | None = None) -> list[Path]:
    """The corpus files in corpus order (see the module docstring).

    Raises:
        ValueError: ``stdlib_dir`` is not a directory or holds no ``*.py`` file.
    """
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"Invalid stdlib_dir={str(root)!r}. Must be an existing directory.")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]  # never descend there
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    if not files:
        raise ValueError(
            f"Invalid stdlib_dir={str(root)!r}. Must contain Python sources (*.py); this "
            "Python installation ships none."
        )
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def local_slice(x: Tensor, rank: int, world_size: int) -> Tensor:
    """Rows ``[rank * B / W, (rank + 1) * B / W)`` of a global batch ``x`` (B, ...): a view.

    Raises:
        ValueError: ``world_size`` < 1, ``rank`` outside [0, world_size), or B not divisible
            by ``world_size``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid {world_size=}. Must be a positive int.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"Invalid {rank=}. Must be an int in [0, {world_size}).")
    batch_size = x.size(0)
    if batch_size % world_size:
        raise ValueError(
            f"Invalid global batch_size={batch_size} for {world_size=}. Must be divisible by "
            f"world_size so every rank gets the same number of rows; use a multiple of "
            f"{world_size}."
        )
    rows = batch_size // world_size
    return x[rank * rows : (rank + 1) * rows]


def global_batch_size(world_size: int, *, per_rank: int, global_batch: int | None = None) -> int:
    """Sequences per step over all ranks: ``global_batch`` when given, else ``per_rank * W``.

    The default follows the world size (every rank keeps ``per_rank`` rows), so any W runs; an
    explicit global batch must split evenly over the W ranks (:func:`local_slice`). Checked
    before any collective, identically on every rank.

    Raises:
        ValueError: ``world_size`` or ``per_rank`` < 1, or ``global_batch`` not a positive
            multiple of ``world_size``.
    """
    for name, value in (("world_size", world_size), ("per_rank", per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid {name}={value!r}. Must be a positive int.")
    if global_batch is None:
        return per_rank * world_size
    bad_type = isinstance(global_batch, bool) or not isinstance(global_batch, int)
    if bad_type or global_batch < 1 or global_batch % world_size:
        near = world_size * max(1, global_batch // world_size) if not bad_type else world_size
        raise ValueError(
            f"Invalid --global-batch={global_batch!r} for {world_size=}. Must be a positive "
            f"multiple of the world size so every rank gets the same rows (e.g. {near} or "
            f"{near + world_size}), or omitted ({per_rank} per rank: {per_rank * world_size})."
        )
    return global_batch


def _step_seed(seed: int, step: int, split: str) -> int:
    # A fixed seed constant (the module's old path): changing it changes every batch.
    digest = hashlib.sha256(f"dmuon.verify.data:{seed}:{step}:{split}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True, eq=False)
class ByteCorpus:
    """A byte-token corpus with a train and a held-out split.

    Attributes:
        tokens: (T,) uint8, the train split.
        eval_tokens: (T_eval,) uint8, the held-out split (the corpus tail).
        source: where the bytes came from (the stdlib directory, or a caller's label).
        num_files: files read (0 when built from raw bytes).
        sha256: hex digest of train + eval bytes, to compare corpora across machines.
    """

    tokens: Tensor
    eval_tokens: Tensor
    source: str
    num_files: int
    sha256: str

    @classmethod
    def from_bytes(
        cls, data: bytes, *, eval_fraction: float = 0.1, source: str = "bytes", num_files: int = 0
    ) -> ByteCorpus:
        """Split ``data`` into train (head) and eval (tail, ``eval_fraction`` of it).

        Raises:
            ValueError: ``eval_fraction`` outside [0, 1), or fewer than 2 bytes of train data.
        """
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"Invalid {eval_fraction=}. Must be in [0, 1).")
        n_eval = int(len(data) * eval_fraction)
        n_train = len(data) - n_eval
        if n_train < 2:
            raise ValueError(
                f"Invalid corpus of {len(data)} bytes with {eval_fraction=}. Must leave at "
                "least 2 train bytes (one input and one target); give more data."
            )
        all_tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
        return cls(
            tokens=all_tokens[:n_train],
            eval_tokens=all_tokens[n_train:],
            source=source,
            num_files=num_files,
            sha256=hashlib.sha256(data).hexdigest(),
        )

    @classmethod
    def from_stdlib(
        cls,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        eval_fraction: float = 0.1,
        stdlib_dir: str | Path | None = None,
    ) -> ByteCorpus:
        """The first ``max_bytes`` of the stdlib corpus (module docstring), split train / eval.

        Raises:
            ValueError: ``max_bytes`` < 2, no sources found, bad ``eval_fraction``.
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2:
            raise ValueError(
                f"Invalid {max_bytes=}. Must be an int >= 2 (default {DEFAULT_MAX_BYTES})."
            )
        files = stdlib_source_files(stdlib_dir)
        chunks: list[bytes] = []
        total = 0
        used = 0
        for path in files:
            if total >= max_bytes:
                break
            data = path.read_bytes()[: max_bytes - total]
            chunks.append(data)
            total += len(data)
            used += 1
        root = stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"]
        return cls.from_bytes(
            b"".join(chunks), eval_fraction=eval_fraction, source=str(root), num_files=used
        )

    def split_tokens(self, split: str) -> Tensor:
        """``tokens`` for ``"train"``, ``eval_tokens`` for ``"eval"``."""
        if split not in _SPLITS:
            raise ValueError(f"Invalid {split=}. Must be one of {_SPLITS}.")
        return self.tokens if split == "train" else self.eval_tokens

    def global_batch(
        self, step: int, batch_size: int, seq_len: int, seed: int = 0, *, split: str = "train"
    ) -> tuple[Tensor, Tensor]:
        """The global batch of ``step``: inputs ``x`` and next-byte targets ``y``.

        ``batch_size`` windows of ``seq_len + 1`` bytes start at offsets drawn uniformly by a
        ``torch.Generator`` seeded from ``(seed, step, split)`` alone; ``x`` is each window's
        first ``seq_len`` bytes, ``y`` its last ``seq_len``.

        Returns:
            ``(x, y)``: int64 tensors of shape (batch_size, seq_len), on the CPU.

        Raises:
            ValueError: non-positive ``batch_size`` / ``seq_len``, negative ``step`` /
                ``seed``, unknown ``split``, or a split shorter than ``seq_len + 1`` bytes.
        """
        checks = (
            ("step", step, 0), ("seed", seed, 0), ("batch_size", batch_size, 1), ("seq_len", seq_len, 1)
        )
        for name, value, low in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Invalid {name}={value!r}. Must be an int >= {low}.")
        data = self.split_tokens(split)
        n_windows = data.numel() - seq_len
        if n_windows < 1:
            raise ValueError(
                f"Invalid {seq_len=} for the {split} split of {data.numel()} bytes. Must be "
                "< the split's length; use a shorter seq_len or a larger max_bytes."
            )
        gen = torch.Generator().manual_seed(_step_seed(seed, step, split))
        starts = torch.randint(0, n_windows, (batch_size,), generator=gen)  # (B,)
        window = starts[:, None] + torch.arange(seq_len + 1)  # (B, seq_len + 1)
        tokens = data[window].long()
        return tokens[:, :-1], tokens[:, 1:]

    local_slice = staticmethod(local_slice)
