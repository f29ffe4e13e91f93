"""Set DMuon up over a Python that already carries torch (a GPU node's image, an NGC
container, another torch to test against), installing nothing that is already there.

Run with the Python that imports the torch to use (``make gpu-node PYTHON=...`` and
``make test-torch TORCH_PY=...`` do)::

    python tools/node_env.py --venv .venv [--extras test,gpu,plots] [--check-only] [--link auto]

What it does, in order (nothing from this project is imported: it must run where DMuon's
own imports would fail):

1. Reads ``pyproject.toml``: ``requires-python``, ``[project] dependencies`` and the named
   ``[project.optional-dependencies]``. Checks this Python against ``requires-python`` and
   that ``torch`` imports here with a version the requirement admits (pre-releases such as
   NGC's ``2.11.0a0+<sha>.nv25.xx`` included). torch is never installed or replaced.
2. Checks every other requirement against the distributions this Python sees
   (``importlib.metadata``): the unmet ones are listed.
3. Creates ``--venv`` afresh with ``--system-site-packages``; where this Python is itself a
   venv (whose packages a child venv would not see), a ``.pth`` file in the new venv adds
   this venv's site-packages after the child's own. No pip is copied in where this Python
   has one (``venv/bin/python -m pip`` then runs it).
4. Installs only the requirements still unmet as the new venv sees them (it may see more
   than this Python: its base interpreter's site-packages) with pip, torch held at the
   found version by a constraint (this step alone may need an index: network or
   ``PIP_FIND_LINKS``).
   ``--check-only`` stops before any change instead, exit 1 when something is unmet.
5. Links this checkout into the venv: ``pip install --no-deps --no-build-isolation
   --no-index -e .`` where the visible setuptools can build an editable wheel offline
   (``>= 70.1``, or ``>= 64`` with ``wheel``), else a ``.pth`` file naming the checkout
   (the console scripts are then absent; ``python -m verify.run.launch`` etc. work).
6. Imports ``torch``, ``dmuon`` and ``tracer`` in the venv and writes ``<venv>/.system-torch``
   (line 1: this Python; line 2: torch's version), the Makefile's stamp.

Exit codes: 0 ready; 1 a requirement unmet under ``--check-only``, or pip / the final import
failed; 2 this Python or its torch cannot be used (the message names the fix).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import site
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The stamp the Makefile's system-torch mode depends on.
MARK_NAME = ".system-torch"
#: The ``.pth`` files this script may write into the venv.
BASE_PTH, CHECKOUT_PTH = "_dmuon_base_venv.pth", "_dmuon_checkout.pth"


class NodeEnvError(Exception):
    """A stop with its message and exit code (2: this Python or its torch cannot be used;
    1: pip or the final import failed)."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _packaging():
    """``(Requirement, SpecifierSet, Version)`` from ``packaging`` or pip's vendored copy.

    Raises:
        NodeEnvError(2): neither is importable (the message names the fix).
    """
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
            from pip._vendor.packaging.specifiers import SpecifierSet
            from pip._vendor.packaging.version import Version
        except ImportError:
            raise NodeEnvError(2, f"node_env: {sys.executable} has neither `packaging` nor pip. Must "
                             "use a Python with pip (python -m ensurepip) to set DMuon up.") from None
    return Requirement, SpecifierSet, Version


def read_requirements(pyproject: Path, extras: list[str]) -> tuple[str, list[str]]:
    """``(requires_python, requirement strings)`` of the project and the named extras.

    Raises:
        ValueError: an extra ``pyproject`` does not define (names the ones it does).
    """
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(f"Invalid --extras {unknown}: not in {pyproject}'s "
                         f"[project.optional-dependencies]. Must be among {sorted(optional)}.")
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += [r for r in optional[extra] if r not in reqs]
    return project["requires-python"], reqs


