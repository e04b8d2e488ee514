"""Wire models: what agents, the task server and the trainer exchange.

Field-for-field compatible with Agent Lightning 0.1 clients (``Task``, ``TaskIfAny``, ``Rollout``, ``Triplet``,
``LLM``, ``PromptTemplate``, ``ResourcesUpdate``, ``GenericResponse``); the fields aglverl adds are optional, so
old clients ignore them when reading and omit them when writing.

Inbound models (what agents post) reject unknown fields and non-finite numbers: a typo in a field name is an
error that names the field, never silently dropped data. A reward must be finite as float32 (:func:`check_reward`):
training rows keep rewards as float32, where 1e39 is infinity.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import orjson
from annotated_types import Ge, Lt
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator

__all__ = [
    "DECLARABLE_TERMINATIONS",
    "INSTANCE_HEADER",
    "LLM",
    "TERMINATION_KEY",
    "TERMINATION_REASONS",
    "TRAINED_CALLS_KEY",
    "GenericResponse",
    "NamedResources",
    "PromptTemplate",
    "ProxyLLM",
    "Resource",
    "ResourcesUpdate",
    "Rollout",
    "Task",
    "TaskIfAny",
    "TerminationReason",
    "TokenIds",
    "Triplet",
    "check_reward",
    "checked_token_ids",
    "dumps",
]

#: Header on every task server answer naming the server instance (a new id at every start): a client that
#: sees it change knows a restarted daemon may have rebound the resources it cached to its new proxy.
INSTANCE_HEADER = "X-Aglverl-Instance"

Mode = Literal["train", "val", "test"]

#: Why a rollout ended, when it did not simply finish. Each is decided where it happens: the store decides
#: ``agent_error`` (the agent reported failure on its last attempt), ``lease_expired`` (its last attempt's lease
#: ran out) and ``step_timeout`` (the step's deadline passed first); the proxy decides ``context_exceeded`` (the
#: backend refused the prompt as too long, or stopped at its context limit) and, with the batch builder,
#: ``truncated`` (a response was cut: at the request's ``max_tokens``, or at ``max_response_length``); the agent
#: declares ``max_turns`` (and may declare any reason it knows of) under :data:`TERMINATION_KEY`.
TerminationReason = Literal[
    "agent_error", "step_timeout", "lease_expired", "truncated", "max_turns", "context_exceeded"
]
TERMINATION_REASONS: tuple[TerminationReason, ...] = (
    "agent_error",
    "step_timeout",
    "lease_expired",
    "truncated",
    "max_turns",
    "context_exceeded",
)
#: The ``Rollout.metadata`` key under which an agent says why its rollout ended (Agent Lightning 0.1 clients
#: can set it: ``metadata`` is a free dict there too).
TERMINATION_KEY = "termination_reason"
#: What an agent may declare there: ``"finished"`` (a normal end, the same as saying nothing) or a reason the
#: agent itself knows of. ``step_timeout`` and ``lease_expired`` are the store's to decide, never an agent's.
DECLARABLE_TERMINATIONS: frozenset[str] = frozenset(
    {"finished", "agent_error", "truncated", "max_turns", "context_exceeded"}
)
#: The ``Rollout.metadata`` key under which a result names the calls of its attempt that train: a list of the
#: answers' ids (each recorded call's ``response_id``). The attempt's other calls stay recorded and counted but
#: train no row. Absent: every call trains. Agent Lightning 0.2/0.3's ``agent_match`` (aglverl.agl03) sets it.
TRAINED_CALLS_KEY = "trained_response_ids"


def dumps(obj: Any) -> bytes:
    """Serialise a model (or plain data) to JSON bytes with orjson.

    Task inputs often come from parquet data sets as numpy arrays and scalars; orjson writes those natively,
    so a model is dumped in Python mode and handed to orjson as is.
    """
    if isinstance(obj, BaseModel):
        obj = obj.model_dump()
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class _Inbound(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Outbound(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


#: Token ids are int64 in every tensor they end up in.
TOKEN_ID_BOUND = 2**63
TokenId = Annotated[int, Strict(), Ge(0), Lt(TOKEN_ID_BOUND)]


def checked_token_ids(value: Any, vocab_size: int | None = None) -> list[int] | None:
    """``value`` if it is a list of token ids (ints in ``[0, vocab_size)``, int64 when unknown), else ``None``.

    For ids that arrive from backends: one C-level pass over the types and a min/max, no per-id Python code.
    """
    if type(value) is not list:
        return None
    if not value:
        return value
    if not set(map(type, value)) <= {int}:  # bool, float, str and nested lists are not token ids
        return None
    bound = TOKEN_ID_BOUND if vocab_size is None else min(vocab_size, TOKEN_ID_BOUND)
    return value if min(value) >= 0 and max(value) < bound else None


#: The largest float32 (training rows keep rewards as float32).
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest magnitude float32 rounds to infinity: halfway between its largest value and 2**128 (the tie goes
#: to the even neighbour, which is infinity).
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def check_reward(value: float, what: str = "the reward") -> float:
    """``value`` when it is a reward training can use: finite as float32, the type rows keep rewards in (1e39 or
    ``exp(100)`` is finite as a Python float and infinity there, and one infinite score ends a GRPO step).
    Otherwise a ``ValueError`` naming ``what`` and the value."""
    if math.isfinite(value) and abs(value) < _FLOAT32_OVERFLOW:
        return value
    raise ValueError(
        f"{what} {value!r}: not a finite float32 number (training rows keep rewards as float32, whose largest "
        f"value is {FLOAT32_MAX:.8g})"
    )


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a reward must be a number, not a boolean")
    return value


def _float32(value: float) -> float:
    return check_reward(value)


#: A number finite as float32 (:func:`check_reward`); JSON ``true``/``false`` are refused rather than read as
#: 1.0/0.0.
Reward = Annotated[float, BeforeValidator(_not_bool), AfterValidator(_float32)]


class TokenIds(BaseModel):
    """One side of a triplet: ``{"token_ids": [...], ...}``; keys other than ``token_ids`` are kept as they are."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    token_ids: list[TokenId]


