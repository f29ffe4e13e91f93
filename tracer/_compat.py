"""Optional packages: import one, or fail naming the package and the pip command.

``import dmuon`` and ``import tracer`` need only the core dependencies (``pyproject.toml``
``[project] dependencies``). The extras are imported where their feature is used:

- ``gpu``: ``nvtx`` (``dmuon.annotate``: NVTX ranges off without it,
  ``set_nvtx_enabled(True)`` says so) and ``nvidia-ml-py`` (the ``pynvml`` import;
  ``tracer.nvml``: the reading says unavailable, naming it);
- ``plots``: ``matplotlib`` (``verify.report.plots``: the report's PNGs, timelines;
  ``dmuon-plan --plot``);
- ``test``: ``transformers`` (the Hugging Face parity tests skip without it).
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: import name -> (distribution to pip-install, pyproject extra that lists it)
OPTIONAL = {
    "nvtx": ("nvtx", "gpu"),
    "pynvml": ("nvidia-ml-py", "gpu"),
    "matplotlib": ("matplotlib", "plots"),
    "transformers": ("transformers", "test"),
}


def install_hint(module: str) -> str:
    """``"pip install 'DIST' (or pip install -e '.[EXTRA]' in a DMuon checkout)"`` for the
    optional import ``module`` (its top-level name)."""
    dist, extra = OPTIONAL[module.split(".")[0]]
    return f"pip install '{dist}' (or pip install -e '.[{extra}]' in a DMuon checkout)"


def require(module: str, feature: str) -> ModuleType:
    """Import the optional ``module`` (e.g. ``"matplotlib.figure"``) for ``feature``.

    Raises:
        ModuleNotFoundError: it cannot be imported; the message names the feature, the
            package, the pip command and the import's own error.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"{feature} needs the optional package {OPTIONAL[module.split('.')[0]][0]!r}, which "
            f"cannot be imported here ({type(exc).__name__}: {exc}). Must install it: "
            f"{install_hint(module)}.", name=module) from exc
