"""NVLink byte counters next to the modelled wire bytes: a coarse hardware cross-check.

On every node, local rank 0 reads the NVLink TX/RX counters of the node's GPUs that
``CUDA_VISIBLE_DEVICES`` makes visible to it (the job's GPUs under torchrun; every GPU where it
is unset; :func:`tracer.nvml.visible_nvml_indices`) at the opening and closing of each
measured window (:class:`tracer.nvml.NvlinkSampler`); rank 0 sets
the sum over nodes beside the bytes the traffic model puts on the wire in that window:

    modelled_wire_bytes = sum over every rank's calls of f(n) * S * dtype_bytes

with f(n)·S from :func:`verify.traffic.formulas.avg_elems` (the per-member share of the nccl-tests
bus traffic of one call), so the sum over a call's n members is the bytes its ring or tree
moves. The counters also see NCCL's protocol overhead (LL: 8-byte lines carrying 4 data
bytes; LL128: 120 of 128 bytes), traffic of other processes on the node, and nothing that goes
over PCIe or the network, so the ratio is reported, never gated on.

Where NVML, a GPU or NVLink is missing, the entry says ``available: false`` and why (the
sampler's reason, e.g. ``NVML unavailable: nvmlInit failed with NVMLError_LibraryNotFound``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tracer.events import CollectiveEvent
from tracer.nvml import NvlinkReading

from verify.traffic.formulas import avg_elems


def modelled_wire_bytes(events: Sequence[CollectiveEvent]) -> int:
    """Bytes the model puts on the wire for ``events`` (every rank's view of each call).

    Raises:
        ValueError: an event lacks ``count``, ``group_size`` or ``dtype_bytes``.
    """
    total = 0.0
    for ev in events:
        if ev.count is None or ev.group_size is None or ev.dtype_bytes is None:
            raise ValueError(f"Invalid event for the wire model ({ev.source_ref or ev.op}): "
                             "count, group_size and dtype_bytes must be known.")
        total += avg_elems(ev.op, ev.count, ev.group_size) * ev.dtype_bytes
    return round(total)


def nvlink_report(readings: Sequence[NvlinkReading], events: Sequence[CollectiveEvent]) -> dict:
    """``report.json`` ``runs[].nvlink``: the window's counters (one reading per node) beside
    the model.

    Returns:
        ``{"available": False, "reason": str}`` when any node could not read its counters
        (or none sampled), else ``{"available": True, "tx_bytes", "rx_bytes",
        "modelled_wire_bytes", "tx_to_model", "links"}`` (bytes summed over nodes and GPUs;
        ``links``: active links summed).
    """
    if not readings:
        return {"available": False, "reason": "no node sampled NVLink counters"}
    missing = [r.reason for r in readings if not r.available]
    if missing:
        return {"available": False, "reason": missing[0]}
    tx = sum(r.total_tx_bytes for r in readings)
    model = modelled_wire_bytes(events)
    return {
        "available": True,
        "tx_bytes": tx,
        "rx_bytes": sum(r.total_rx_bytes for r in readings),
        "modelled_wire_bytes": model,
        "tx_to_model": tx / model if model else None,
        "links": sum(sum(r.links.values()) for r in readings),
    }