class Triplet(_Inbound):
    """One LLM call of a rollout: the exact prompt and response token ids, optionally a per-call reward."""

    prompt: TokenIds
    response: TokenIds
    reward: Reward | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class Task(_Outbound):
    """A rollout request handed to an agent. ``attempt_id`` is aglverl's addition (old clients ignore it)."""

    rollout_id: str
    input: Any = None
    mode: Mode | None = None
    resources_id: str | None = None
    create_time: float | None = None
    last_claim_time: float | None = None
    num_claims: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    attempt_id: str | None = None


class TaskIfAny(_Outbound):
    is_available: bool
    task: Task | None = None


class Rollout(_Inbound):
    """What an agent reports for a task.

    ``attempt_id`` (optional) names the attempt the result belongs to; without it the result is attributed to
    ``task.attempt_id`` if the task is echoed, else to the rollout's current attempt. ``status="failed"``
    reports that the agent could not finish (the error goes in ``metadata["error"]``): the task is retried
    with a new attempt while attempts remain. ``metadata["termination_reason"]`` (optional) says why a
    delivered result ended, e.g. ``"max_turns"`` (see :data:`DECLARABLE_TERMINATIONS`); any other value is
    refused (422) naming the key. ``metadata["trained_response_ids"]`` (optional, :data:`TRAINED_CALLS_KEY`): the
    ids of the answers whose calls train; the attempt's other recorded calls are counted, not trained.
    """

    rollout_id: str
    task: Task | None = None
    final_reward: Reward | None = None
    triplets: list[Triplet] | None = None
    trace: list[dict[str, Any]] | None = None
    logs: list[str] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    attempt_id: str | None = None
    status: Literal["succeeded", "failed"] = "succeeded"

    @field_validator("metadata")
    @classmethod
    def _known_termination(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        declared = metadata.get(TERMINATION_KEY)
        if declared is not None and declared not in DECLARABLE_TERMINATIONS:
            allowed = ", ".join(sorted(DECLARABLE_TERMINATIONS))
            raise ValueError(f"metadata[{TERMINATION_KEY!r}] must be one of {allowed}; got {declared!r}")
        trained = metadata.get(TRAINED_CALLS_KEY)
        if trained is not None and not (
            isinstance(trained, list) and all(isinstance(i, str) for i in trained)
        ):
            raise ValueError(f"metadata[{TRAINED_CALLS_KEY!r}] must be a list of response ids (strings)")
        return metadata

    @property
    def trained_calls(self) -> frozenset[str] | None:
        """The response ids of the calls that train (``metadata[TRAINED_CALLS_KEY]``); ``None``: every call."""
        trained = self.metadata.get(TRAINED_CALLS_KEY)
        return None if trained is None else frozenset(trained)

    @property
    def declared_termination(self) -> TerminationReason | None:
        """The reason the agent gave in ``metadata["termination_reason"]``; ``None`` for none or ``"finished"``."""
        declared = self.metadata.get(TERMINATION_KEY)
        return None if declared in (None, "finished") else declared

    @property
    def effective_attempt_id(self) -> str | None:
        if self.attempt_id is not None:
            return self.attempt_id
        return self.task.attempt_id if self.task is not None else None


class Resource(_Outbound):
    resource_type: Any


class LLM(Resource):
    """An OpenAI-compatible endpoint (base URL ending in ``/v1``) and the model name to ask it for."""

    resource_type: Literal["llm"] = "llm"
    endpoint: str
    model: str
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)

    def get_base_url(self, rollout_id: str | None = None, attempt_id: str | None = None) -> str:
        return self.endpoint


class ProxyLLM(LLM):
    """An LLM reached through aglverl's proxy: ``endpoint`` is a template with ``{rollout_id}`` and ``{attempt_id}``.

    Calls made through :meth:`get_base_url` are attributed to that rollout attempt, so the proxy can record
    their exact token ids.
    """

    resource_type: Literal["proxy_llm"] = "proxy_llm"  # type: ignore[assignment]

    def get_base_url(self, rollout_id: str | None = None, attempt_id: str | None = None) -> str:
        if rollout_id is None or attempt_id is None:
            raise ValueError("ProxyLLM.get_base_url needs both rollout_id and attempt_id")
        return self.endpoint.replace("{rollout_id}", rollout_id).replace("{attempt_id}", attempt_id)

    def resolve(self, rollout_id: str, attempt_id: str) -> LLM:
        """The plain :class:`LLM` an agent uses for this rollout attempt."""
        return LLM(
            endpoint=self.get_base_url(rollout_id, attempt_id),
            model=self.model,
            sampling_parameters=dict(self.sampling_parameters),
        )


class PromptTemplate(Resource):
    resource_type: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["jinja", "f-string", "poml"]


ResourceUnion = Annotated[LLM | ProxyLLM | PromptTemplate, Field(discriminator="resource_type")]
NamedResources = dict[str, ResourceUnion]


class ResourcesUpdate(_Outbound):
    resources_id: str
    resources: NamedResources


class GenericResponse(_Outbound):
    status: str = "ok"
    message: str | None = None
    data: dict[str, Any] | None = None
