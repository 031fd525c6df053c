"""The repository's shape: offline synthesis loads nothing Triton-facing (the static import rules are in
test_import_graph.py); the contract tables in docs/serving.md are the ones the serving contract defines, the
layout in docs/development.md names the modules that exist, and the README and docs/ link only to pages and
headings that exist; no await is bounded with asyncio.wait_for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.docs import DOCS, README, anchors, contract_tables, links, pages, section

ROOT = Path(__file__).resolve().parents[2]
TRITON_FACING = ("serving", "gateway", "tritonclient", "triton_python_backend_utils", "client")


def test_offline_synthesis_loads_no_serving_module():
    code = "import sys, engine.synthesize, engine.local; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))"
    out = subprocess.run([sys.executable, "-c", code % (TRITON_FACING,)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_readme_tables_match_the_contract():
    """The tables live in docs/serving.md (the README links to it)."""
    page = (DOCS / "serving.md").read_text()
    for title, table in contract_tables().items():
        assert table in page, f"docs/serving.md's {title} table differs from python -m tests.docs"


def test_the_readme_and_docs_link_only_to_pages_and_headings_that_exist():
    texts = pages()
    for page, text in texts.items():
        for target in links(text):
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name} links to {target}, which does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked.read_text()), f"{page.name} links to {target}: no such heading"
    listed = {(README.parent / t.partition("#")[0]).resolve() for t in links(texts[README])}
    unlisted = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in listed)
    assert not unlisted, f"the README's table of contents does not link {unlisted}"


def test_model_files_stay_thin():
    for path in (ROOT / "model_repository").glob("*/1/model.py"):
        assert len(path.read_text().splitlines()) < 200, path


def test_the_layout_names_files_that_exist_and_every_source_module():
    """engine/ and serving/: every module and sub-package named; serving's sub-packages, module by module too."""
    layout = section(DOCS / "development.md", "## Layout")
    folders, named = [], set()  # folders: the open folders, each with its indentation
    for line in layout.split("```")[1].splitlines():  # the tree: "engine/" headings, then indented files
        words = line.split()
        if not words:
            continue
        indent = len(line) - len(line.lstrip())
        if not indent % 2:  # an entry; an odd indentation continues the description above, in its folder
            folders = [(i, f) for i, f in folders if i < indent]
        if not indent and words[0].endswith("/"):
            folders = [(0, words[0])]
            continue
        folder = "".join(f for _, f in folders)
        if folder.split("/")[0] not in ("engine", "serving"):
            continue
        for word in words:
            name = word.strip(",;:()")
            if name.endswith((".py", "/")) and not name.startswith(("(", "tests")):
                named |= {f"{folder}{part}" for part in name.split(",") if part}
        if words[0].endswith("/") and (ROOT / folder / words[0] / "__init__.py").exists():
            folders.append((indent, words[0]))  # a sub-package whose modules may follow, indented deeper
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/development.md's layout names files that do not exist: {missing}"
    for package, deep in (("engine", False), ("serving", True)):
        paths = (ROOT / package).rglob("*.py") if deep else (ROOT / package).glob("*.py")
        modules = {p.relative_to(ROOT).as_posix() for p in paths if p.name != "__init__.py"}
        modules |= {
            f"{p.relative_to(ROOT).as_posix()}/" for p in (ROOT / package).iterdir() if (p / "__init__.py").exists()
        }
        unnamed = sorted(modules - named)
        assert not unnamed, f"docs/development.md's layout does not mention {unnamed}"


def test_test_modules_have_unique_names():
    """pytest imports test modules by their basename (no packages under tests/): two with one name stop
    the whole run at collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_no_await_is_bounded_with_asyncio_wait_for():
    """On Python 3.11 ``asyncio.wait_for`` loses a cancellation that comes as the awaited thing completes
    (it returns the result; the caller reads on until an idle timeout): bound an await with
    ``async with asyncio.timeout(s)`` (tests/unit/test_text_streams.py shows the race)."""
    found = [f"{p.relative_to(ROOT)}:{i}" for top in ("engine", "serving", "gateway", "client", "model_repository")
             for p in (ROOT / top).rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
             if "asyncio.wait_for(" in line]  # fmt: skip
    assert not found, found
