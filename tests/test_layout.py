"""The layering docs/architecture.md and the README's layout table describe, checked on the source."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edgespec"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 650
MAX_TOP_MODULES = 12
# A library with a native core or a user interface is imported by exactly one module (or one package, for the CLI).
OWNERS = {"llama_cpp": "backend/", "onnxruntime": "onnx/runtime.py", "prompt_toolkit": "cli/repl.py",
          "click": "cli/"}


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


def module_of(dotted: str) -> str | None:
    """The file of an edgespec module path ("edgespec.decoding.loop" -> "decoding/loop.py"), None if none."""
    parts = dotted.split(".")[1:]
    if (PACKAGE.joinpath(*parts).with_suffix(".py")).exists():
        return "/".join(parts) + ".py"
    if PACKAGE.joinpath(*parts, "__init__.py").exists():
        return "/".join([*parts, "__init__.py"])
    return None


def edges() -> dict[str, set[str]]:
    """Which edgespec module imports which, at any depth (deferred imports inside functions count too)."""
    graph: dict[str, set[str]] = {}
    for name, tree in modules():
        out = graph.setdefault(name, set())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from edgespec.pkg import mod` names a module; `from edgespec.mod import name` names a symbol
                targets = [f"{node.module}.{a.name}" if module_of(f"{node.module}.{a.name}") else node.module
                           for a in node.names]
            for t in targets:
                if t.split(".")[0] == "edgespec" and (m := module_of(t)) and m != name:
                    out.add(m)
    return graph


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_one_module_imports_each_library(library):
    importers = [name for name, tree in modules() if library in imported(tree)]
    owner = OWNERS[library]
    if owner.endswith("/"):
        assert importers and all(name.startswith(owner) for name in importers), importers
    else:
        assert importers == [owner]


def test_no_import_circle():
    graph = edges()
    circles = []

    def visit(node: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == "__init__.py":
                continue  # the package's own facade re-exports; nothing in edgespec imports it
            if nxt in on_path:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                on_path.add(nxt)
                visit(nxt, path + [nxt], on_path, done)
                on_path.discard(nxt)
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start], {start}, done)
    assert not circles, f"import circles: {circles}"


def test_no_function_is_longer_than_the_limit():
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, tree in modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_class_or_module_is_longer_than_the_limit():
    big = [f"{name} class {node.name} ({node.end_lineno - node.lineno + 1} lines)"
           for name, tree in modules() for node in ast.walk(tree)
           if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    big += [f"{p.relative_to(PACKAGE)} ({n} lines)" for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"over {MAX_CLASS_LINES} lines a class or {MAX_MODULE_LINES} a module: {big}"


def test_the_top_level_holds_at_most_a_dozen_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_the_readme_layout_table_matches_the_tree():
    """Every row of the README's layout table names a module or package that exists, and every module and package
    directly under edgespec/ has a row."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\|\s*`edgespec/([\w.]+/?)`", section, flags=re.M))
    tree = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    tree |= {p.name for p in PACKAGE.glob("*.py")}
    assert named == tree, f"in the README only: {sorted(named - tree)}; in the tree only: {sorted(tree - named)}"
