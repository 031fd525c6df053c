"""The repository's shape: offline synthesis loads nothing Triton-facing (the static import rules are in
test_import_graph.py), and the README's contract tables are the ones the serving contract defines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serving.contract import readme_tables

ROOT = Path(__file__).resolve().parents[2]
TRITON_FACING = ("serving", "gateway", "tritonclient", "triton_python_backend_utils", "client")


def test_offline_synthesis_loads_no_serving_module():
    code = "import sys, engine.synthesize, engine.local; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))"
    out = subprocess.run([sys.executable, "-c", code % (TRITON_FACING,)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_readme_tables_match_the_contract():
    readme = (ROOT / "README.md").read_text()
    for title, table in readme_tables().items():
        assert table in readme, f"README's {title} table differs from serving.contract (python -m serving.contract)"


def test_model_files_stay_thin():
    for path in (ROOT / "model_repository").glob("*/1/model.py"):
        assert len(path.read_text().splitlines()) < 200, path


def test_the_readme_layout_names_files_that_exist_and_every_source_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout\n") :]
    layout = layout[: layout.find("\n## ", 5)] if "\n## " in layout[5:] else layout
    folder, named = "", set()
    for line in layout.split("```")[1].splitlines():  # the tree: "engine/" headings, then indented files
        words = line.split()
        if not words:
            continue
        if not line.startswith(" ") and words[0].endswith("/"):
            folder = words[0]
            continue
        if folder in ("engine/", "serving/"):
            for word in words:
                name = word.strip(",;:()")
                if name.endswith((".py", "/")) and not name.startswith(("(", "tests")):
                    named |= {f"{folder}{part}" for part in name.split(",") if part}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"the README's layout names files that do not exist: {missing}"
    for package in ("engine", "serving"):
        modules = {f"{package}/{p.name}" for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"}
        modules |= {f"{package}/{p.name}/" for p in (ROOT / package).iterdir() if (p / "__init__.py").exists()}
        unnamed = sorted(modules - named)
        assert not unnamed, f"the README's layout does not mention {unnamed}"
