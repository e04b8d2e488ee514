"""What a Python agent's file imports at its top level, read from its source (``ast``), and imported by its
template before the forks. Only a Python template imports this module (a bare one, the spawner's, never reads a
source). Stdlib only."""

from __future__ import annotations

import ast
import importlib
import importlib.util


def _imported_names(tree: ast.Module, agent_class: str | None = None) -> list[str]:
    """Absolute module names the file imports at its top level (in ``if``, ``try``, ``with`` blocks too, but not
    in ``except`` handlers: fallbacks), and anywhere in the body of the class ``agent_class`` (its ``run()``'s
    imports), in order. Functions and other classes are left alone (a ``main()`` that imports a trainer)."""
    nodes: list[ast.AST] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.ClassDef) and node.name == agent_class:
            nodes.extend(ast.walk(node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            nodes.append(node)
        elif isinstance(node, (ast.If, ast.With, ast.AsyncWith)):
            todo[:0] = [*node.body, *getattr(node, "orelse", [])]
        elif isinstance(node, ast.Try):
            todo[:0] = [*node.body, *node.orelse, *node.finalbody]
    names: list[str] = []
    for found in nodes:
        if isinstance(found, ast.Import):
            names.extend(alias.name for alias in found.names)
        elif isinstance(found, ast.ImportFrom) and found.level == 0 and found.module:
            names.append(found.module)
            names.extend(f"{found.module}.{alias.name}" for alias in found.names if alias.name != "*")
    return names


def preimport(source: str | None, skip: str | None = None, agent_class: str | None = None) -> None:
    """Import what a file imports (failures are the attempt's to meet: ignored here)."""
    if not source:
        return
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for name in _imported_names(tree, agent_class):
        if name == skip or name == "__main__":
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # an import that fails or exits is the attempt's problem
            pass


def source_of(module: str) -> str | None:
    """The source of ``module`` (found, not imported), or ``None``."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_source"):
        return None
    try:
        return spec.loader.get_source(module)
    except (ImportError, OSError):
        return None
