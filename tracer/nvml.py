"""NVLink byte counters from NVML around a measured window: a coarse hardware cross-check.

Fields (nvml.h, NVML 12.x; ``pynvml`` from the ``nvidia-ml-py`` package):
``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX`` = 138 and ``..._DATA_RX`` = 139, cumulative payload
counters in **KiB** read with ``nvmlDeviceGetFieldValues``. nvml.h says that for NVLink
throughput fields ``scopeId`` "can represent linkId", so this module asks for one value per
*active* link (``nvmlDeviceGetNvLinkState`` = enabled) with ``scopeId = link`` and sums the
links into a per-GPU figure. Unverified on hardware: whether a driver returns the per-GPU total
for every scopeId instead. The reading keeps the per-link deltas (``per_link_tx_bytes``) so that
identical deltas on every link, the sign of that, are visible; ``links`` says how many were
summed.

Without NVML (no driver: ``nvmlInit`` raises ``NVMLError_LibraryNotFound``), without pynvml,
without GPUs, or without active NVLink, :meth:`NvlinkSampler.stop` returns ``available=False``
with the reason. Counters are NVLink-only: traffic over PCIe or the network is invisible here.

Which GPUs. NVML numbers every GPU of the node (PCI bus order) and ignores
``CUDA_VISIBLE_DEVICES``; by default the sampler reads only the GPUs that variable makes
visible to this process (:func:`visible_nvml_indices`): entries are CUDA indices (taken as
NVML indices: the same on nodes of one GPU model, where CUDA's fastest-first order falls back
to PCI order, and with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), or UUIDs ``GPU-<uuid>``, whole or a
unique prefix, matched against ``nvmlDeviceGetUUID``. As CUDA does, the list ends at the first
entry that names no GPU (``-1``, an unknown UUID); a ``MIG-`` entry cannot be sampled (NVLink
counters belong to the parent GPU) and is reported. Unset: every GPU NVML sees.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

FIELD_NVLINK_TX_KIB = 138  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FIELD_NVLINK_RX_KIB = 139  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
KIB = 1024
_MAX_LINKS_FALLBACK = 18  # NVML_NVLINK_MAX_LINKS in older bindings (H100: 18 links)


@dataclass(frozen=True)
class NvlinkReading:
    """Bytes over NVLink during one window, per CUDA/NVML device index.

    Attributes:
        available: whether counters were read at start and stop.
        reason: why not, when ``available`` is False.
        tx_bytes / rx_bytes: device index -> data bytes sent / received (sum over its links).
        per_link_tx_bytes / per_link_rx_bytes: device -> {link: bytes}.
        links: device -> number of active links summed.
    """

    available: bool
    reason: str | None = None
    tx_bytes: dict[int, int] = field(default_factory=dict)
    rx_bytes: dict[int, int] = field(default_factory=dict)
    per_link_tx_bytes: dict[int, dict[int, int]] = field(default_factory=dict)
    per_link_rx_bytes: dict[int, dict[int, int]] = field(default_factory=dict)
    links: dict[int, int] = field(default_factory=dict)

    @property
    def total_tx_bytes(self) -> int:
        return sum(self.tx_bytes.values())

    @property
    def total_rx_bytes(self) -> int:
        return sum(self.rx_bytes.values())


def _load_pynvml():
    return importlib.import_module("pynvml")


#: Environment variable that restricts the GPUs a CUDA process sees.
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_nvml_indices(nvml, visible: str | None) -> list[int]:
    """NVML indices of the GPUs ``visible`` (a ``CUDA_VISIBLE_DEVICES`` value) names, in its
    order (module docstring); ``None`` (unset): every GPU NVML reports.

    Raises:
        ValueError: a ``MIG-`` entry, a UUID prefix matching several GPUs, a GPU named twice,
            or no GPU left (all names the value and the fix).
    """
    count = int(nvml.nvmlDeviceGetCount())
    if visible is None:
        return list(range(count))
    uuids = None
    out: list[int] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if entry.isdigit() or (entry[:1] in "+-" and entry[1:].isdigit()):
            index = int(entry)
            if not 0 <= index < count:
                break  # CUDA stops at the first invalid index
        elif entry.startswith("MIG-"):
            raise ValueError(f"Invalid {VISIBLE_ENV}={visible!r}: entry {entry!r} is a MIG "
                             "instance; its NVLink counters belong to the parent GPU. Must name "
                             "whole GPUs (an index or GPU-<uuid>) to sample NVLink.")
        else:
            if uuids is None:
                uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
                         for i in range(count)]
            want = entry if entry.startswith("GPU-") else f"GPU-{entry}"
            hits = [i for i, u in enumerate(uuids) if u.startswith(want)] if entry else []
            if len(hits) > 1:
                raise ValueError(f"Invalid {VISIBLE_ENV}={visible!r}: entry {entry!r} is a prefix "
                                 f"of {len(hits)} GPUs' UUIDs. Must be unique (a longer prefix).")
            if not hits:
                break
            index = hits[0]
        if index in out:
            raise ValueError(f"Invalid {VISIBLE_ENV}={visible!r}: GPU {index} is named twice. "
                             "Must name each GPU once.")
        out.append(index)
    if not out:
        raise ValueError(f"Invalid {VISIBLE_ENV}={visible!r}: names none of the {count} GPUs "
                         "NVML sees. Must list their indices or GPU-<uuid> values.")
    return out


class NvlinkSampler:
    """Sample NVLink TX/RX counters at :meth:`start` and :meth:`stop`.

    Args:
        devices: NVML device indices to read; ``None`` = the GPUs ``CUDA_VISIBLE_DEVICES``
            makes visible to this process (:func:`visible_nvml_indices`; unset: all NVML
            reports). A malformed value makes the reading unavailable, with the reason.

    Never raises for a missing driver, GPU or NVLink: the reading says ``available=False``.

    Example::

        sampler = NvlinkSampler(); sampler.start(); run_step(); reading = sampler.stop()
    """

    def __init__(self, devices: Sequence[int] | None = None) -> None:
        if devices is not None and any(int(d) < 0 for d in devices):
            raise ValueError(f"Invalid NvlinkSampler devices={list(devices)}. Must be >= 0.")
        self._devices = None if devices is None else [int(d) for d in devices]
        self._nvml = None
        self._links: dict[int, list[int]] = {}
        self._handles: dict[int, object] = {}
        self._start: dict[int, dict[int, tuple[int, int]]] | None = None
        self._reason: str | None = None

    def start(self) -> None:
        """Initialise NVML, find active links, read the counters (or record why not)."""
        self._start, self._reason = None, None
        try:
            nvml = self._nvml = _load_pynvml()
        except ImportError as exc:
            self._reason = (f"pynvml not importable ({exc}): NVLink counters not read; "
                            "install nvidia-ml-py to read them")
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._reason = f"NVML unavailable: nvmlInit failed with {type(exc).__name__}: {exc}"
            return
        try:
            devices = self._devices
            if devices is None:
                try:
                    devices = visible_nvml_indices(nvml, os.environ.get(VISIBLE_ENV))
                except ValueError as exc:
                    self._reason = str(exc)
                    return
            if not devices:
                self._reason = "NVML reports no GPU"
                return
            max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS_FALLBACK)
            for dev in devices:
                handle = self._handles[dev] = nvml.nvmlDeviceGetHandleByIndex(dev)
                self._links[dev] = [
                    link for link in range(max_links) if _link_active(nvml, handle, link)
                ]
            if not any(self._links.values()):
                self._reason = f"no active NVLink on devices {devices}"
                return
            self._start = self._read()
        except Exception as exc:  # an NVMLError from a query: report, do not crash the run
            self._reason = f"NVML query failed with {type(exc).__name__}: {exc}"

    def stop(self) -> NvlinkReading:
        """Read the counters again; the differences (KiB x 1024) are the window's bytes."""
        if self._start is None:
            reading = NvlinkReading(False, self._reason or "start() was not called")
            self._shutdown()
            return reading
        try:
            end = self._read()
        except Exception as exc:
            self._shutdown()
            return NvlinkReading(False, f"NVML query failed with {type(exc).__name__}: {exc}")
        self._shutdown()
        tx, rx, ptx, prx = {}, {}, {}, {}
        for dev, links in end.items():
            ptx[dev] = {lk: (v[0] - self._start[dev][lk][0]) * KIB for lk, v in links.items()}
            prx[dev] = {lk: (v[1] - self._start[dev][lk][1]) * KIB for lk, v in links.items()}
            tx[dev], rx[dev] = sum(ptx[dev].values()), sum(prx[dev].values())
        return NvlinkReading(True, None, tx, rx, ptx, prx,
                             {dev: len(links) for dev, links in end.items()})

    def _read(self) -> dict[int, dict[int, tuple[int, int]]]:
        """device -> link -> (tx KiB, rx KiB) cumulative counters."""
        nvml, out = self._nvml, {}
        for dev, links in self._links.items():
            if not links:
                continue
            ids = [(f, lk) for lk in links for f in (FIELD_NVLINK_TX_KIB, FIELD_NVLINK_RX_KIB)]
            values = nvml.nvmlDeviceGetFieldValues(self._handles[dev], ids)
            for v in values:
                if v.nvmlReturn != 0:
                    raise RuntimeError(f"field {v.fieldId} link {v.scopeId} of device {dev} "
                                       f"returned NVML error {v.nvmlReturn}")
            out[dev] = {
                lk: (int(values[2 * i].value.ullVal), int(values[2 * i + 1].value.ullVal))
                for i, lk in enumerate(links)
            }
        return out

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


def _link_active(nvml, handle, link: int) -> bool:
    try:
        return bool(nvml.nvmlDeviceGetNvLinkState(handle, link))
    except Exception:  # NotSupported / InvalidArgument past the last link
        return False
