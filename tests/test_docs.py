"""The docs stay guides a reader can carry: every docs/*.md page is at most 300 lines (run-by-run
notes live in benchmarks/history/), every relative link in README.md, docs/*.md and
benchmarks/RESULTS.md resolves to a file or folder of the checkout, a link's #anchor names a
heading of the Markdown page it points to, and benchmarks/ keeps at most 15 entries at its top."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and indented code lines (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            out.append(line)
    return "\n".join(out)


def links(text: str) -> list[str]:
    return [a or b for a, b in _LINK.findall(_prose(text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"`|<[^>]+>", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor})")
    return bad


def test_link_checker_sees_what_it_must(tmp_path):
    """Negative control: a missing file and a missing anchor are reported, a good link, a URL,
    a link inside a code block and a heading's anchor are not."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Why it's `fast` (measured)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md) [b](other.md#why-its-fast-measured) [c](https://example.com/x) [d](#top)\n"
        "# Top\n[e](missing.md) [f](other.md#nope)\n\n```\n[g](also-missing.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nope (no heading #nope)"]


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_is_a_guide_of_at_most_300_lines(page):
    n = len(page.read_text().splitlines())
    assert n <= MAX_LINES, f"docs/{page.name} has {n} lines: move run-by-run notes to benchmarks/history/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: " + ", ".join(broken_links(page))


def test_benchmarks_top_level_holds_at_most_15_entries():
    top = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.name != "__pycache__")
    assert len(top) <= 15, top
    assert (ROOT / "benchmarks" / "RESULTS.md").is_file() and (ROOT / "benchmarks" / "history").is_dir()


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and f"({p.name}" not in index]
    assert not missing, f"docs/README.md does not link {missing}"
