"""What a Python template prepares once for every attempt of its agent: the agent's module or script imported,
with what it imports at its top level (and what the agent class's body imports), and the agent's own files,
whose change makes the template stale. Stdlib only (``ast``, ``runpy`` and ``importlib.util`` only for a Python
agent: a bare template, the spawner's, never imports them)."""

from __future__ import annotations

import builtins
import importlib
import os
import sys


def _imported_names(tree: ast.Module, agent_class: str | None = None) -> list[str]:  # noqa: F821 (imported inside)
    """Absolute module names the file imports at its top level (in ``if``, ``try``, ``with`` blocks too, but not
    in ``except`` handlers: fallbacks), and anywhere in the body of the class ``agent_class`` (its ``run()``'s
    imports), in order. Functions and other classes are left alone (a ``main()`` that imports a trainer)."""
    import ast  # here, not at the top: a bare template (the spawner's) never needs it

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


def _preimport(source: str | None, skip: str | None = None, agent_class: str | None = None) -> None:
    """Import what a file imports (failures are the attempt's to meet: ignored here)."""
    if not source:
        return
    import ast

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


def _source_of(module: str) -> str | None:
    import importlib.util

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


def _run_class(cls: type) -> None:
    result = cls().run()
    if hasattr(result, "__await__"):
        import asyncio

        asyncio.run(result)


#: What nearly every agent imports at its first connection, whatever its HTTP client: the codec ``socket`` encodes
#: a host name with for ``getaddrinfo`` (and the modules it needs). Imported by each Python template, so that no
#: fork pays for it (~5 ms of CPU each) before the template has learned it from the first ones.
_NETWORKED = ("encodings.idna",)


def prepare(kind: str, spec: list[str]):
    """What one attempt runs in its forked process, given its argv (``None`` for ``bare``: it execs)."""
    if kind == "bare":
        return None, []
    import importlib.util  # a Python agent's template (a bare one, the spawner's, imports what it needs alone)
    import runpy

    for name in _NETWORKED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if kind == "class":
        (path,) = spec
        module, sep, name = path.partition(":")
        if not sep:
            module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not isinstance(cls, type):
            raise TypeError(f"{path} is not a class")
        _preimport(_source_of(module), skip=module, agent_class=name)
        files = [getattr(sys.modules[module], "__file__", None)]
        return (lambda argv: _run_class(cls)), files
    if kind == "script":
        (path,) = spec
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        with open(path, encoding="utf-8", errors="replace") as f:
            _preimport(f.read())
        return (lambda argv: runpy.run_path(path, run_name="__main__")), [path]
    if kind == "module":
        (name,) = spec
        sys.path[0] = os.getcwd()
        package = name.rpartition(".")[0]
        if package:
            importlib.import_module(package)
        source = _source_of(name)
        if source is None:
            raise ImportError(f"No module named {name!r} (or it has no source to run)")
        _preimport(source, skip=name)
        found = importlib.util.find_spec(name)
        return (lambda argv: runpy.run_module(name, run_name="__main__", alter_sys=True)), [
            found and found.origin
        ]
    if kind == "code":
        (code,) = spec
        _preimport(code)
        compiled = compile(code, "<string>", "exec")
        return (lambda argv: exec(compiled, {"__name__": "__main__", "__builtins__": builtins})), []
    raise ValueError(f"unknown template kind {kind!r}")


#: This package's name where it runs (``_aglverl_template`` in a template).
_PACKAGE = __name__.rpartition(".")[0]


def agent_folders(files: list) -> list[str]:
    """The folders that hold the agent's own code: the working directory, the first entry of ``sys.path`` (the
    script's folder, or the working directory) and the folder of each of the agent's ``files``."""
    cwd = os.getcwd()
    return [cwd, sys.path[0] or cwd, *(os.path.dirname(os.path.abspath(p)) for p in files if p)]


def own_files(extra: list) -> dict[str, tuple[int, int]]:
    """The agent's own source files (its module or script, and every module imported from outside the
    interpreter's installation), with their modification time and size: a changed one makes the template stale."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}
    paths = {p for p in extra if p}
    for name, module in list(sys.modules.items()):
        if name == _PACKAGE or name.startswith(_PACKAGE + "."):
            continue  # the template's own modules (what aglverl's runner loaded it from), not the agent's
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        real = os.path.realpath(path)
        if (
            "site-packages" in real
            or "dist-packages" in real
            or any(real.startswith(r + os.sep) for r in roots)
        ):
            continue
        paths.add(path)
    stamps = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        stamps[path] = (st.st_mtime_ns, st.st_size)
    return stamps


#: The agent's own files as the template imported them (its forks check them too: a spare, before its attempt).
STAMPS: dict[str, tuple[int, int]] = {}


def changed(stamps: dict[str, tuple[int, int]]) -> str | None:
    """The first of ``stamps``' files that is gone or changed (another modification time or size), else ``None``."""
    for path, stamp in stamps.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != stamp:
            return path
    return None


#: The modules the template has imported: what an agent imports beyond them is reported, for the template to
