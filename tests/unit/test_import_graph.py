"""Who may import whom: the client stays light, no package of ours has import circles, engine/ stays the
model, and the client speaks the serving contract, not the server's insides.

The static checks read every ``import`` of a file with :mod:`ast` (those inside functions too, which
run sooner or later; those under ``if TYPE_CHECKING:`` never run and are left out of the circles).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What `import client` must not load: torch (seconds, GBs), the text front end and its tokenizers
HEAVY = ("torch", "tokenizers", "regex", "engine.frontend", "engine.text", "soundfile", "soxr")
LIGHT_IMPORTS = ("client", "client.cli", "engine.protocol", "serving.contract")
# engine/ is the model: nothing Triton-facing
NOT_FOR_ENGINE = ("serving", "gateway", "client", "tritonclient", "triton_python_backend_utils")
# The client speaks the contract: the tensors and parameters (serving.contract), the parameters'
# defaults and bounds (engine.params, which serving.contract builds on), and the wire's kinds, finish
# reasons and sample rate (engine.protocol), and the one stereo rule (engine.audio.downmix: numpy only,
# so a file read by the client gives the voice it gives offline). Anything else would drag the model along.
CLIENT_MAY_IMPORT = {"serving": {"serving.contract"}, "engine": {"engine.protocol", "engine.params", "engine.audio"}}


def _under_type_checking(tree: ast.AST) -> set[ast.AST]:
    """The import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped |= {n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)}
    return skipped


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, runtime_only: bool = False) -> set[str]:
    return imported_in(path.read_text(), module_name(path), path.name == "__init__.py", runtime_only)


def imported_in(source: str, module: str, is_package: bool = False, runtime_only: bool = False) -> set[str]:
    """Dotted names of the modules ``source`` (module ``module``) imports; ``from a.b import c`` counts
    ``a.b.c`` when that is a module of the repository, else ``a.b``."""
    tree = ast.parse(source)
    skipped = _under_type_checking(tree) if runtime_only else set()
    package = module.split(".") if is_package else module.split(".")[:-1]
    names = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            for alias in node.names:
                sub = Path(*f"{base}.{alias.name}".split("."))
                is_module = (ROOT / sub).with_suffix(".py").exists() or (ROOT / sub / "__init__.py").exists()
                names.add(f"{base}.{alias.name}" if is_module else base)
    return names


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> ... -> a) per strongly connected group of modules that import each other."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_in(graph, group) for group in groups]


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A path from the group's first module back to itself, through the group (breadth first: the shortest)."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & group):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    raise AssertionError(f"{sorted(group)} is no circle")  # Tarjan's groups always have one


# The packages whose modules import each other; model_repository's model.py files are loaded by path.
PACKAGES = ("engine", "serving", "gateway", "client", "bench", "loadtest")


def graph_of(*folders: str) -> dict[str, set[str]]:
    """Module -> the modules of ``folders`` it imports at run time (inside functions too)."""
    modules = {module_name(p): p for folder in folders for p in _files(folder)}
    return {name: {m for m in imported(path, runtime_only=True) if m in modules and m != name}
            for name, path in modules.items()}  # fmt: skip


def engine_graph() -> dict[str, set[str]]:
    return graph_of("engine")


@pytest.mark.parametrize("module", LIGHT_IMPORTS)
def test_the_client_and_the_protocol_load_neither_torch_nor_the_text_front_end(module):
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    loaded = [m for m in json.loads(out.stdout) if any(_is(m, heavy) for heavy in HEAVY)]
    assert not loaded, f"import {module} loads {loaded}"


def test_engine_has_no_import_circles():
    circles = find_circles(engine_graph())
    assert not circles, "import circles in engine/:\n" + "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("package", PACKAGES[1:])
def test_no_package_has_import_circles(package):
    """A circle through a function-level import (client.text_in <-> client.tts_client once) counts: it runs
    as soon as the function does, and a module half-loaded then fails by name, or not at all."""
    circles = find_circles(graph_of(package))
    assert not circles, f"import circles in {package}/:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_no_circles_across_packages():
    circles = find_circles(graph_of(*PACKAGES))
    assert not circles, "import circles across packages:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_engine_imports_nothing_triton_facing():
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported(path) if any(_is(m, f) for f in NOT_FOR_ENGINE))
        for path in _files("engine")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_client_imports_only_the_contract_of_the_server():
    offenders = {}
    for path in _files("client"):
        names = imported(path)
        bad = sorted(m for m in names for top, allowed in CLIENT_MAY_IMPORT.items() if _is(m, top) and m not in allowed)
        bad += sorted(m for m in names if _is(m, "gateway") or _is(m, "model_repository"))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders


def test_the_circle_finder_finds_a_circle_and_only_circles():
    # independent of the repository: a hand-made graph with one circle of three and a branch off it
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(find_circles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_inside_functions_and_relative_ones_count():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import engine.params\n"
        "from engine import protocol\n"
        "from engine.protocol import Chunk\n"
        "from . import rope\n"
        "from .. import config\n"
        "if TYPE_CHECKING:\n    import engine.audio\n"
        "def main():\n    from engine import frontend\n"
    )
    assert imported_in(source, "engine.layers.probe", runtime_only=True) == {
        "typing", "engine.params", "engine.protocol", "engine.layers.rope", "engine.config", "engine.frontend",
    }  # fmt: skip
    assert "engine.audio" in imported_in(source, "engine.layers.probe")
