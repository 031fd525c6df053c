"""The README and the pages in docs/, as the tests read them: every page's text, the fenced snippet that
follows a ``<!-- snippet: NAME -->`` line, and the relative links between pages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> dict[Path, str]:
    """README.md and every docs/*.md -> its text."""
    return {path: path.read_text() for path in [README, *sorted(DOCS.glob("*.md"))]}


def snippet(name: str, page: Path = README) -> str:
    """The body of the one fenced block right after ``<!-- snippet: name -->`` in ``page``."""
    pattern = rf"^<!-- snippet: {re.escape(name)} -->\n```[\w-]*\n(.*?)^```$"
    found = re.findall(pattern, page.read_text(), re.MULTILINE | re.DOTALL)
    assert len(found) == 1, f"{page.name} has {len(found)} snippets named {name!r}"
    return found[0]


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` (a whole line such as ``## Layout``) up to the next heading of its level."""
    text = page.read_text()
    level = heading.split()[0]
    start = text.index(f"\n{heading}\n") + 1
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def anchors(text: str) -> set[str]:
    """GitHub's ids for the headings of a markdown text (lower case, punctuation dropped, spaces as -), and
    the ids of its HTML anchors (``<a id="T23"></a>``: docs/triton.md's rows)."""
    ids, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            if m := re.match(r"#+ (.*)", line):
                ids.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
            ids.update(re.findall(r'<a id="([^"]+)"></a>', line))
    return ids


def links(text: str) -> list[str]:
    """Relative link targets (``docs/x.md#anchor``, ``#anchor``) outside code; web addresses left out."""
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z]+:", t)]
