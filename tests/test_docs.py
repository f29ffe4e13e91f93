"""The documentation stays navigable and honest about where things are.

- README.md is a front page (at most ``README_MAX_LINES`` lines); the manual lives in docs/.
- Every relative link in README.md and docs/*.md points at a file (or folder) that exists, and
  a ``#fragment`` into a Markdown file names one of its headings.
- Every repository path the pages name in backticks (``dmuon/ownership/plan.py``) exists, and every
  module the README's "Layout" tree names exists where the tree puts it.
- The specification the code cites is docs/spec.md: no tracked .py or .md file cites the old,
  out-of-tree one (the cited name followed by a section sign, or its .md file name).
- No page (README.md, CHANGELOG.md, docs/) and no module of the product packages (dmuon/,
  verify/, tracer/) cites an issue by its number ("issue 31", "(issue 34, item 2)"): a user
  cannot look those up; say what the text means today. Upstream reports are cited as
  ``owner/repo#N``.
- docs/protocol.md is the protocol's one text: every citation of it by step ("step 4") or by
  section ("States") in a tracked .py or .md file names a step 1-7 or a heading it has.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250

#: A Markdown link or image: [text](target) or [text](target "title").
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: Backticked repository paths: a top-level folder of this project, then path characters only.
_REPO_PATH = re.compile(
    r"`((?:dmuon|tracer|verify|tests|benchmarks|examples|docs|traces)/[\w./-]*)`"
)
#: The old specification's citations. Written so that this file does not match itself.
_OLD_SPEC = re.compile(r"\bSPEC(?:[ \t]*\u00a7|\.md\b)")
#: A citation of an issue by number ("issue 31", "Issues 30 and 31", "issue-30", "issue #7").
#: Written so that this file does not match itself.
_ISSUE_NUMBER = re.compile(r"\bissues?[\s-]+#?[0-9]", re.I)
#: Where no issue number may appear: the pages and the product packages.
_NO_ISSUE_NUMBERS = ("README.md", "CHANGELOG.md", "docs/*", "dmuon/*", "verify/*", "tracer/*")
_TEXT_SUFFIXES = {".md", ".py", ".yml", ".yaml", ".json", ".toml", ".txt", ".cfg"}
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`]*`")


def _pages() -> list[Path]:
    changelog = [ROOT / "CHANGELOG.md"] if (ROOT / "CHANGELOG.md").is_file() else []
    return [README, *changelog, *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without code (``blocks[i](x)`` in code is not a link)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)
    return {_slug(h) for h in headings}


def _links(page: Path) -> list[tuple[str, str]]:
    """(target path, fragment) of every relative link on ``page``."""
    out = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        out.append((path, fragment))
    return out


def _tracked(*patterns: str) -> list[Path]:
    """Tracked files matching ``patterns`` (git), or every such file below ROOT without git."""
    try:
        names = subprocess.run(
            ["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True,
            check=True, text=True,
        ).stdout.split("\0")
        return [ROOT / n for n in names if n and (ROOT / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "traces", "__pycache__"}
        return [
            p for pattern in patterns for p in ROOT.rglob(pattern)
            if not skip & set(p.relative_to(ROOT).parts)
        ]


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to docs/"
    )


def test_relative_links_point_at_existing_files():
    broken = [
        f"{page.relative_to(ROOT)}: ({path})"
        for page in _pages()
        for path, _ in _links(page)
        if path and not (page.parent / path).exists()
    ]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_link_fragments_name_a_heading():
    broken = []
    for page in _pages():
        for path, fragment in _links(page):
            target = (page.parent / path) if path else page
            if fragment and target.suffix == ".md" and target.is_file():
                if fragment not in _anchors(target):
                    broken.append(f"{page.relative_to(ROOT)}: ({path}#{fragment})")
    assert not broken, "links to missing headings:\n" + "\n".join(broken)


def test_named_repository_paths_exist():
    missing = [
        f"{page.relative_to(ROOT)}: `{name}`"
        for page in _pages()
        for name in _REPO_PATH.findall(page.read_text())
        if not (ROOT / name).exists()
    ]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def _layout_entries() -> list[Path]:
    """Files and folders the README's Layout tree names, each under the folder it sits in.

    A line's first name is an entry of the current folder (a top-level line: of the root);
    when it is a folder, the ``*.py`` names after it on that line and on its continuation lines
    are inside it, otherwise they are its siblings.
    """
    text = README.read_text()
    block = re.search(r"^## Layout\n+```\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md: no Layout tree"
    entries: list[Path] = []
    top = Path()
    inner = Path()
    for line in block.group(1).splitlines():
        indent = len(line) - len(line.lstrip())
        first = line.split()[0] if line.strip() else ""
        if indent == 0 and first:
            top = Path(first.rstrip(","))
            inner = top
            entries.append(top)
        elif indent == 2 and first:
            entry = top / first.rstrip(",")
            entries.append(entry)
            inner = entry if first.endswith("/") else top
        names = re.findall(r"\b([\w]+\.py)\b", line)
        entries += [inner / n for n in names if inner / n not in entries]
    return entries


def test_layout_tree_names_existing_paths():
    missing = [str(p) for p in _layout_entries() if not (ROOT / p).exists()]
    assert not missing, "README Layout names paths that do not exist: " + ", ".join(missing)


def test_no_citation_of_the_out_of_tree_spec():
    spec = ROOT / "docs" / "spec.md"
    hits = []
    for path in _tracked("*.py", "*.md"):
        if path == spec:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OLD_SPEC.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "cite docs/spec.md §N instead:\n" + "\n".join(hits)


@pytest.mark.parametrize("heading,slug", [
    ("Setting up: FSDP2, DDP, HSDP", "setting-up-fsdp2-ddp-hsdp"),
    ("Activation checkpointing and torch.compile", "activation-checkpointing-and-torchcompile"),
    ("`dmuon-trace`", "dmuon-trace"),
])
def test_slug_follows_github(heading, slug):
    assert _slug(heading) == slug


def test_no_issue_numbers_in_pages_or_product_code():
    hits = []
    for path in _tracked(*_NO_ISSUE_NUMBERS):
        if path.suffix not in _TEXT_SUFFIXES:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _ISSUE_NUMBER.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, (
        "issue numbers a user cannot look up; say what is meant today (history goes to "
        "CHANGELOG.md without numbers, upstream reports as owner/repo#N):\n" + "\n".join(hits)
    )


@pytest.mark.parametrize("text,cites", [
    ("dmuon-z3 was 1.27 before issue 31", True),
    ("(issue 34, item 2)", True),
    ("Issues 30 and 31 changed the order", True),
    ("the issue-30 rule", True),
    ("see issue #12", True),
    ("the real Send/Recv lines of NVIDIA/nccl#584", False),
    ("one issue order across channels", False),
    ("a backward issues the reduces, 3 of them", False),
])
def test_issue_number_pattern(text, cites):
    """The planted citations must be caught (the control of the check above), prose must not."""
    assert bool(_ISSUE_NUMBER.search(text)) is cites


def test_every_test_the_porting_guide_names_exists():
    """docs/porting.md ties each checklist item to a test that runs that habit: each named
    ``test_...`` is a test function somewhere under tests/ (a renamed or deleted test fails
    here, so the checklist cannot cite a test that no longer runs)."""
    named = set(re.findall(r"`(test_\w+)", (ROOT / "docs" / "porting.md").read_text()))
    defined = {m for path in (ROOT / "tests").rglob("test_*.py")
               for m in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    assert len(named) >= 20, sorted(named)
    assert sorted(named - defined) == []


#: A citation of docs/protocol.md by step ("docs/protocol.md step 4", "``docs/protocol.md``, steps
#: 2-3", "[protocol.md](protocol.md) step 2") or by section (``protocol.md``, "States").
_PROTOCOL_CITE = re.compile(
    r'protocol\.md(?:`{1,2}|\))?,?\s+(?:"([^"]+)"|steps?\s+(\d+)(?:\s*[-–]\s*(\d+))?)')


def _bad_protocol_citations(text: str, headings: set[str]) -> list[str]:
    """The citations in ``text`` of a step or section that docs/protocol.md does not have
    (``headings``: its heading texts)."""
    bad = []
    for m in _PROTOCOL_CITE.finditer(text):
        section, first, last = m.groups()
        if section is not None:
            ok = section in headings
        else:
            steps = range(int(first), int(last or first) + 1)
            ok = all(any(h.startswith(f"Step {n}:") for h in headings) for n in steps)
        if not ok:
            bad.append(m.group(0))
    return bad


def _protocol_headings() -> set[str]:
    text = _FENCE.sub("", (ROOT / "docs" / "protocol.md").read_text())
    return {h.strip() for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def test_protocol_citations_name_its_steps_and_sections():
    """docs/protocol.md is the protocol's one text, cited by step number ("step 4") and section
    from code, tests and pages: every such citation names a step 1-7 or a heading it has, so a
    renumbered step or a renamed section cannot leave stale pointers behind."""
    headings = _protocol_headings()
    assert {f"Step {n}" for n in range(1, 8)} <= {h.split(":")[0] for h in headings}
    hits = [f"{path.relative_to(ROOT)}: {c}" for path in _tracked("*.py", "*.md")
            if path != Path(__file__).resolve()  # its planted controls below
            for c in _bad_protocol_citations(path.read_text(errors="replace"), headings)]
    assert not hits, "citations of docs/protocol.md it cannot answer:\n" + "\n".join(hits)


@pytest.mark.parametrize("text,bad", [
    ("(docs/protocol.md step 4)", []),
    ("``docs/protocol.md``, steps 2-3", []),
    ('[protocol.md](protocol.md), "Tensor parallelism"', []),
    ("(docs/protocol.md step 9)", ["protocol.md step 9"]),
    ("``docs/protocol.md`` steps 6-8", ["protocol.md`` steps 6-8"]),
    ('``docs/protocol.md``, "Per step"', ['protocol.md``, "Per step"']),
])
def test_protocol_citation_check_catches_planted_ones(text, bad):
    """The control of the check above: planted citations of a missing step or section fail."""
    assert _bad_protocol_citations(text, _protocol_headings()) == bad
