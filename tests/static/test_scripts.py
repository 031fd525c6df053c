"""The Python that shell scripts run inline (``$PY -c "..."``) imports names that exist: a module that moves
breaks a script only at the end of a 10-minute soak otherwise."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for d in ("loadtest", "bench", "docker", "deploy", ".ci") for p in (ROOT / d).rglob("*.sh"))
INLINE = re.compile(r'-c "(.*?)"', re.S)


def imports(script: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from module import name`` in the script's inline Python."""
    found = []
    for code in INLINE.findall(script.read_text()):
        try:
            tree = ast.parse(code.replace('\\"', '"'))
        except SyntaxError:
            continue  # not Python (or built with shell expansions)
        found += [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    return found


def test_the_scripts_run_inline_python():
    assert any(imports(s) for s in SCRIPTS), "no inline Python found: the pattern no longer matches the scripts"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_inline_imports_exist(script):
    for module, name in imports(script):
        assert hasattr(importlib.import_module(module), name), f"{script.name}: from {module} import {name}"