def unmet(reqs: list[str], version_of) -> list[tuple[str, str | None]]:
    """The requirements ``version_of`` does not satisfy, as ``(requirement, found version or
    None)``. ``version_of(name)`` returns the installed version string or ``None``.
    Pre-releases satisfy a range they fall in (an image's ``2.11.0a0+sha.nv25`` torch does);
    requirements whose environment marker is false here are skipped."""
    Requirement, _, _ = _packaging()
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        found = version_of(req.name)
        if found is None or not req.specifier.contains(found, prereleases=True):
            out.append((text, found))
    return out


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this Python sees, or ``None``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_base(requires_python: str, reqs: list[str]) -> str:
    """Check this Python and its torch's version (importing it is left to the new venv's
    probe); returns torch's version string.

    Raises:
        NodeEnvError(2): the Python is outside ``requires_python``, torch is missing or outside
        its requirement; the message names what and the fix.
    """
    _, SpecifierSet, _ = _packaging()
    here = ".".join(map(str, sys.version_info[:3]))
    if not SpecifierSet(requires_python).contains(here):
        raise NodeEnvError(2, f"node_env: Python {here} at {sys.executable} is outside DMuon's "
                         f"requires-python {requires_python!r}. Must pass the Python of the "
                         "image (make gpu-node PYTHON=/path/to/python3.11+).")
    torch_req = next(r for r in reqs if r.replace(" ", "").startswith("torch"))
    bad = unmet([torch_req], installed_version)
    if bad:
        found = bad[0][1]
        raise NodeEnvError(2,
            f"node_env: torch {'is not installed' if found is None else found + ' does not satisfy'}"
            f"{'' if found is None else ' ' + repr(torch_req)} for {sys.executable}. This path "
            "uses the torch that Python already has and never installs one. Must pass the Python "
            "that imports the torch to use (make gpu-node PYTHON=/path/to/python), or run "
            "`make install` (a fresh venv with the pinned torch).")
    return installed_version("torch")


def _base_is_venv() -> bool:
    return sys.prefix != sys.base_prefix


def _has_pip() -> bool:
    return installed_version("pip") is not None


