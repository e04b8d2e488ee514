"""Token-in sessions: what the proxy answered per rollout attempt, and which later request extends it.

A black-box agent sends its history back as text. :class:`Sessions` keeps, per rollout attempt, every recorded
chat call as a :class:`Turn`: the exact prompt ids and generated ids, keyed by a digest of the call's request
messages followed by its answer as the agent got it. A later request whose messages start with a recorded
turn's messages + answer and go on (the tail is not empty, and does not start with another assistant message)
under the same rendering context is a :class:`Match`: the proxy can generate it from ``turn.prompt + turn.response`` and the ids of the tail alone.

Messages are compared as the chat template would render them (:func:`canonical_message`): the role; the
content as the template gets it (a string verbatim, text parts joined with ``"\n"`` as vLLM joins them,
``None`` as ``""``); ``name`` and ``tool_call_id`` when present. Only an assistant message is compared more
loosely (its content stripped, tool calls as ``(name, arguments parsed as JSON)``, ids and reasoning fields
not compared): a turn's answer is replaced by the ids the engine generated, so the model sees those whatever
the agent echoed, while an edited system, user or tool message would be a different conversation. Each
message's canonical bytes are chained into a 16-byte BLAKE2b digest per prefix, so finding the longest
recorded prefix of a request is one digest per message and a dict lookup per prefix: the work per call does
not depend on how many turns came before, beyond reading the request itself. The rendering context
(``model``, ``tools``, ``chat_template``, ``chat_template_kwargs``, ``documents``) must be the same too:
another tool list is another prompt. :func:`conversation_shape` names what a template's placement of things
may depend on (the token-in part checks once per shape that the template renders the whole conversation as
the turn's rendering followed by the tail).

Not matched (the call is relayed as text and starts a new chain), each cause named by :meth:`Sessions.consider`:
``first_call`` (nothing recorded for the attempt), ``no_match`` (an edited history, another system prompt, a
sub-agent), ``context_changed`` (the same messages under other tools or template arguments), ``n`` (``n > 1``:
which answer would the agent keep?), ``unsupported`` (a request a generation from ids cannot stand for: content
other than text, ``continue_final_message``, no generation prompt, ``prompt_logprobs``, ``echo``, beam search).

Pure and synchronous: no I/O, no clock. Memory: a turn holds references to the id lists its record holds, so a
session costs the store's records nothing more than the digests, and the last request's messages (whose
digests the next request reuses for what it repeats unchanged); :meth:`Sessions.forget` drops every attempt of
the rollouts the store forgets. Bad input (a request whose ``messages`` is not a list of objects) is never an
error here: the request is simply not matched (``unsupported``) and the backend judges it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

__all__ = [
    "MISSES",
    "Answer",
    "Match",
    "Miss",
    "Pending",
    "Plan",
    "Sessions",
    "Turn",
    "Witness",
    "canonical_message",
    "conversation_shape",
]

Miss = Literal["first_call", "no_match", "context_changed", "n", "unsupported"]
#: Why a call was not matched (see the module docstring).
MISSES: tuple[Miss, ...] = ("first_call", "no_match", "context_changed", "n", "unsupported")
#: Request fields that change how the history renders: a turn matches only under the same ones.
CONTEXT_FIELDS = ("model", "tools", "chat_template", "chat_template_kwargs", "documents")
_DIGEST_SIZE = 16
_ROOT = b"\x00" * _DIGEST_SIZE
_SORTED = orjson.OPT_SORT_KEYS


def _text(content: Any, strip: bool) -> str | None:
    """A message's content as the template gets it (stripped for an assistant's); ``None`` when it holds
    anything but text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip() if strip else content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    text = "\n".join(texts)
    return text.strip() if strip else text


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as the JSON value they spell (the raw string when they spell none)."""
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def _calls(tool_calls: Any) -> list[list[Any]] | None:
    if not tool_calls:
        return []
    if not isinstance(tool_calls, list):
        return None
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return None
        calls.append([function.get("name"), _arguments(function.get("arguments"))])
    return calls


def _canonical(role: Any, content: Any, tool_calls: Any) -> bytes | None:
    """An assistant message's bytes: its content stripped, tool calls as name + parsed arguments."""
    if not tool_calls and type(content) is str and type(role) is str:  # most messages: one encode, no JSON
        return b"t" + role.encode() + b"\x00" + content.strip().encode()
    text, calls = _text(content, True), _calls(tool_calls)
    if text is None or calls is None or not isinstance(role, str):
        return None
    if not calls:
        return b"t" + role.encode() + b"\x00" + text.encode()
    try:
        return b"c" + orjson.dumps([role, text, calls], option=_SORTED)
    except TypeError:  # e.g. arguments holding an integer orjson cannot write
        return None


