"""The layout's rules that `lint-imports` (the layer contracts in pyproject.toml) does not check:
tba modules are imported at the top of a file (but where the command line defers its commands),
the command line starts without the training libraries, and everything but the searcher
processes runs without Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).parent.parent / "src" / "tba"


def _imports_inside_functions(path: Path) -> list[str]:
    """`module:line` of every import of a tba module made inside a function."""
    found = []
    tree = ast.parse(path.read_text())
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["tba"] if node.level else [node.module or ""]
            else:
                continue
            if any(name == "tba" or name.startswith("tba.") for name in names):
                found.append(f"{path.relative_to(SOURCE.parent)}:{node.lineno}")
    return found


# The two files that import tba modules where they are used, so that `import tba` and the command
# line's answer to a bad value (or `tba config`) do not wait for transformers, peft and datasets.
DEFERRING = {SOURCE / "__init__.py", SOURCE / "cli.py"}


def test_tba_modules_are_imported_at_the_top_of_files():
    paths = sorted(set(SOURCE.rglob("*.py")) - DEFERRING)
    found = [hit for path in paths for hit in _imports_inside_functions(path)]
    assert found == []


def test_the_command_line_and_the_package_import_without_the_training_libraries():
    code = ("import sys, tba, tba.cli; "
            "print(sorted({'transformers', 'peft', 'datasets', 'matplotlib'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_everything_but_the_searcher_processes_imports_without_ray():
    code = ("import sys, tba, tba.cli, tba.run, tba.runtime.launch; "
            "print('ray' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
