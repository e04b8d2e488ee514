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
    from .batch import BatchConfig, FinishedRollout, MissingRewardError, build_batch
    from .collector import RolloutCollector, Step, StepReport, TrainingBatch
    from .daemon import AgentDaemon
    from .inference import InferenceServer, InferenceServerThread, InferenceStats
    from .proxy import LLMProxy, RetryPolicy
    from .server import TaskServer
    from .signals import SignalConfig, compute_advantage, logprob_mismatch
    from .store import LLMCall, TaskStore
    from .tiny import resolve_model, tiny_model_path

_LAZY = {
    "AsyncVERL": "algorithm",
    "AgentDaemon": "daemon",
    "BatchConfig": "batch",
    "FinishedRollout": "batch",
    "MissingRewardError": "batch",
    "build_batch": "batch",
    "RolloutCollector": "collector",
    "Step": "collector",
    "StepReport": "collector",
    "TrainingBatch": "collector",
    "LLMProxy": "proxy",
    "RetryPolicy": "proxy",
    "TaskServer": "server",
    "SignalConfig": "signals",
    "compute_advantage": "signals",
    "logprob_mismatch": "signals",
    "LLMCall": "store",
    "TaskStore": "store",
    "InferenceServer": "inference",
    "InferenceServerThread": "inference",
    "InferenceStats": "inference",
    "resolve_model": "tiny",
    "tiny_model_path": "tiny",
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

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aglverl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