def _verbatim(message: Mapping[str, Any], role: str) -> bytes | None:
    """A system, user or tool message's bytes: what the template renders of it, verbatim."""
    content = message.get("content")
    name, call_id = message.get("name"), message.get("tool_call_id")
    if type(content) is str and name is None and call_id is None:
        return b"v" + role.encode() + b"\x00" + content.encode()
    text = _text(content, False)
    if text is None or message.get("tool_calls"):
        return None
    if name is None and call_id is None:
        return b"v" + role.encode() + b"\x00" + text.encode()
    try:
        return b"w" + orjson.dumps([role, text, name, call_id])
    except TypeError:
        return None


def canonical_message(message: Any) -> bytes | None:
    """The bytes a message is compared by (see the module docstring); ``None`` for one that cannot be matched
    (not an object, content other than text, malformed tool calls)."""
    if not isinstance(message, dict):
        return None
    role = message.get("role")
    if role == "assistant":
        return _canonical(role, message.get("content"), message.get("tool_calls"))
    if not isinstance(role, str):
        return None
    return _verbatim(message, role)


def conversation_shape(messages: Sequence[Any], match: Match) -> bytes:
    """What a template's placement of things may depend on, for a request that extends ``match.turn``: whether
    it starts with a system message, the role before the answer, whether the answer has tool calls, and the
    tail's roles. Conversations of one shape under one rendering context render alike (append-only or not)."""
    first = messages[0].get("role") if messages and isinstance(messages[0], dict) else None
    before = messages[match.history - 1].get("role") if match.history else None
    answer = messages[match.history] if match.history < match.start else None
    calls = bool(isinstance(answer, dict) and answer.get("tool_calls"))
    roles = [m.get("role") if isinstance(m, dict) else None for m in match.tail]
    return orjson.dumps([first == "system", before, calls, match.start > match.history, roles])


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids if type(ids) is list else list(ids)


def _chain(previous: bytes, canonical: bytes) -> bytes:
    return hashlib.blake2b(previous + canonical, digest_size=_DIGEST_SIZE).digest()


class Answer:
    """An assistant answer as the agent got it, assembled from a whole chat ``message`` or from stream deltas
    (content pieces; tool calls by ``index``, the name once, the arguments in pieces)."""

    __slots__ = ("calls", "parts")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: dict[int, list[Any]] = {}  # index -> [name, [argument pieces]]

    def set_message(self, message: Mapping[str, Any]) -> None:
        content = message.get("content")
        self.parts = [content] if isinstance(content, str) else []
        self.calls = {}
        for i, call in enumerate(message.get("tool_calls") or ()):
            function = (call.get("function") or {}) if isinstance(call, dict) else {}
            self.calls[i] = [function.get("name"), [function.get("arguments") or ""]]

    def add_delta(self, delta: Mapping[str, Any]) -> None:
        content = delta.get("content")
        if isinstance(content, str) and content:
            self.parts.append(content)
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            entry = self.calls.setdefault(call.get("index", 0), [None, []])
            function = call.get("function") or {}
            if function.get("name") and not entry[0]:
                entry[0] = function["name"]
            if function.get("arguments"):
                entry[1].append(function["arguments"])

    @property
    def empty(self) -> bool:
        """No text (after stripping) and no tool call: an agent may leave such an answer out of its history."""
        return not self.calls and not "".join(self.parts).strip()

    def canonical(self) -> bytes | None:
        calls = [
            {"function": {"name": name, "arguments": pieces[0] if len(pieces) == 1 else "".join(pieces)}}
            for _, (name, pieces) in sorted(self.calls.items())
        ]
        return _canonical("assistant", "".join(self.parts), calls)


