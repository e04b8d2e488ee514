"""One generation request in flight on the server's loop: its choices, their text, and how news reaches the answer.

:class:`Job` holds a request's :class:`Choice` s (one per prompt and ``n``) and hands their progress to
whoever answers: a stream gets each :class:`Delta` through a memory stream, a whole answer waits for
:attr:`Job.done`. The engine thread notifies the job on the loop (``GenSequence.notify``); the job turns token
ids into text there, looks for stop strings, and keeps the parse session of each chat choice.

Detokenization starts from the prompt's last ids (:func:`lead_of`), as vLLM's detokenizer is primed, so a
generation resumed from the ids of an aborted one renders a character split across the boundary whole.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .chat_parser import ChatParser, ParsedMessage, ParseSession
from .generation import GenSequence
from .requests import Plan
from .tokens import TokenCodec

__all__ = ["DETOKENIZER_LEAD", "Choice", "Delta", "Job", "lead_of", "request_id"]

#: Prompt ids the detokenizer of each choice starts from (vLLM primes its own with the prompt's last ids): a
#: UTF-8 character is at most 4 bytes, so this covers one split across the prompt/output boundary twice over.
DETOKENIZER_LEAD = 8


def request_id(kind: str, given: str | None = None) -> str:
    """An answer's ``id``: vLLM's prefix for the route, then the caller's ``request_id`` or a random one."""
    if kind == "generate":  # vLLM's generate answers name themselves after the request id they were given
        return f"generate-tokens-{given or secrets.token_hex(8)}"
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{given or secrets.token_hex(8)}"


@dataclass(slots=True)
class Delta:
    """What one choice gained since its last delta."""

    ids: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    text: str
    finish_reason: str | None
    #: The choice's first delta (completions streams send ``prompt_token_ids`` in it).
    first: bool
    #: Where ``text`` starts in the choice's text (completions logprobs' ``text_offset``).
    offset: int


