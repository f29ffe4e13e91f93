"""Every package folder of the project holds at most 15 modules (``__init__.py`` counted), so
the tree keeps showing the architecture: a folder that grows past it is split into
sub-packages by what its modules do (as ``verify/modes/`` and ``verify/measure/`` were)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dmuon", "verify", "tracer")
MAX_MODULES = 15


def oversized(roots: list[Path], limit: int = MAX_MODULES) -> list[str]:
    """``folder: n modules`` for each folder under ``roots`` with more than ``limit`` ``.py``."""
    out = []
    for root in roots:
        for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            n = len(list(folder.glob("*.py")))
            if n > limit:
                out.append(f"{folder.relative_to(root.parent)}: {n} modules")
    return out


def test_every_package_folder_holds_at_most_15_modules():
    assert oversized([ROOT / p for p in PACKAGES]) == []


def test_the_count_sees_a_folder_one_over(tmp_path):
    """The control: 16 modules in a sub-folder are named."""
    sub = tmp_path / "pkg" / "sub"
    sub.mkdir(parents=True)
    for i in range(MAX_MODULES + 1):
        (sub / f"m{i}.py").write_text("")
    assert oversized([tmp_path / "pkg"]) == ["pkg/sub: 16 modules"]
