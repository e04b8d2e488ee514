"""``aglverl fit [--rollout embedded] SCRIPT [ARGS...]``: an Agent Lightning 0.2/0.3 program, unchanged, trained by
aglverl.

The script runs as ``python SCRIPT ARGS...`` would run it (``__name__ == "__main__"``, ``sys.argv``, its
directory first on ``sys.path``), in this process, after :func:`redirect_verl` made every name under which
programs reach ``agl.VERL`` resolve to :class:`aglverl.agent_lightning.VERL`: ``agentlightning.VERL`` (``agl.VERL``),
``agentlightning.algorithm.VERL``, and the modules ``agentlightning.algorithm.verl`` and
``agentlightning.algorithm.verl.interface`` (``from agentlightning.algorithm.verl import VERL``; Agent
Lightning's own module imports verl APIs that verl 0.9.1 no longer has, so it is never imported). The file is
not edited.

What ``aglverl fit`` itself refuses, before the program runs, is a :class:`FitError` (the script does not exist,
agentlightning is not installed): the command prints it and exits 2. Everything the program raises is the
program's, and surfaces as it would under ``python SCRIPT``: its traceback, exit code 1 (``SystemExit``: its
own code).

litellm, which ``import agentlightning`` imports, downloads its model price list at import unless
``LITELLM_LOCAL_MODEL_COST_MAP`` is set (three tries with backoff, ~6 s, where the network cannot reach it):
``aglverl fit`` sets it (unless the environment does) so that litellm reads the list it ships; training uses no
prices.

``rollout="embedded"`` (``--rollout embedded``) trains every ``VERL`` the program constructs with aglverl's
embedded engine in place of the engine its config names (``actor_rollout_ref.rollout.name: vllm`` on a
machine without vLLM: a cluster program tried unchanged on a laptop); each construction logs a line saying so.
"""

from __future__ import annotations

import os
import runpy
import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..agl03.verl import VERL

__all__ = ["ROLLOUTS", "FitError", "redirect_verl", "run_script"]

#: The modules a program may import ``VERL`` from, besides the package itself.
VERL_MODULES = ("agentlightning.algorithm.verl", "agentlightning.algorithm.verl.interface")
#: litellm's switch to its bundled price list (see the module docstring).
LITELLM_LOCAL_PRICES = "LITELLM_LOCAL_MODEL_COST_MAP"
#: ``--rollout`` choices: what each puts in place of the program's ``actor_rollout_ref.rollout.name``.
ROLLOUTS = {"embedded": "aglverl"}


class FitError(Exception):
    """What ``aglverl fit`` refuses before the program runs (the program's own errors are never one)."""


def redirect_verl() -> type[VERL]:
    """Make ``agl.VERL`` and its import paths resolve to aglverl's ``VERL``; returns that class. Raises
    :class:`FitError` (with what to install) when agentlightning is not installed."""
    os.environ.setdefault(LITELLM_LOCAL_PRICES, "True")
    try:
        import agentlightning
        import agentlightning.algorithm as algorithm_package
    except ModuleNotFoundError as exc:
        raise FitError(
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


def run_script(script: str, args: Sequence[str], *, rollout: str | None = None) -> None:
    """Run ``script`` as ``__main__`` with ``args`` after :func:`redirect_verl`; ``rollout``: a :data:`ROLLOUTS`
    key, the engine every ``VERL`` the script constructs trains with (for the script's run only). Raises
    :class:`FitError` when the script is not a file or agentlightning is missing (nothing of the script has run
    then); whatever the script raises, ``SystemExit`` included, passes through unchanged."""
    if not os.path.isfile(script):
        raise FitError(f"no such script {script!r}")
    verl = redirect_verl()
    argv, path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    verl.rollout_override = ROLLOUTS[rollout] if rollout is not None else None
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # as they were, for a caller in the same process (a test)
        verl.rollout_override = None
        sys.argv, sys.path[:] = argv, path
