"""The front door: the ``aglverl`` command (:mod:`.main`: ``serve``, ``serve-model``, ``demo``, ``fit``; :mod:`.fit`
runs an Agent Lightning 0.2/0.3 program with ``agl.VERL`` resolving to aglverl's), the demo's
task and run (:mod:`.demo`), and the quiet console that the demo and the examples train through
(:mod:`.console`: a progress bar on the screen, metrics and the libraries' output in files).

Importing this package is instant (``aglverl --help``); verl, torch and transformers load with the command
that needs them.
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
