"""The events of Agent Lightning's rollouts: those agents post as they are kept (:class:`PostedEvent`) and the
bounds on them (:class:`EventBudget`), what a ``reward`` event's value must be (:func:`reward_value`,
:func:`reward_problem`), and the events made from what aglverl recorded (:func:`model_request_events`) and their
``format=triplet`` trim (:func:`triplet_events`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..models import check_reward
from ..store import LLMCall
from .errors import TooMany
from .wire import Event

__all__ = [
    "MAX_EVENTS_PER_ROLLOUT",
    "MAX_EVENT_BYTES",
    "MAX_EVENT_BYTES_PER_ROLLOUT",
    "EventBudget",
    "PostedEvent",
    "RolloutEvents",
    "model_request_events",
    "reward_problem",
    "reward_value",
    "triplet_events",
]

#: Events one rollout keeps (posted ones, all attempt labels together); a post past it is refused.
MAX_EVENTS_PER_ROLLOUT = 10_000
#: Bytes (their data as JSON) of the events one rollout keeps: an agent's traces, not a place for data sets.
MAX_EVENT_BYTES_PER_ROLLOUT = 16 * 2**20
#: Bytes (their data as JSON) of the events all rollouts keep together: kept as those bytes, about what they take
#: in memory, which a 24 GiB machine with a trainer on it can spare.
MAX_EVENT_BYTES = 512 * 2**20


@dataclass(slots=True, frozen=True)
class PostedEvent:
    """An event an agent posted, as a rollout keeps it: its data as JSON bytes, parsed again when read (parsed,
    data of many small keys takes ten times or more its bytes in memory)."""

    event_type: str
    timestamp: float
    data: bytes

    @property
    def size(self) -> int:
        """What it counts against the bounds: the bytes of its data."""
        return len(self.data)

    def parsed(self) -> dict[str, Any]:
        return orjson.loads(self.data)

    def wire(self, agl_id: str, label: str) -> Event:
        """As Agent Lightning's API shows it."""
        return Event(
            event_type=self.event_type,
            rollout_id=agl_id,
            attempt_id=label,
            timestamp=self.timestamp,
            data=self.parsed(),
        )


class RolloutEvents:
    """The events agents posted to one rollout, by attempt label, and their count and bytes (all labels together
    count against the bounds)."""

    __slots__ = ("by_label", "count", "size")

    def __init__(self) -> None:
        self.by_label: dict[str, list[PostedEvent]] = {}
        self.count = 0
        self.size = 0

    def of(self, label: str) -> list[PostedEvent]:
        """Those posted under ``label``, oldest first."""
        return self.by_label.get(label, [])


class EventBudget:
    """The bounds on the events agents post: per rollout a count (``per_rollout``) and bytes (``bytes_per_rollout``),
    and bytes over all rollouts held (``bytes_total``). Bytes are those of each event's data as JSON
    (:attr:`PostedEvent.size`): what the event takes in memory, and about what it took to post."""

    def __init__(self, *, per_rollout: int, bytes_per_rollout: int, bytes_total: int) -> None:
        self.per_rollout = per_rollout
        self.bytes_per_rollout = bytes_per_rollout
        self.bytes_total = bytes_total
        #: Bytes of the posted events held now.
        self.held = 0

    def add(self, events: RolloutEvents, label: str, event: PostedEvent, *, where: str) -> None:
        """Keep ``event`` among ``events`` (those of the rollout ``where`` names) under ``label``; past a bound,
        :class:`TooMany` (413) naming it, and nothing is kept or counted."""
        size = event.size
        if events.count >= self.per_rollout:
            raise TooMany(
                f"{where} already has {events.count:,} events, the most one rollout keeps "
                f"({self.per_rollout:,}); this one was not stored"
            )
        if events.size + size > self.bytes_per_rollout:
            raise TooMany(
                f"{where}'s events would take {events.size + size:,} bytes, past the {self.bytes_per_rollout:,} "
                f"bytes one rollout keeps (max_event_bytes_per_rollout); this one ({size:,} bytes) was not stored"
            )
        if self.held + size > self.bytes_total:
            raise TooMany(
                f"the events of all rollouts would take {self.held + size:,} bytes, past the {self.bytes_total:,} "
                f"bytes the daemon keeps (max_event_bytes); this one ({size:,} bytes, {where}) was not stored"
            )
        events.by_label.setdefault(label, []).append(event)
        events.count += 1
        events.size += size
        self.held += size

    def release(self, events: RolloutEvents) -> None:
        """The rollout's events are gone (it was forgotten)."""
        self.held -= events.size
        events.size = 0


