"""The Responses API's stored responses, kept per rollout attempt: bounded, and freed when the attempt ends.

OpenAI keeps every response made with ``store`` left out or true, so that a later call can continue it
(``previous_response_id``) and an agent can read it back (``GET /v1/responses/{id}``). The proxy keeps them per
rollout attempt: an attempt sees only its own responses (an id of another attempt or rollout is unknown there,
as any unknown id is), and the calls of the unattributed ``/v1`` routes share one store of their own.

A :class:`StoredResponse` is what the proxy answered (the response object's JSON, as the agent got it) and the
items it was made from: the response it continued (held by reference, so a conversation of ``n`` calls holds
each item once), then its own input. :class:`ResponseStore` keeps each attempt's responses in the order they
were last used (made, continued or read back) and drops the least recently used one while the attempt holds
more than ``responses_per_attempt`` responses or ``response_bytes_per_attempt`` bytes. A response counts the
bytes of everything it holds, its conversation so far included (:attr:`StoredResponse.size`), so the bound is
a true bound on the memory an attempt holds, counted as JSON. A response larger than the bound alone is not
kept. An id dropped for the bounds, or deleted, is remembered (a few hundred per attempt) so that a later
call naming it learns why it is gone.

An attempt's responses are freed when it can make no more calls (:meth:`ResponseStore.end`: its rollout
finished, or its proxy shard revoked it) and with its rollout (:meth:`ResponseStore.forget`). Pure and
synchronous: no I/O, no clock; it reads the bounds from the :class:`~aglverl.proxy.config.ProxyConfig` it holds
(:class:`Bounds`; the proxy hands it a new one on ``reconfigure``; the new bounds hold from the next response
kept).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["UNATTRIBUTED", "AttemptKey", "Bounds", "ResponseStore", "StoredResponse"]

logger = logging.getLogger(__name__)

#: An attempt's key: ``(rollout_id, attempt_id)``.
AttemptKey = tuple[str | None, str | None]
#: The key of the unattributed ``/v1`` calls' responses.
UNATTRIBUTED: AttemptKey = (None, None)
#: Ids of dropped or deleted responses an attempt remembers (least recent out).
GONE_KEPT = 256


@dataclass(frozen=True, slots=True, eq=False)
class StoredResponse:
    """One stored response: ``id``; ``body``, the response object as the agent got it (JSON); ``input``, the
    items of the call's own input as they are listed (each with an ``id``); ``previous``, the response it
    continued (``None``: none); ``output``, the response's output items (as in ``body``, parsed once: every
    later call of the conversation reads them); ``items_bytes``, the size of ``input`` and ``output`` as JSON."""

    id: str
    body: bytes
    input: tuple[dict[str, Any], ...]
    output: tuple[dict[str, Any], ...]
    previous: StoredResponse | None = None
    items_bytes: int = 0
    #: What the response holds, in bytes of JSON: its body, its items, and all it continued.
    size: int = field(init=False)

    def __post_init__(self) -> None:
        held = self.previous.size if self.previous is not None else 0
        object.__setattr__(self, "size", len(self.body) + self.items_bytes + held)

    def chain(self) -> list[StoredResponse]:
        """The responses of its conversation, oldest first, this one last."""
        chain: list[StoredResponse] = []
        response: StoredResponse | None = self
        while response is not None:
            chain.append(response)
            response = response.previous
        chain.reverse()
        return chain

    def context(self) -> Iterator[dict[str, Any]]:
        """The items it was made from, in order: each earlier response's input and output, then its input."""
        chain = self.chain()
        for earlier in chain[:-1]:
            yield from earlier.input
            yield from earlier.output
        yield from self.input

    def conversation(self) -> Iterator[dict[str, Any]]:
        """Its :meth:`context`, then its output: what a call that continues it comes after."""
        yield from self.context()
        yield from self.output


class Bounds(Protocol):
    """What the store reads of the proxy's :class:`~aglverl.proxy.config.ProxyConfig` (its two bounds)."""

    @property
    def responses_per_attempt(self) -> int: ...

    @property
    def response_bytes_per_attempt(self) -> int: ...


class _Attempt:
    """One attempt's responses (least recently used first), their bytes, and the ids it no longer has."""

    __slots__ = ("bytes", "gone", "responses")

    def __init__(self) -> None:
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.gone: OrderedDict[str, str] = OrderedDict()  # id -> why it is gone

    def drop(self, response_id: str, why: str) -> StoredResponse | None:
        response = self.responses.pop(response_id, None)
        if response is not None:
            self.bytes -= response.size
        self.mark_gone(response_id, why)
        return response

    def mark_gone(self, response_id: str, why: str) -> None:
        self.gone[response_id] = why
        self.gone.move_to_end(response_id)
        if len(self.gone) > GONE_KEPT:
            self.gone.popitem(last=False)


