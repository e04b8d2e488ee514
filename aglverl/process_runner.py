"""Moved to :mod:`aglverl.runners` (the built-in runner and its launchers); these names stay importable here."""

from __future__ import annotations

from .runners import AGENT_CLASS_SHIM, ProcessOptions, ProcessRunner, resolve_env_map

__all__ = ["AGENT_CLASS_SHIM", "ProcessOptions", "ProcessRunner", "resolve_env_map"]
