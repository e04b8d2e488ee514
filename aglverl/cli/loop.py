"""The event loop aglverl's own programs run on: uvloop where it is installed (uvicorn's ``standard`` extra
installs it), else asyncio's; ``AGLVERL_LOOP=asyncio`` (or the command's ``--loop asyncio``) turns it off.

For the commands (``aglverl serve``, ``serve-model``, ``demo``) and the benchmarks, which own their process. An
application that embeds the daemon keeps its own loop (``async with AgentDaemon(...)``): it chooses uvloop with
``anyio.run(main, backend_options={"use_uvloop": True})`` or ``uvloop.run(main())`` (see the README). Proxy
shards run on the loop of their Ray worker: uvloop where Ray finds it, unless ``RAY_USE_UVLOOP=0`` (Ray's own
switch; a local Ray started by the run passes the driver's environment to its workers).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio

__all__ = ["LOOPS", "LOOP_ENV", "loop_name", "run"]

#: The environment variable that chooses the loop: ``auto`` (default), ``uvloop`` or ``asyncio``.
LOOP_ENV = "AGLVERL_LOOP"
LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_name(choice: str | None = None) -> Literal["uvloop", "asyncio"]:
    """The loop ``choice`` (else ``$AGLVERL_LOOP``, else ``auto``) stands for: ``auto`` is uvloop when it is
    installed. ``ValueError`` for another value, or for ``uvloop`` when it is not installed."""
    choice = choice or os.environ.get(LOOP_ENV) or "auto"
    if choice not in LOOPS:
        raise ValueError(f"{LOOP_ENV} / --loop must be one of {', '.join(LOOPS)}, got {choice!r}")
    installed = importlib.util.find_spec("uvloop") is not None
    if choice == "uvloop" and not installed:
        raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop)")
    return "uvloop" if choice == "uvloop" or (choice == "auto" and installed) else "asyncio"


def run(func: Callable[..., Awaitable[T]], *args: Any, loop: str | None = None) -> T:
    """``anyio.run(func, *args)`` on the loop :func:`loop_name` picks."""
    options = {"use_uvloop": True} if loop_name(loop) == "uvloop" else {}
    return anyio.run(func, *args, backend_options=options)
