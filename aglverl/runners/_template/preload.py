"""What a Python template learns from its forks: each fork reports the modules its agent imported that the
template had not (:func:`report_imports`), and the template imports them before the next forks
(:func:`preload`: an SDK's lazy imports at its first call are then paid once). Stdlib only."""

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


def preload(names: list[str]) -> tuple[int, str | None]:
    """Import what earlier forks imported; stop at the first import that leaves a thread running."""
    count = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            count += 1
        except BaseException:  # it imported in the agent's process; here it may not (its environment)
            pass
        if threads() > 1:
            return count, name
    KNOWN.update(sys.modules)
    return count, None
