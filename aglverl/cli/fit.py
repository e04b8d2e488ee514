"""``aglverl fit SCRIPT [ARGS...]``: an Agent Lightning 0.2/0.3 program, unchanged, trained by aglverl.

The script runs as ``python SCRIPT ARGS...`` would run it (``__name__ == "__main__"``, ``sys.argv``, its
directory first on ``sys.path``), in this process, after :func:`redirect_verl` made every name under which
programs reach ``agl.VERL`` resolve to :class:`aglverl.agent_lightning.VERL`: ``agentlightning.VERL`` (``agl.VERL``),
``agentlightning.algorithm.VERL``, and the modules ``agentlightning.algorithm.verl`` and
``agentlightning.algorithm.verl.interface`` (``from agentlightning.algorithm.verl import VERL``; Agent
Lightning's own module imports verl APIs that verl 0.9.1 no longer has, so it is never imported). The file is
not edited.
"""

from __future__ import annotations

import os
import runpy
import sys
import types
from collections.abc import Sequence

__all__ = ["redirect_verl", "run_script"]

#: The modules a program may import ``VERL`` from, besides the package itself.
VERL_MODULES = ("agentlightning.algorithm.verl", "agentlightning.algorithm.verl.interface")


def redirect_verl() -> type:
    """Make ``agl.VERL`` and its import paths resolve to aglverl's ``VERL``; returns that class. Raises
    ``ModuleNotFoundError`` (with what to install) when agentlightning is not installed."""
    try:
        import agentlightning
        import agentlightning.algorithm as algorithm_package
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"aglverl fit runs Agent Lightning 0.2/0.3 programs, and agentlightning cannot be imported here "
            f"({exc}); `make venv-agl03` builds .venv-agl03 with it: run .venv-agl03/bin/aglverl fit ..."
        ) from exc
    from ..agl03.verl import VERL

    agentlightning.VERL = VERL
    algorithm_package.VERL = VERL
    parent = algorithm_package
    for name in VERL_MODULES:
        module = types.ModuleType(
            name, f"aglverl's stand-in for {name}: VERL is aglverl.agent_lightning.VERL"
        )
        module.VERL = VERL  # type: ignore[attr-defined]
        module.__all__ = ["VERL"]  # type: ignore[attr-defined]
        sys.modules[name] = module
        setattr(parent, name.rsplit(".", 1)[1], module)
        parent = module
    return VERL


def run_script(script: str, args: Sequence[str]) -> None:
    """Run ``script`` as ``__main__`` with ``args`` after :func:`redirect_verl`; ``SystemExit`` from the script
    passes through (its exit code is the command's)."""
    if not os.path.isfile(script):
        raise FileNotFoundError(f"aglverl fit: no such script {script!r}")
    redirect_verl()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