def create_venv(path: Path) -> Path:
    """Create ``path`` afresh over this Python's packages; returns its site-packages dir."""
    venv.EnvBuilder(system_site_packages=True, clear=True, symlinks=os.name != "nt",
                    with_pip=not _has_pip()).create(path)
    where = {"base": str(path), "platbase": str(path)}
    purelib = Path(sysconfig.get_path("purelib", scheme="venv", vars=where))
    if _base_is_venv():
        # A child venv sees the base *interpreter's* site-packages, not this venv's.
        # every site dir this Python sees, those its own .pth files add included (a venv
        # over a venv over a venv), in its order
        dirs = [d for d in sys.path if Path(d).name in ("site-packages", "dist-packages")]
        (purelib / BASE_PTH).write_text("\n".join(dict.fromkeys(site.getsitepackages() + dirs))
                                        + "\n")
    return purelib


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def install_unmet(py: Path, missing: list[str], torch_version: str) -> None:
    """pip-install ``missing`` into the venv, torch held at ``torch_version``.

    Raises:
        NodeEnvError(1): pip failed (offline with a requirement unmet, most often).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write(f"torch=={torch_version}\n")
    try:
        rc = subprocess.call([str(py), "-m", "pip", "install", "-c", pins.name, *missing])
    finally:
        os.unlink(pins.name)
    if rc:
        raise NodeEnvError(1, f"node_env: pip could not install {missing} (exit {rc}). Without network, "
                         "must provide them (pip download on a networked machine, then "
                         "PIP_FIND_LINKS=/that/dir), or install them into the image.")


def editable_buildable(version_of=installed_version) -> bool:
    """Whether setuptools can build this checkout's editable wheel with no download:
    PEP 660 needs setuptools >= 64, and ``wheel`` below 70.1."""
    _, _, Version = _packaging()
    found = version_of("setuptools")
    if found is None or Version(found) < Version("64"):
        return False
    return Version(found) >= Version("70.1") or version_of("wheel") is not None


def link_checkout(py: Path, purelib: Path, how: str) -> str:
    """Make the venv import this checkout; returns ``"pip"`` or ``"pth"``, the way used.

    Raises:
        NodeEnvError(1): pip's editable install failed.
    """
    if how == "pip" or (how == "auto" and editable_buildable()):
        rc = subprocess.call([str(py), "-m", "pip", "install", "--quiet", "--no-deps",
                              "--no-build-isolation", "--no-index", "-e", str(ROOT)])
        if rc:
            raise NodeEnvError(1, f"node_env: `pip install --no-deps --no-build-isolation -e {ROOT}` "
                             f"failed (exit {rc}). Must retry with --link pth.")
        return "pip"
    (purelib / CHECKOUT_PTH).write_text(f"{ROOT}\n")
    return "pth"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="node_env", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, required=True, help="the venv to create (afresh)")
    ap.add_argument("--extras", default="test,gpu,plots",
                    help="comma-separated optional-dependency groups (default: %(default)s)")
    ap.add_argument("--check-only", action="store_true",
                    help="report what is unmet and change nothing (exit 1 if anything is)")
    ap.add_argument("--link", choices=("auto", "pip", "pth"), default="auto",
                    help="how the venv imports this checkout (default: %(default)s)")
    ap.add_argument("--unmet-json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    requires_python, reqs = read_requirements(ROOT / "pyproject.toml", extras)
    if args.unmet_json:  # run by main() with the new venv's Python: what it sees
        print(json.dumps(unmet([r for r in reqs if not r.replace(" ", "").startswith("torch")],
                               installed_version)))
        return 0
    torch_version = check_base(requires_python, reqs)
    missing = unmet([r for r in reqs if not r.replace(" ", "").startswith("torch")],
                    installed_version)
    print(f"node_env: Python {sys.version.split()[0]} at {sys.executable}, torch {torch_version}; "
          f"unmet: {', '.join(f'{r} (found {v})' if v else r for r, v in missing) or 'none'}")
    if args.check_only:
        return 1 if missing else 0
    venv_dir = args.venv.resolve()
    purelib = create_venv(venv_dir)
    py = venv_python(venv_dir)
    if missing:  # what the new venv sees can be more (its base's own site-packages)
        missing = json.loads(subprocess.run(
            [str(py), __file__, "--venv", str(venv_dir), "--extras", args.extras, "--unmet-json"],
            capture_output=True, text=True, check=True).stdout)
    if missing:
        install_unmet(py, [r for r, _ in missing], torch_version)
    how = link_checkout(py, purelib, args.link)
    probe = ("import torch, dmuon, tracer; "
             "print(torch.__version__, torch.__file__, dmuon.__file__, sep='\\n')")
    got = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    if got.returncode:
        print(got.stderr, file=sys.stderr)
        raise NodeEnvError(1, f"node_env: the new venv {venv_dir} cannot import torch, dmuon and "
                         "tracer (above). Must fix what the error names (a broken CUDA library "
                         "of the image's torch, an unmet import) and rerun.")
    version, torch_file, dmuon_file = got.stdout.split()
    if version.split("+")[0] != torch_version.split("+")[0]:
        raise NodeEnvError(1, f"node_env: the venv imports torch {version} ({torch_file}), not the "
                         f"base's {torch_version}. Must remove that torch from {venv_dir}'s "
                         "path or its base.")
    (venv_dir / MARK_NAME).write_text(f"{sys.executable}\n{torch_version}\n")
    print(f"node_env: {venv_dir} ready: torch {version} from {Path(torch_file).parent}, DMuon from "
          f"{Path(dmuon_file).parent.parent} ({how})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NodeEnvError as exc:
        print(exc, file=sys.stderr)
        sys.exit(exc.exit_code)
