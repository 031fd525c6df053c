"""The README and the pages in docs/, as the tests read them: every page's text, the fenced snippet that
follows a ``<!-- snippet: NAME -->`` line, and the relative links between pages."""

from __future__ import annotations

import re
from pathlib import Path

from engine.instructions import ACOUSTIC_TEMPLATES, MAX_EDIT_SECONDS
from engine.params import CFG, DEFAULT_SEED, Parameter
from serving import contract as c

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


def tensor_table(specs: tuple[c.Spec, ...], heading: str) -> str:
    """A markdown table of tensors, as the README shows them."""
    rows = [f"| {heading} | type | shape | |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.datatype} | [{', '.join(map(str, s.dims))}] | {s.doc} |" for s in specs]
    return "\n".join(rows)


def parameter_table(params: tuple[Parameter, ...]) -> str:
    rows = ["| parameter | type | default | range | |", "|---|---|---|---|---|"]
    for p in params:
        default, bounds = (
            (str(p.default).lower(), "true, false") if p.type is bool else (p.default, f"{p.low}..{p.high}")
        )
        rows.append(f"| `{p.name}` | {p.type.__name__} | {default} | {bounds} | {p.doc} |")
    return "\n".join(rows)


def task_table() -> str:
    """The tasks of ``tts`` as the README shows them, with the defaults a request without SEED / cfg gets."""
    rows = ["| `TASK` | model | needs | refuses | default seed, cfg | |", "|---|---|---|---|---|---|"]
    for task, (model, needs, refuses, what) in c.TASK_RULES.items():
        d = c.TASK_DEFAULTS.get(task)
        seed_cfg = f"{d.seed}, {d.cfg}" if d else f"{DEFAULT_SEED}, {CFG.default}"
        rows.append(f"| `{task}` | {model} | {needs} | {refuses or '-'} | {seed_cfg} | {what} |")
    return "\n".join(rows)


def contract_tables() -> dict[str, str]:
    """The contract's tables in docs/serving.md (serving.contract), keyed by the heading of the section that
    holds them; ``python -m tests.docs`` prints them."""
    return {
        "tts inputs": tensor_table(c.TTS_INPUTS, "input"),
        "tts outputs": tensor_table(c.TTS_OUTPUTS, "output"),
        "tts tasks": task_table(),
        "acoustic edits": "\n".join(f"- `{shown}`" for shown in ACOUSTIC_TEMPLATES)
        + f"\n\nEdits take recordings of at most {MAX_EDIT_SECONDS:g} s.",
        "request parameters": parameter_table(c.TTS_PARAMETERS),
        "tts_ensemble inputs": tensor_table(c.ENSEMBLE_INPUTS, "input"),
        "tts_ensemble outputs": tensor_table(c.ENSEMBLE_OUTPUTS, "output"),
    }


if __name__ == "__main__":
    for title, table in contract_tables().items():
        print(f"{title}:\n\n{table}\n")
