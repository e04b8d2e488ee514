"""Agent Lightning v1.0's wire shapes: the JSON its controllers, agents and trainers send and read.

Field for field what ``agentlightning==1.0.2`` sends and accepts (its ``schemas.py`` and the route modules'
response models), written here so that aglverl serves them without importing Agent Lightning (which needs
Python >= 3.12). The ``agl`` test tier validates every answer of aglverl's routes with Agent Lightning's own
pydantic models. Inbound bodies are parsed as leniently as Agent Lightning parses them (unknown fields are
ignored, but for the status patch, which forbids them), so a client it accepts is accepted here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_ATTEMPT_ID",
    "TERMINAL_STATES",
    "VALID_TRANSITIONS",
    "AglRollout",
    "Event",
    "EventCreate",
    "LifecycleStatus",
    "Model",
    "PauseRequest",
    "PauseState",
    "RolloutConfig",
    "RolloutCreate",
    "RolloutDetail",
    "RolloutK8sConfig",
    "RolloutLocalConfig",
    "RolloutMetadata",
    "RolloutPatch",
    "RolloutState",
    "StatusPatch",
    "TerminalItem",
    "TerminalPage",
]

RolloutState = Literal["queuing", "running", "succeeded", "failed"]

#: The state machine Agent Lightning's store enforces: anything else is a 409, and terminal states are final.
VALID_TRANSITIONS: dict[str, frozenset[str]] = {
    "queuing": frozenset({"running", "failed"}),
    "running": frozenset({"succeeded", "failed"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
}
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed"})

#: The attempt id Agent Lightning's controllers put in every agent's URLs.
DEFAULT_ATTEMPT_ID = "0"


class RolloutLocalConfig(BaseModel):
    """What ``runner_type=local`` runs: ``agent_class`` (``module:Class`` or ``module.Class``) and ``env_map``
    (environment variable -> ``input``, ``input.a.b.0`` or a literal)."""

    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class RolloutK8sConfig(BaseModel):
    """What ``runner_type=k8s`` runs: a Jinja2 template of one Kubernetes Job."""

    job_template: str | None = None


class RolloutConfig(BaseModel):
    """The controller-facing config every rollout carries."""

    timeout_seconds: int = 3600
    local: RolloutLocalConfig | None = None
    k8s: RolloutK8sConfig | None = None


class RolloutMetadata(BaseModel):
    """The algorithm-facing metadata; any key is kept."""

    model_config = ConfigDict(extra="allow")

    batch_idx: int | None = None
    sample_idx_in_batch: int | None = None


class RolloutCreate(BaseModel):
    """One item of ``POST /api/rollouts``; a caller-supplied ``rollout_id`` makes the create idempotent."""

    input: Any
    is_train: bool = True
    config: RolloutConfig | None = None
    metadata: RolloutMetadata | dict[str, Any] | None = None
    rollout_id: str | None = None


class LifecycleStatus(BaseModel):
    """A rollout's status: its state and what its controller recorded; ``version`` counts the changes."""

    state: RolloutState = "queuing"
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None
    version: int = 1
    created_at: float
    updated_at: float


class StatusPatch(BaseModel):
    """The body of a status change; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    state: RolloutState | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


class RolloutPatch(BaseModel):
    """``PATCH /api/rollouts/{id}``: only the nested status may change."""

    status: StatusPatch | None = None


class AglRollout(BaseModel):
    """A rollout as Agent Lightning's API shows it."""

    rollout_id: str
    input: Any
    is_train: bool = True
    config: RolloutConfig
    metadata: RolloutMetadata = Field(default_factory=RolloutMetadata)
    status: LifecycleStatus


class RolloutDetail(BaseModel):
    """``GET /api/rollouts/{id}``: the rollout and the attempt ids that have events, oldest first."""

    rollout: AglRollout
    attempts: list[str]


class TerminalItem(BaseModel):
    """One entry of the terminal cursor: no input or config, only what tells a reader what to fetch."""

    rollout_id: str
    state: RolloutState
    data_id: str
    is_train: bool


class TerminalPage(BaseModel):
    """``GET /api/rollouts/terminal``: entries after the cursor, the next cursor, and how many there are."""

    items: list[TerminalItem]
    next_after: int
    total_terminal: int


class Event(BaseModel):
    """One event of a rollout attempt: ``model_request``, ``reward`` (``{"value": x}``) or any type."""

    event_type: str
    rollout_id: str
    attempt_id: str
    timestamp: float
    data: dict[str, Any]


class EventCreate(BaseModel):
    """``POST /api/rollouts/{id}/attempt/{attempt}/events``."""

    event_type: str
    data: dict[str, Any] = Field(default_factory=dict)


class Model(BaseModel):
    """A model server (``endpoint`` ends with ``/v1``), keyed by ``(model, endpoint)``."""

    model: str
    endpoint: str
    version: int = 0


class PauseRequest(BaseModel):
    """``POST /proxy/pause``."""

    retry_after_seconds: int = 5
    reason: str | None = None


class PauseState(BaseModel):
    """The answer of ``/proxy/pause``, ``/proxy/resume`` and ``/proxy/state``."""

    paused: bool
    retry_after_seconds: int
    reason: str | None
    inflight: int