@dataclass(slots=True, frozen=True)
class Witness:
    """A call the backend rendered itself (relayed as text): its messages exactly as the backend got them and the
    prompt ids it made of them: what the token-in part checks its own renderer against."""

    messages: list[Any]
    prompt: list[int]


@dataclass(slots=True, frozen=True)
class Turn:
    """A recorded call: its exact prompt ids and generated ids, under the rendering context it was made in.
    ``witness``: the conversation's rendered call (this one's, when it was relayed as text; carried over from
    the turn a call made from ids extends), so that a check of the template can be made at any turn (a few-shot
    first call, a cache that forgot its verdict). ``stop``: the response ended on a stop token the engine
    reported (``stop_reason``), which ends the turn as the template's own end of turn would."""

    prompt: list[int]
    response: list[int]
    context: bytes
    witness: Witness | None = None
    stop: bool = False

    @property
    def rendered(self) -> bool:
        """Whether the prompt is the backend's own rendering of the call's messages."""
        return self.witness is not None and self.witness.prompt is self.prompt


@dataclass(slots=True, frozen=True)
class Pending:
    """What a call needs for its turn to be remembered once it is recorded: its attempt, the digest of its
    request messages, and its rendering context."""

    rollout_id: str
    attempt_id: str
    digest: bytes
    context: bytes


@dataclass(slots=True, frozen=True)
class Match:
    """A request that extends ``turn``: ``tail`` is what follows the turn's messages and answer (not empty);
    ``history`` is how many of the request's messages the turn's call had (the answer comes next, when the
    agent kept it) and ``start`` where the tail starts (``history + 1``, or ``history`` when the agent left an
    empty answer out)."""

    turn: Turn
    tail: list[dict[str, Any]]
    history: int = 0
    start: int = 0


class Plan:
    """A chat call's part in its attempt's session: ``pending`` (to remember its turn), ``match`` (the turn it
    extends, if any) and, for a call sent with prompt ids, ``prompt`` (those ids)."""

    __slots__ = ("match", "pending", "prompt")

    def __init__(self, pending: Pending | None, match: Match | None) -> None:
        self.pending = pending
        self.match = match
        self.prompt: list[int] | None = None


class _Session:
    __slots__ = ("digests", "messages", "turns")

    def __init__(self) -> None:
        # digest of (messages + answer) -> rendering context -> (turn, whether the answer is in the messages)
        self.turns: dict[bytes, dict[bytes, tuple[Turn, bool]]] = {}
        # The last request's messages and their prefix digests: the next request of the conversation repeats
        # them, and the digests of the messages it repeats unchanged are not computed again.
        self.messages: list[Any] = []
        self.digests: list[bytes] = []


def _digests(messages: list[Any], session: _Session | None) -> list[bytes] | None:
    """The chained digest of every prefix of ``messages`` (``None``: one cannot be matched); those of the
    leading messages equal to the session's last request's are taken from it (a C-level comparison of the
    parsed objects instead of canonical bytes and a hash per message)."""
    digests: list[bytes] = []
    if session is not None:
        for new, old, digest in zip(messages, session.messages, session.digests, strict=False):
            if new != old:
                break
            digests.append(digest)
    digest = digests[-1] if digests else _ROOT
    for message in messages[len(digests) :]:
        canonical = canonical_message(message)
        if canonical is None:
            return None
        digest = _chain(digest, canonical)
        digests.append(digest)
    return digests