class ResponseStore:
    """Every attempt's stored responses (see the module docstring). Single loop; every method returns at once."""

    def __init__(self, config: Bounds) -> None:
        self.config = config
        self._attempts: dict[str, dict[str | None, _Attempt]] = {}  # rollout (or "") -> attempt -> responses
        self._warned = False

    # ------------------------------------------------------------------ reading
    def get(self, key: AttemptKey, response_id: str, *, touch: bool = True) -> StoredResponse | None:
        """The attempt's response ``response_id`` (``None``: it has none); ``touch``: it counts as used now."""
        attempt = self._attempt(key)
        response = attempt.responses.get(response_id) if attempt is not None else None
        if response is not None and touch:
            attempt.responses.move_to_end(response_id)  # type: ignore[union-attr]
        return response

    def why_gone(self, key: AttemptKey, response_id: str) -> str | None:
        """Why the attempt no longer has ``response_id`` (dropped for the bounds, or deleted); ``None``: it
        never had it, or has forgotten that it had."""
        attempt = self._attempt(key)
        return attempt.gone.get(response_id) if attempt is not None else None

    def __len__(self) -> int:
        """Responses kept, all attempts together."""
        return sum(len(a.responses) for attempts in self._attempts.values() for a in attempts.values())

    @property
    def attempts(self) -> int:
        """Attempts with something kept (responses, or ids of gone ones)."""
        return sum(len(attempts) for attempts in self._attempts.values())

    def total_bytes(self) -> int:
        """What every attempt's responses hold, in bytes of JSON (as the bounds count them)."""
        return sum(a.bytes for attempts in self._attempts.values() for a in attempts.values())

    def held_bytes(self, key: AttemptKey) -> int:
        """What the attempt's responses hold, in bytes of JSON (as the bound counts them)."""
        attempt = self._attempt(key)
        return attempt.bytes if attempt is not None else 0

    # ------------------------------------------------------------------ changing
    def put(self, key: AttemptKey, response: StoredResponse) -> bool:
        """Keep ``response`` for the attempt, dropping its least recently used responses past the bounds;
        ``False`` when it alone is larger than ``response_bytes_per_attempt`` or no response is kept at all
        (``responses_per_attempt`` 0): it is not kept, and a later call naming it learns why."""
        count, limit = self.config.responses_per_attempt, self.config.response_bytes_per_attempt
        rollout, attempt_id = key
        attempts = self._attempts.setdefault(rollout or "", {})
        attempt = attempts.get(attempt_id)
        if attempt is None:
            attempt = attempts[attempt_id] = _Attempt()
        if count < 1 or response.size > limit:
            attempt.mark_gone(response.id, self._limits_text(count, limit))
            self._warn(key, response.size, count, limit)
            return False
        attempt.responses[response.id] = response
        attempt.bytes += response.size
        while len(attempt.responses) > count or attempt.bytes > limit:
            oldest = next(iter(attempt.responses))
            attempt.drop(oldest, self._limits_text(count, limit))
        return True

    def delete(self, key: AttemptKey, response_id: str) -> bool:
        """Delete the attempt's response ``response_id``; ``False``: it has none. A response that continued it
        keeps what it holds of it (its conversation)."""
        attempt = self._attempt(key)
        if attempt is None or response_id not in attempt.responses:
            return False
        attempt.drop(response_id, "it was deleted")
        return True

    def end(self, rollout_id: str, attempt_id: str | None = None) -> None:
        """Free an attempt that can make no more calls (``attempt_id`` ``None``: every attempt of the rollout)."""
        if attempt_id is None:
            self._attempts.pop(rollout_id, None)
            return
        attempts = self._attempts.get(rollout_id)
        if attempts is not None:
            attempts.pop(attempt_id, None)
            if not attempts:
                del self._attempts[rollout_id]

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Free every attempt of these rollouts (they are over)."""
        for rollout_id in rollout_ids:
            self._attempts.pop(rollout_id, None)

    # ------------------------------------------------------------------ helpers
    def _attempt(self, key: AttemptKey) -> _Attempt | None:
        attempts = self._attempts.get(key[0] or "")
        return attempts.get(key[1]) if attempts is not None else None

    @staticmethod
    def _limits_text(count: int, limit: int) -> str:
        return (
            f"it was dropped from the attempt's stored responses, which keep at most {count} responses and "
            f"{limit} bytes (aglverl.proxy.responses_per_attempt, response_bytes_per_attempt)"
        )

    def _warn(self, key: AttemptKey, size: int, count: int, limit: int) -> None:
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "a Responses API response of rollout %s (attempt %s) was not stored: it holds %d bytes of "
            "conversation and the proxy keeps at most %d responses and %d bytes per attempt; a call that continues "
            "it (previous_response_id) is refused. Raise aglverl.proxy.response_bytes_per_attempt (or "
            "responses_per_attempt) to keep such conversations",
            key[0],
            key[1],
            size,
            count,
            limit,
        )
