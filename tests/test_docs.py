"""The README is the front door and docs/ holds the reference: the README stays short, links
every page of docs/, every page links back to it, and no relative link (nor its anchor) is
broken."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 400

# [text](target) and ![alt](target); the target ends at whitespace or ")"
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`+[^`\n]*`+")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _prose_lines(path: Path) -> list[str]:
    """The lines of `path` outside fenced code blocks, code spans blanked."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_CODE_SPAN.sub("``", line))
    return lines


def _links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(path) for m in _LINK.finditer(line)]


def _relative_links(path: Path) -> list[str]:
    return [t for t in _links(path) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def _resolve(path: Path, target: str) -> tuple[Path, str]:
    """The file `target` (a link in `path`) points to, and its anchor ("" for none)."""
    file, _, anchor = target.partition("#")
    return ((path.parent / file).resolve() if file else path.resolve()), anchor


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_readme_is_at_most_400_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, more than {README_MAX_LINES}: move reference material into "
        "a page of docs/ and link it"
    )


def test_the_readme_links_every_page_of_docs():
    linked = {_resolve(README, t)[0] for t in _relative_links(README)}
    missing = [p.relative_to(ROOT).as_posix() for p in _pages() if p.resolve() not in linked]
    assert not missing, f"README.md does not link these pages of docs/: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_page_links_back_to_the_readme(page):
    first = next((line for line in page.read_text(encoding="utf-8").splitlines() if line.strip()),
                 "")
    targets = [_resolve(page, m.group(1))[0] for m in _LINK.finditer(first)]
    assert README.resolve() in targets, (
        f"{page.relative_to(ROOT)}: its first line must link back to the README "
        f"(`[fastcomm](../README.md) › Page`), not {first!r}"
    )


@pytest.mark.parametrize(
    "source", [README, *_pages()], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_relative_links_point_to_files_and_headings_that_exist(source):
    broken = []
    for target in _relative_links(source):
        file, anchor = _resolve(source, target)
        if not file.exists():
            broken.append(f"{target} (no file {file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading with anchor #{anchor} in {file.name})")
    assert not broken, f"{source.relative_to(ROOT)}: broken links: {broken}"


def test_the_link_checks_see_links_and_skip_code():
    """The parsing the tests above rely on: links found in prose, not in code."""
    assert _slug("Training health (`health.py`)") == "training-health-healthpy"
    assert _slug("Results: CPU, the final code of 2026-11-25 (one quiet run)") == (
        "results-cpu-the-final-code-of-2026-11-25-one-quiet-run"
    )
    assert _slug("The torch.distributed backend") == "the-torchdistributed-backend"
    line = "see [a](docs/a.md#x) and ![b](../b.png) but not `[c](d.md)`"
    assert [m.group(1) for m in _LINK.finditer(_CODE_SPAN.sub("``", line))] == [
        "docs/a.md#x", "../b.png"
    ]
