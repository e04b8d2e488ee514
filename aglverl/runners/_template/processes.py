"""The process tree as the template and its supervisors see it: child subreapers, threads, each process's
children from ``/proc``. Stdlib only."""

from __future__ import annotations

import os

_PR_SET_CHILD_SUBREAPER = 36
_LIBC: list = []  # the C library, loaded once (by the template; its forks find it loaded)


def subreaper() -> bool:
    """Make this process a child subreaper (Linux 3.4+); False where the platform has no such thing."""
    try:
        if not _LIBC:
            import ctypes

            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        return int(_LIBC[0].prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def threads() -> int:
    """Threads in this process (the kernel's count: C libraries' threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def table() -> dict[int, tuple[bytes, int, int, int]]:
    """Each process's state (``b"R"``, ``b"T"``, ``b"Z"``...), parent, process group and session, from
    ``/proc/<pid>/stat``."""
    found: dict[int, tuple[bytes, int, int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 3:
            found[int(entry)] = (fields[0], int(fields[1]), int(fields[2]), int(fields[3]))
    return found


def children() -> dict[int, list[int]]:
    """Each process's children, from /proc's parent links (the kernel here may not list them per process)."""
    found: dict[int, list[int]] = {}
    for pid, (_, parent, _, _) in table().items():
        found.setdefault(parent, []).append(pid)
    return found


def descendants(root: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """Every process below ``root`` (in ``tree``, :func:`children`'s, read now if not given)."""
    if tree is None:
        tree = children()
    out: list[int] = []
    todo = [root]
    while todo:
        for child in tree.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out
