"""What a Python template prepares once for every attempt of its agent: the agent's module or script imported,
with what it imports at its top level (and what the agent class's body imports), and the agent's own files,
whose change makes the template stale. Stdlib only (``ast``, ``runpy`` and ``importlib.util`` only for a Python
agent: a bare template, the spawner's, never imports them)."""

from __future__ import annotations

import builtins
import os
import sys


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

    from .sources import preimport, source_of

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
        preimport(source_of(module), skip=module, agent_class=name)
        files = [getattr(sys.modules[module], "__file__", None)]
        return (lambda argv: _run_class(cls)), files
    if kind == "script":
        (path,) = spec
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        with open(path, encoding="utf-8", errors="replace") as f:
            preimport(f.read())
        return (lambda argv: runpy.run_path(path, run_name="__main__")), [path]
    if kind == "module":
        (name,) = spec
        sys.path[0] = os.getcwd()
        package = name.rpartition(".")[0]
        if package:
            importlib.import_module(package)
        source = source_of(name)
        if source is None:
            raise ImportError(f"No module named {name!r} (or it has no source to run)")
        preimport(source, skip=name)
        found = importlib.util.find_spec(name)
        return (lambda argv: runpy.run_module(name, run_name="__main__", alter_sys=True)), [
            found and found.origin
        ]
    if kind == "code":
        (code,) = spec
        preimport(code)
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
