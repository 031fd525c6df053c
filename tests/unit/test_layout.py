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
