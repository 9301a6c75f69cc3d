"""The layering the README's layout table describes, checked on the source: one module per library, short functions."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "edgespec"
MAX_FUNCTION_LINES = 60
# A library with a native core or a user interface is imported by exactly one module.
OWNERS = {"llama_cpp": "backend.py", "onnxruntime": "ort.py", "click": "cli.py", "prompt_toolkit": "repl.py"}


def modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_one_module_imports_each_library(library):
    importers = [name for name, tree in modules() if library in imported(tree)]
    assert importers == [OWNERS[library]]


def test_no_function_is_longer_than_the_limit():
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, tree in modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