def _number(value: Any) -> float | None:
    """A JSON number as a float (an integer too large for one is infinite), ``None`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def reward_problem(data: Mapping[str, Any]) -> str | None:
    """What is wrong with a ``reward`` event's value when it is a number training cannot use (not finite as
    float32: training rows keep rewards as float32), naming it; ``None`` otherwise (a value that is no number at
    all is kept and ignored, as Agent Lightning ignores it)."""
    value = _number(data.get("value"))
    if value is None:
        return None
    try:
        check_reward(value, "the reward event's value")
    except ValueError as exc:
        return str(exc)
    return None


def reward_value(data: Mapping[str, Any]) -> float | None:
    """The reward a ``reward`` event's data carries: a number finite as float32 (not a boolean), else ``None``."""
    value = _number(data.get("value"))
    try:
        return None if value is None else check_reward(value)
    except ValueError:
        return None


def model_request_events(agl_id: str, label: str, calls: Sequence[LLMCall]) -> list[Event]:
    """One ``model_request`` event per LLM call aglverl's proxy recorded (its choices together), shaped as Agent
    Lightning's gateway records them: ``response`` carries ``prompt_token_ids`` and each choice's ``token_ids``,
    ``finish_reason`` and ``logprobs.content``. ``request`` has the call's path and sampling parameters: aglverl
    records token ids, not request bodies."""
    by_call: dict[int, list[LLMCall]] = {}
    for call in calls:
        by_call.setdefault(call.seq, []).append(call)
    events = []
    for choices in by_call.values():
        first = choices[0]
        ok = first.status == "ok"
        response: dict[str, Any] = {
            "prompt_token_ids": first.prompt_token_ids or [],
            "choices": [
                {
                    "index": c.choice_index,
                    "token_ids": c.response_token_ids or [],
                    "finish_reason": c.finish_reason,
                    "logprobs": {"content": [{"logprob": x} for x in c.logprobs]}
                    if c.logprobs is not None
                    else None,
                }
                for c in choices
            ],
        }
        if not ok:
            response["error"] = {"message": first.error}
        prompt, completion = (
            len(first.prompt_token_ids or ()),
            sum(len(c.response_token_ids or ()) for c in choices),
        )
        data = {
            "model": first.model,
            "model_version": first.weight_version,
            "request": {"path": first.path, **(first.sampling or {})},
            "response": response,
            "server": {"model": first.model, "endpoint": first.backend, "version": first.weight_version},
            "latency_ms": first.latency * 1000.0,
            "http_status": 200 if ok else None,
            "status": "ok" if ok else "error",
            "retry_count": 0,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
            "finish_reason": first.finish_reason,
        }
        stamp = first.started_at + first.latency
        events.append(
            Event(event_type="model_request", rollout_id=agl_id, attempt_id=label, timestamp=stamp, data=data)
        )
    return events


def triplet_events(events: Sequence[Event]) -> list[Event]:
    """``format=triplet``: a ``model_request`` keeps its prompt and response ids, the response's log-probs and
    the server; a ``reward`` its value (and ``source`` / ``reason``); other events pass as they are. Of
    ``model_request`` events with the same prompt ids only the last is kept."""
    trimmed = []
    for event in events:
        if event.event_type == "model_request":
            trimmed.append(event.model_copy(update={"data": _trim_request(event.data)}))
        elif event.event_type == "reward":
            extra = {k: event.data[k] for k in ("source", "reason") if k in event.data}
            trimmed.append(event.model_copy(update={"data": {"value": event.data.get("value"), **extra}}))
        else:
            trimmed.append(event)
    last: dict[tuple[int, ...], int] = {}
    keep = set()
    for i, event in enumerate(trimmed):
        if event.event_type != "model_request":
            continue
        prompt = event.data.get("prompt_token_ids")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            last[tuple(prompt)] = i
        else:
            keep.add(i)
    keep.update(last.values())
    return [e for i, e in enumerate(trimmed) if e.event_type != "model_request" or i in keep]


def _trim_request(data: Mapping[str, Any]) -> dict[str, Any]:
    response = data.get("response")
    prompt: list[int] = []
    ids: list[int] = []
    logprobs: list[float] | None = None
    if isinstance(response, Mapping):
        prompt = list(response.get("prompt_token_ids") or [])
        choices = response.get("choices") or []
        if choices and isinstance(choices[0], Mapping):
            ids = list(choices[0].get("token_ids") or [])
            content = (choices[0].get("logprobs") or {}).get("content")
            if isinstance(content, list):
                values = [item.get("logprob") for item in content if isinstance(item, Mapping)]
                numbers = [
                    float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
                ]
                good = len(numbers) == len(content) and all(math.isfinite(v) for v in numbers)
                logprobs = numbers if good else None
    server = data.get("server") or {}
    out: dict[str, Any] = {
        "prompt_token_ids": prompt,
        "response_token_ids": ids,
        "response_log_probs": logprobs,
        "server": {"model": server.get("model"), "version": server.get("version")},
    }
    for key in ("http_status", "status"):
        if key in data:
            out[key] = data[key]
    if isinstance(response, Mapping) and "error" in response:
        out["error"] = response["error"]
    return out
