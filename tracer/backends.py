"""torch.distributed backend strings, parsed once for the whole harness (no torch import).

``dist.get_backend()`` returns the name a process group was created with, normalised to lower
case: one backend (``"nccl"``, ``"gloo"``) or, when a group has one backend per device type,
``"<device>:<backend>,<device>:<backend>"``. torch 2.x creates the default group as
``"cpu:gloo,cuda:nccl"`` when ``init_process_group()`` gets no backend on a machine with CUDA
(``torch/distributed/distributed_c10d.py``, ``Backend.default_device_backend_map`` and
``BackendConfig``), so comparing the string to ``"nccl"`` misses the NCCL jobs that did not
name their backend. A bare name means every device type torch knows for it (``nccl``: cuda;
``gloo``: cpu and cuda), as ``BackendConfig`` expands it.
"""

from __future__ import annotations

#: Device types a bare backend name serves (``Backend.backend_capability`` in torch 2.13).
_CAPABILITY: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "mpi": ("cpu", "cuda"),
    "ucc": ("cpu", "cuda"),
    "xccl": ("xpu",),
}


def parse_backend(backend: str) -> dict[str, str]:
    """Device type -> backend of a ``dist.get_backend()`` string.

    Examples: ``"nccl"`` -> ``{"cuda": "nccl"}``; ``"gloo"`` -> ``{"cpu": "gloo", "cuda":
    "gloo"}``; ``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``. A bare name
    torch does not list (a third-party backend) maps ``"*"`` to it.

    Raises:
        ValueError: ``backend`` is not a string, is empty, or a ``device:backend`` list is
            malformed (an empty part, a part without ``:``, a device named twice).
    """
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(f"Invalid {backend=}. Must be a non-empty torch.distributed backend "
                         "string such as 'nccl' or 'cpu:gloo,cuda:nccl'.")
    text = backend.strip().lower()
    if ":" not in text:
        return {dev: text for dev in _CAPABILITY.get(text, ("*",))}
    out: dict[str, str] = {}
    for part in text.split(","):
        dev, sep, name = (s.strip() for s in part.partition(":"))
        if not sep or not dev or not name or dev in out:
            raise ValueError(f"Invalid {backend=}: part {part!r} is not a new '<device>:"
                             "<backend>'. Must be like 'cpu:gloo,cuda:nccl'.")
        out[dev] = name
    return out


def backend_names(backend: str) -> set[str]:
    """The backends a backend string uses: ``"cpu:gloo,cuda:nccl"`` -> ``{"gloo", "nccl"}``.

    Raises:
        ValueError: as :func:`parse_backend`.
    """
    return set(parse_backend(backend).values())


def uses_nccl(backend: str) -> bool:
    """Whether a group with this backend string runs CUDA tensors' collectives on NCCL."""
    return "nccl" in backend_names(backend)


def device_type(backend: str) -> str:
    """``"cuda"`` where the group reaches NCCL (its collectives run on GPUs), else ``"cpu"``."""
    return "cuda" if uses_nccl(backend) else "cpu"


def report_backend(backend: str) -> str:
    """The one backend a report names: ``"nccl"`` where NCCL is in use, else ``"gloo"``
    where gloo is, else the string unchanged (``report.json``'s schema knows gloo and nccl)."""
    names = backend_names(backend)
    return "nccl" if "nccl" in names else "gloo" if "gloo" in names else backend
