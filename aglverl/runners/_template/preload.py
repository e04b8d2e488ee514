"""What a Python template learns from its forks: each fork reports the modules its agent imported that the
template had not (:func:`report_imports`), and the template imports them before the next forks (:func:`preload`:
an SDK's lazy imports at its first call are then paid once) — the Python installation's modules only
(:class:`Installed`): never one of the agent's own, nor one an attempt wrote, whose code would then run in the
template and in every later attempt (and whose next change would make the template stale). Stdlib only."""

from __future__ import annotations

import importlib
import json
import os
import sys

from .processes import threads

#: The modules the template has imported: what an agent imports beyond them is reported.
KNOWN: set[str] = set()
_REPORT_MAX = 5000


def report_imports(fd: int) -> None:
    """Write the names of the modules this agent imported that the template had not (one JSON list)."""
    names = [
        name
        for name, module in list(sys.modules.items())
        if name not in KNOWN and getattr(module, "__file__", None) and not name.startswith("__main__")
    ]
    data = json.dumps(names[:_REPORT_MAX]).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class Installed:
    """Which files belong to the Python installation: those under its prefixes, site-packages or ``sysconfig``
    paths (the deepest of these folders that holds the file), unless a deeper or equal one of the ``excluded``
    folders holds it (the agent's folder, the working directory: a virtual environment inside a project is
    still the installation), and not changed since ``started_ns`` (``time.time_ns()`` when the template started:
    a module written since, even into site-packages, is an attempt's). Its folders are read at the first use."""

    def __init__(self, excluded: list[str], started_ns: int) -> None:
        self.started_ns = started_ns
        self._excluded = excluded
        self._folders: list[tuple[int, bool, str]] | None = (
            None  # (depth, library?, real path), deepest first
        )

    def _read(self) -> list[tuple[int, bool, str]]:
        import sysconfig

        roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        roots.update(sysconfig.get_paths().values())
        site = sys.modules.get("site")
        if site is not None:
            for get in ("getsitepackages", "getusersitepackages"):
                try:
                    found = getattr(site, get)()
                except Exception:
                    continue
                roots.update([found] if isinstance(found, str) else found)
        folders = [(True, os.path.realpath(p)) for p in roots if p]
        folders += [(False, os.path.realpath(p)) for p in self._excluded if p]
        # deepest first; at equal depth an excluded folder (False) sorts before the installation's
        return sorted(((p.count(os.sep), library, p) for library, p in folders), key=lambda f: (-f[0], f[1]))

    def __contains__(self, path: str) -> bool:
        if self._folders is None:
            self._folders = self._read()
        real = os.path.realpath(path)
        for _, library, folder in self._folders:
            if _under(real, folder):
                if not library:
                    return False
                break
        else:
            return False
        try:
            st = os.stat(real)
        except OSError:
            return False
        return max(st.st_mtime_ns, st.st_ctime_ns) <= self.started_ns


def _foreign(name: str, installed: Installed) -> bool:
    """Whether ``name`` is not the installation's: its package not imported here, no spec, or a file (or, for a
    namespace package, a folder) outside the installation. Built-in and frozen modules are the installation's."""
    import importlib.util

    parent = name.rpartition(".")[0]
    if parent and parent not in sys.modules:
        return True  # not imported here (or left out): finding its child would import it
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        return True
    if spec is None:
        return True
    if spec.has_location and spec.origin:
        return spec.origin not in installed
    if spec.submodule_search_locations is not None:
        return not all(folder in installed for folder in spec.submodule_search_locations)
    return spec.origin not in ("built-in", "frozen")


def preload(names: list[str], installed: Installed) -> tuple[int, str | None, list[str]]:
    """Import what earlier forks imported, the installation's modules only (``names`` sorted: a package before
    its modules); stop at the first import that leaves a thread running. Returns how many were imported, that
    module (or ``None``), and the names left out (not the installation's)."""
    count = 0
    skipped: list[str] = []
    for name in names:
        if name in sys.modules:
            continue
        if _foreign(name, installed):
            skipped.append(name)
            continue
        try:
            importlib.import_module(name)
            count += 1
        except BaseException:  # it imported in the agent's process; here it may not (its environment)
            pass
        if threads() > 1:
            return count, name, skipped
    KNOWN.update(sys.modules)
    return count, None, skipped