def _context(request: Mapping[str, Any]) -> bytes | None:
    try:
        fields = orjson.dumps([request.get(key) for key in CONTEXT_FIELDS], option=_SORTED)
    except TypeError:
        return None
    return hashlib.blake2b(fields, digest_size=_DIGEST_SIZE).digest()


def _unsupported(request: Mapping[str, Any]) -> Miss | None:
    n = request.get("n")
    if type(n) is int and n > 1:
        return "n"
    if (
        request.get("add_generation_prompt") is False
        or request.get("continue_final_message")
        or request.get("echo")
        or request.get("prompt_logprobs") is not None
        or request.get("use_beam_search")
    ):
        return "unsupported"
    return None


class Sessions:
    """Every attempt's recorded turns (see the module docstring)."""

    def __init__(self) -> None:
        self._rollouts: dict[str, dict[str, _Session]] = {}

    def __len__(self) -> int:
        """Attempts with a session."""
        return sum(len(attempts) for attempts in self._rollouts.values())

    def consider(
        self, rollout_id: str, attempt_id: str, request: Mapping[str, Any]
    ) -> tuple[Pending | None, Match | None, Miss | None]:
        """Read a chat request (its ``messages`` and rendering context) against the attempt's session.

        Returns ``(pending, match, miss)``: ``pending`` to :meth:`remember` the call's turn by once it is
        recorded (``None`` for a call that can never be extended: ``n > 1``, content other than text...), and
        either the longest :class:`Match` or why there is none.
        """
        messages = request.get("messages")
        why = _unsupported(request)
        context = _context(request)
        if why is not None or context is None or not isinstance(messages, list) or not messages:
            return None, None, why or "unsupported"
        session = self._rollouts.get(rollout_id, {}).get(attempt_id)
        digests = _digests(messages, session)
        if digests is None:
            return None, None, "unsupported"
        pending = Pending(rollout_id, attempt_id, digests[-1], context)
        if session is None:
            return pending, None, "first_call"
        session.messages, session.digests = messages, digests
        other_context = False
        for end in range(len(messages) - 1, 0, -1):  # the longest prefix first; the tail is never empty
            found = session.turns.get(digests[end - 1])
            if found is None:
                continue
            entry = found.get(context)
            if entry is None:
                other_context = True
            elif messages[end].get("role") != "assistant":  # what follows an answer is never another answer
                turn, answered = entry
                return pending, Match(turn, messages[end:], end - 1 if answered else end, end), None
        return pending, None, "context_changed" if other_context else "no_match"

    def remember(
        self,
        pending: Pending,
        answer: Answer,
        prompt: Sequence[int],
        response: Sequence[int],
        witness: Witness | None = None,
        stop: bool = False,
    ) -> bool:
        """Keep a recorded call's turn under its messages + ``answer`` (and under its messages alone when the
        answer is empty, which an agent may leave out), with its ``witness`` and ``stop`` (see :class:`Turn`).
        ``False`` when the answer cannot be canonicalised."""
        canonical = answer.canonical()
        if canonical is None:
            return False
        attempts = self._rollouts.setdefault(pending.rollout_id, {})
        session = attempts.get(pending.attempt_id)
        if session is None:
            session = attempts[pending.attempt_id] = _Session()
        prompt = _as_list(prompt)
        if witness is not None and witness.prompt == prompt:
            witness = Witness(witness.messages, prompt)  # its own: ``Turn.rendered``
        turn = Turn(prompt, _as_list(response), pending.context, witness, stop)
        session.turns.setdefault(_chain(pending.digest, canonical), {})[pending.context] = (turn, True)
        if answer.empty:
            session.turns.setdefault(pending.digest, {})[pending.context] = (turn, False)
        return True

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop every attempt's session of these rollouts (they are over)."""
        for rollout_id in rollout_ids:
            self._rollouts.pop(rollout_id, None)
