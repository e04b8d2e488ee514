"""aglverl: reinforcement-learning training for LLM agents, on one asyncio event loop.

The public API is re-exported here. Names whose modules import verl or torch (the daemon, collector, batch
builder and inference server; importing verl takes seconds) are loaded on first use, so agent processes that only need the client
and the wire models start instantly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .client import AgentClient, TaskServerError, run_agents
from .models import (
    LLM,
    GenericResponse,
    NamedResources,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    Task,
    TaskIfAny,
    Triplet,
)

if TYPE_CHECKING:
    from .algorithm import AsyncVERL
    from .daemon import AgentDaemon
    from .engine.server import InferenceServer, InferenceStats
    from .engine.thread import InferenceServerThread
    from .engine.tiny import resolve_model, tiny_model_path
    from .proxy import LLMProxy, RetryPolicy
    from .server import TaskServer
    from .store import LLMCall, TaskStore
    from .trajectory.batch import BatchConfig, FinishedRollout, MissingRewardError, build_batch
    from .trajectory.signals import SignalConfig, compute_advantage, logprob_mismatch
    from .trajectory.steps import RolloutCollector, Step, StepReport, TrainingBatch

_LAZY = {
    "AsyncVERL": "algorithm",
    "AgentDaemon": "daemon",
    "BatchConfig": "trajectory.batch",
    "FinishedRollout": "trajectory.batch",
    "MissingRewardError": "trajectory.batch",
    "build_batch": "trajectory.batch",
    "RolloutCollector": "trajectory.steps",
    "Step": "trajectory.steps",
    "StepReport": "trajectory.steps",
    "TrainingBatch": "trajectory.steps",
    "LLMProxy": "proxy",
    "RetryPolicy": "proxy",
    "TaskServer": "server",
    "SignalConfig": "trajectory.signals",
    "compute_advantage": "trajectory.signals",
    "logprob_mismatch": "trajectory.signals",
    "LLMCall": "store",
    "TaskStore": "store",
    "InferenceServer": "engine.server",
    "InferenceServerThread": "engine.thread",
    "InferenceStats": "engine.server",
    "resolve_model": "engine.tiny",
    "tiny_model_path": "engine.tiny",
}

__all__ = [
    "LLM",
    "AgentClient",
    "AgentDaemon",
    "AsyncVERL",
    "BatchConfig",
    "FinishedRollout",
    "GenericResponse",
    "InferenceServer",
    "InferenceServerThread",
    "InferenceStats",
    "LLMCall",
    "LLMProxy",
    "MissingRewardError",
    "NamedResources",
    "PromptTemplate",
    "ProxyLLM",
    "ResourcesUpdate",
    "RetryPolicy",
    "Rollout",
    "RolloutCollector",
    "SignalConfig",
    "Step",
    "StepReport",
    "Task",
    "TaskIfAny",
    "TaskServer",
    "TaskServerError",
    "TaskStore",
    "TrainingBatch",
    "Triplet",
    "build_batch",
    "compute_advantage",
    "logprob_mismatch",
    "resolve_model",
    "run_agents",
    "tiny_model_path",
]

from ._version import __version__ as __version__  # noqa: E402


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aglverl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
