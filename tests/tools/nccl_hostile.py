"""TEST TOOL: hostile single lines for the NCCL log reader's memory bound.

Each shape is a unit repeated to fill one physical line of a given size: repeated markers,
op heads, whole records (with and without prefix), op-name look-alikes, INIT and PyTorch
lines, oversized numbers, terminal colours, and text the parser must only hold (one long
token, non-ASCII and astral characters, invalid UTF-8). Used by
``tests/nccl/test_nccl_memory.py`` (tracemalloc, a few MB) and by
``benchmarks/bench_nccl_parser.py --line-mb`` (peak RSS of a child, 50 MB). Synthetic text:
never evidence of what NCCL prints.
"""

from __future__ import annotations

P = "node-01:100:100 [0] NCCL INFO "
COLL = ("AllReduce: opCount 1a sendbuff 0x1 recvbuff 0x2 count 64 datatype 7 op 0 root 0 "
        "comm 0x7f0 [nranks=2] stream 0x7f")

#: name -> unit repeated along the line (bytes, UTF-8 or not).
SHAPES: dict[str, bytes] = {name: (unit.encode() if isinstance(unit, str) else unit)
                            for name, unit in {
    "markers": "NCCL INFO ",
    "prefixed markers": P,
    "op heads": "AllReduce: opCount ",
    "records": P + COLL + " ",
    "records without prefix": COLL + " ",
    "records of distinct comms": None,  # filled below
    "look-alike op names": P + "All-Reduce: opCount 1 sendbuff 0x1 ",
    "zero-width op names": P + "All\u200bReduce: opCount 1 ",
    "INIT lines": P + "comm 0x1 rank 0 nranks 2 cudaDev 0 - Init COMPLETE ",
    "PyTorch comm lines": "[PG 0 (default_pg) Rank 0] ProcessGroupNCCL created ncclComm_ 0x1 "
                          "on CUDA device: \x03 ",
    "oversized counts": P + COLL.replace("count 64", "count " + "9" * 200) + " ",
    "colours": "\x1b[32m" + P + COLL + "\x1b[0m ",
    "one token": "x",
    "accented text": "\u00e9",
    "astral text": "\U0001F600",
    "ASCII and one astral": None,  # filled below
    "invalid UTF-8": b"ab\xff",
}.items() if unit is not None}


def line(name: str, size: int) -> bytes:
    """One line of ``size`` bytes or a little less (no line end) of shape ``name``."""
    if name == "records of distinct comms":
        unit_len = len(P + COLL) + 8
        return b"".join((P + COLL.replace("0x7f0", f"0x{i:08x}") + " ").encode()
                        for i in range(size // unit_len))
    if name == "ASCII and one astral":
        return "\U0001F600".encode() + b"x" * (size - 4)
    unit = SHAPES[name]
    return unit * (size // len(unit))


NAMES = [*SHAPES, "records of distinct comms", "ASCII and one astral"]


def write_line(path, name: str, size: int) -> int:
    """Write :func:`line` (and a line end) to ``path`` a MB at a time, without holding it;
    returns the line's size in bytes."""
    with open(path, "wb") as f:
        n = sum(map(f.write, _pieces(name, size)))
        f.write(b"\n")
    return n


def _pieces(name: str, size: int, piece: int = 1 << 20):
    """:func:`line` in pieces of about ``piece`` bytes."""
    if name == "records of distinct comms":
        unit_len = len(P + COLL) + 8
        total = size // unit_len
        for lo in range(0, total, piece // unit_len):
            yield b"".join((P + COLL.replace("0x7f0", f"0x{i:08x}") + " ").encode()
                           for i in range(lo, min(total, lo + piece // unit_len)))
        return
    if name == "ASCII and one astral":
        yield "\U0001F600".encode()
        reps, unit = size - 4, b"x"
    else:
        unit = SHAPES[name]
        reps = size // len(unit)
    per = max(1, piece // len(unit))
    block = unit * per
    while reps:
        k = min(reps, per)
        yield block if k == per else unit * k
        reps -= k