class Choice:
    """One choice of a request on the owner's loop: turns the engine's tokens into text and deltas.

    Incremental choices (streams, stop strings) detokenize token by token, look for stop strings in the
    new text (a match truncates the text, finishes the choice and aborts the engine sequence) and, while
    stop strings are possible, hold back the last ``longest stop - 1`` characters of a stream so a stop
    string is never half sent.
    """

    def __init__(
        self, job: Job, index: int, prompt: list[int], seq: GenSequence, session: ParseSession | None = None
    ) -> None:
        self.job, self.index, self.prompt, self.seq = job, index, prompt, seq
        #: The choice's parse (chat with a tool / reasoning parser), shared by its body or its chunks.
        self.session = session
        skip = job.plan.skip_special
        self.decode: Callable[[Sequence[int]], str] = lambda ids: job.codec.decode(ids, skip)
        self.consumed = 0
        self.text = ""
        self.sent = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.counted = False  # the job has counted this choice as finished
        self._parsed: ParsedMessage | None = None
        # Detokenization starts from the prompt's last ids, as vLLM's does: a generation resumed from prompt +
        # the ids of an aborted one then renders a character split across that boundary whole. The window
        # counts in "lead + output" positions: ids[_prefix:_read] is already text.
        self._lead, self._read = lead_of(self.decode, prompt)
        self._lead_text = self.decode(self._lead[: self._read])
        self._prefix = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.seq.error is not None

    def message(self) -> tuple[dict[str, Any], str | None]:
        """The whole answer's assistant message (vLLM's key order) and its chat ``finish_reason``."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.text,
            "refusal": None,
            "annotations": None,
        }
        message |= {"audio": None, "function_call": None}
        if self.session is None:
            return message | {"reasoning": None}, self.finish_reason
        if self._parsed is None:
            self._parsed = self.session.parse(self.text)
        parsed = self._parsed
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_json() for call in parsed.tool_calls]
        message["reasoning"] = parsed.reasoning
        return message, self.session.finish_reason(parsed, self.finish_reason)

    def delta(self, d: Delta) -> tuple[dict[str, Any] | None, str | None]:
        """A streamed delta's JSON (``None``: the parser has nothing to send yet) and its chat finish reason."""
        if self.session is None:
            return {"content": d.text}, d.finish_reason
        message = self.session.delta(d.text, d.ids, finished=d.finish_reason is not None)
        finish = self.session.finish_reason(self.session.tools_streamed, d.finish_reason)
        return (message.to_json() if message is not None else None), finish

    def take(self, count: int) -> Delta | None:
        """Process tokens up to ``count`` (the engine's notified length); ``None`` if nothing is new."""
        if self.done:
            return None  # finished by a stop string already; later tokens are not ours
        seq = self.seq
        start = self.consumed
        final = seq.finished and count == len(seq.token_ids)
        # An EOS or stop token ends the sequence and stays in its ids, but is no text (as in vLLM).
        text_end = count - 1 if final and seq.finish_reason == "stop" else count
        end = self._scan(start, text_end) if seq.incremental else text_end
        if self.finish_reason is None:  # no stop string matched
            end = count
            if final:
                self.finish_reason, self.stop_reason = seq.finish_reason, seq.stop_reason
                self._final_text(text_end)
        self.consumed = end
        hold = 0 if self.finish_reason is not None else self.job.holdback
        offset = self.sent
        text = self.text[offset : max(offset, len(self.text) - hold)]
        self.sent += len(text)
        return Delta(
            seq.token_ids[start:end],
            seq.logprobs[start:end],
            seq.top_logprobs[start:end] if seq.params.top_logprobs else [],
            text,
            self.finish_reason,
            start == 0,
            offset,
        )

    def _scan(self, start: int, count: int) -> int:
        """Detokenize ``[start, count)`` one token at a time; stops at a stop string. Returns the new end."""
        stops = self.job.plan.stops
        for i in range(start, count):
            before = len(self.text)
            self.text += self._piece(i + 1)
            if stops and (hit := self._find_stop(before)) is not None:
                cut, stop = hit
                self.text = self.text[:cut]
                self.finish_reason, self.stop_reason = "stop", stop
                self.seq.cancelled = True
                return i + 1
        return count

    def _piece(self, upto: int) -> str:
        """New text once token ``upto - 1`` is added (empty while it ends inside a UTF-8 character)."""
        decode = self.decode
        upto += len(self._lead)
        prefix = decode(self._ids(self._prefix, self._read))
        full = decode(self._ids(self._prefix, upto))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, upto
            return full[len(prefix) :]
        return ""

    def _ids(self, start: int, end: int) -> list[int]:
        """Ids ``[start, end)`` of the lead followed by the output."""
        lead, n = self._lead, len(self._lead)
        if start >= n:
            return self.seq.token_ids[start - n : end - n]
        return lead[start:end] + self.seq.token_ids[: max(0, end - n)]

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in the text added after ``before``."""
        best: tuple[int, str] | None = None
        for stop in self.job.plan.stops:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _final_text(self, text_end: int) -> None:
        decode = self.decode
        full = decode(self._ids(0, len(self._lead) + text_end))
        if full.startswith(self._lead_text):
            full = full[len(self._lead_text) :]
        else:  # a tokenizer whose decode is not additive; the output alone is the best reading then
            full = decode(self.seq.token_ids[:text_end])
        if not self.seq.incremental or full.startswith(self.text):
            self.text = full  # flushes characters an incremental decode was still holding back


def lead_of(decode: Callable[[Sequence[int]], str], prompt: Sequence[int]) -> tuple[list[int], int]:
    """The prompt ids a choice's detokenizer starts from, and how many of them are text already.

    The last ``DETOKENIZER_LEAD`` prompt ids; those at the end that render as U+FFFD (bytes of a character the
    output may complete, like the ids of an aborted generation a resumed one is prompted with) are read
    again with the output, which is what vLLM's incremental detokenizer does with the prompt it is primed with.
    """
    lead = list(prompt[-DETOKENIZER_LEAD:])
    read = len(lead)
    while read and decode(lead[:read]).endswith("\ufffd"):
        read -= 1
    return lead, read


class Job:
    """One request in flight: its choices, and how their news reaches whoever awaits it.

    Streams get every delta through an unbounded memory stream (one item per choice per step); others wait
    for :attr:`done`. :meth:`cancel` tells the engine to drop the request's sequences (client gone).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        model: str,
        codec: TokenCodec,
        parser: ChatParser,
        weight_version: Callable[[], int],
        outputs: Sequence[GenSequence] | None = None,
    ) -> None:
        self.plan = plan
        #: The served model's name (answers carry it); ``codec`` turns its ids into text.
        self.model, self.codec = model, codec
        self._weight_version = weight_version
        self.id = request_id(plan.kind, plan.request_id)
        self.created = int(time.time())
        self.done = anyio.Event()
        self.choices: list[Choice] = []
        self.holdback = max((len(s) for s in plan.stops), default=1) - 1 if plan.stream else 0
        self._left = 0
        self.cancelled = False
        self._send: MemoryObjectSendStream[tuple[Choice, Delta]] | None = None
        self.updates: MemoryObjectReceiveStream[tuple[Choice, Delta]] | None = None
        if plan.stream:
            self._send, self.updates = anyio.create_memory_object_stream[tuple[Choice, Delta]](float("inf"))
        loop = asyncio.get_running_loop()
        for p, prompt in enumerate(plan.prompts):
            for j in range(plan.n):
                k = p * plan.n + j
                if outputs is not None:  # a derender: the tokens exist already, nothing is generated
                    session = parser.session(plan.parse, prompt) if plan.parse is not None else None
                    self.choices.append(Choice(self, k, prompt, outputs[k], session))
                    continue
                seq = GenSequence(
                    prompt,
                    plan.params,
                    loop=loop,
                    notify=self._notify,
                    incremental=plan.stream or bool(plan.stops),
                    choice=j,
                    request_id=self.id,
                    constraint=plan.constraints[k] if plan.constraints else None,
                )
                session = parser.session(plan.parse, prompt) if plan.parse is not None else None
                self.choices.append(Choice(self, k, prompt, seq, session))
        self._by_seq = {id(c.seq): c for c in self.choices}
        self._left = len(self.choices)

    @property
    def error(self) -> BaseException | None:
        return next((c.seq.error for c in self.choices if c.seq.error is not None), None)

    @property
    def weight_version(self) -> int:
        """The oldest weight version any choice started under (the current one if none started)."""
        versions = [c.seq.weight_version for c in self.choices if c.seq.weight_version is not None]
        return min(versions) if versions else self._weight_version()

    def _notify(self, seq: GenSequence, count: int) -> None:
        if self.cancelled:
            return  # news the engine sent before it saw the cancellation
        choice = self._by_seq[id(seq)]
        delta = choice.take(count)
        if delta is not None and self._send is not None:
            self._send.send_nowait((choice, delta))
        if choice.done and not choice.counted:
            choice.counted = True
            self._left -= 1
            if self._left == 0:
                self.done.set()
                if self._send is not None:
                    self._send.close()

    def cancel(self) -> None:
        """Drop the request's sequences from the engine (at its next step); no more news is taken."""
        self.cancelled = True
        for choice in self.choices:
            choice.seq.cancelled = True
        if self._send is not None:
            self._send.close()

    def usage(self, details: bool) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.plan.prompts)
        completion = sum(len(c.seq.token_ids[: c.consumed]) for c in self.choices)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
        usage["completion_tokens"] = completion
        if details:
            usage |= {"prompt_tokens_details": None, "completion_tokens_details": None}
        return usage
