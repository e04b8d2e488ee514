"""The answers the mock sends: one generation's choices, and its whole JSON body or SSE events, as vLLM writes
them with ``"return_token_ids": true``.

:class:`Generation` is what one ``/v1/chat/completions`` or ``/v1/completions`` request asks for and the
deterministic answer to it (ids from :mod:`.mock_tokens`): top-level ``prompt_token_ids`` for chat, per-choice
``prompt_token_ids`` for completions, ``choices[i].token_ids``, logprobs when asked, ``usage``, streams with
``n`` choices interleaved by ``index``, a forced tool call (``message.tool_calls``; streamed as
``delta.tool_calls``, the name first, then one piece of arguments per token), ``stop_token_ids`` ending a
choice on the stop id, ``stream_options.include_usage`` and ``data: [DONE]``. One ``orjson.dumps`` per body
or event: the proxy benchmark uses the mock as its backend.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .mock_tokens import (
    Template,
    completion_token_ids,
    forced_tool,
    prompt_token_ids,
    token_logprob,
    token_text,
    tool_arguments,
)

__all__ = ["DONE", "Budget", "Generation", "error_body", "sse_event"]

#: The last event of every stream.
DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, type_: str) -> bytes:
    """An OpenAI-shaped error body, as vLLM answers a refused request."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}})


def sse_event(obj: Any) -> bytes:
    """``obj`` as one SSE event."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass(slots=True)
class _Choice:
    index: int
    prompt: list[int]
    ids: list[int]
    finish: str
    stop_reason: int | None = (
        None  # the stop token id the choice ended on (kept in its ids, as vLLM keeps it)
    )


#: How many tokens a choice gets for its prompt, and why it stopped ("stop" or "length").
Budget = Callable[[Sequence[int]], tuple[int, str]]


class Generation:
    """What one generation request asks for and the deterministic answer to it."""

    def __init__(
        self,
        kind: str,
        body: Mapping[str, Any],
        budget: Budget,
        with_ids: bool,
        model: str,
        template: Template = "plain",
        prompt: list[int] | None = None,
    ) -> None:
        self.kind = kind
        self.body = body
        self.with_ids = with_ids
        self.model = model
        self.created = int(time.time())
        n = int(body.get("n") or 1)
        prompts = [prompt] if prompt is not None else prompt_token_ids(body, template)
        self.prompts = prompts
        self.choices = []
        for p, prompt in enumerate(prompts):
            count, finish = budget(prompt)
            self.choices += [
                _Choice(p * n + j, prompt, completion_token_ids(prompt, p * n + j, count), finish)
                for j in range(n)
            ]
        stops = body.get("stop_token_ids")
        if isinstance(stops, list) and stops:  # as vLLM: the first stop id ends the choice, kept in its ids
            for c in self.choices:
                at = next((k for k, t in enumerate(c.ids) if t in stops), None)
                if at is not None:
                    c.ids, c.finish, c.stop_reason = c.ids[: at + 1], "stop", c.ids[at]
        raw_lp = body.get("logprobs")
        self.logprobs = bool(raw_lp) if kind == "chat" else raw_lp is not None and raw_lp is not False
        stream_options = body.get("stream_options") or {}
        self.include_usage = bool(stream_options.get("include_usage"))
        self.tool = forced_tool(body) if kind == "chat" else None
        if self.tool is not None:
            for c in self.choices:
                c.finish = "tool_calls" if c.finish == "stop" else c.finish

    def abort_after(self, tokens: int) -> None:
        """Every choice cut after ``tokens`` ids with finish reason ``"abort"`` (a weight update)."""
        for c in self.choices:
            c.ids, c.finish = c.ids[:tokens], "abort"

    def _call_id(self, c: _Choice) -> str:
        return f"chatcmpl-tool-{c.index}{sum(c.prompt) % 10**8:08d}"

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.ids) for c in self.choices)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def _chat_logprobs(self, ids: Sequence[int]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for t in ids:
            text = token_text(t)
            content.append(
                {"token": text, "logprob": token_logprob(t), "bytes": list(text.encode()), "top_logprobs": []}
            )
        return {"content": content}

    def _completion_logprobs(self, ids: Sequence[int], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens = [token_text(t) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
        lps = [token_logprob(t) for t in ids]
        return {
            "text_offset": offsets,
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps, strict=False)],
        }

    # ------------------------------------------------------------------ whole responses
    def response(self, request_id: str) -> bytes:
        choices = [
            self._chat_choice(c) if self.kind == "chat" else self._completion_choice(c) for c in self.choices
        ]
        obj: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.kind == "chat":
            obj["prompt_token_ids"] = self.prompts[0] if self.with_ids else None
        return orjson.dumps(obj)

    def _chat_choice(self, c: _Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(map(token_text, c.ids))}
        if self.tool is not None:
            function = {"name": self.tool, "arguments": "".join(tool_arguments(c.ids))}
            message = {"role": "assistant", "content": None}
            message["tool_calls"] = [{"id": self._call_id(c), "type": "function", "function": function}]
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._chat_logprobs(c.ids),
            "finish_reason": c.finish,
            "stop_reason": c.stop_reason,
            "token_ids": c.ids if self.with_ids else None,
        }

    def _completion_choice(self, c: _Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "text": "".join(map(token_text, c.ids)),
            "logprobs": self._completion_logprobs(c.ids, 0),
            "finish_reason": c.finish,
            "stop_reason": c.stop_reason,
            "token_ids": c.ids if self.with_ids else None,
            "prompt_token_ids": c.prompt if self.with_ids else None,
        }

    # ------------------------------------------------------------------ streams
    def events(self, request_id: str) -> list[bytes]:
        """Every SSE event of the streamed answer, ``[DONE]`` included, in the order vLLM sends them."""
        head: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        events = []
        if self.kind == "chat":
            for c in self.choices:
                first = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                first |= {"logprobs": None, "finish_reason": None}
                obj = {**head, "choices": [first]}
                if self.with_ids:
                    obj["prompt_token_ids"] = c.prompt
                events.append(sse_event(obj))
        steps = max((len(c.ids) for c in self.choices), default=0)
        offsets = [0] * len(self.choices)
        for k in range(steps):
            for i, c in enumerate(self.choices):
                if k < len(c.ids):
                    last = k == len(c.ids) - 1
                    choice = self._chunk_choice(c, k, last, offsets[i])
                    offsets[i] += len(token_text(c.ids[k]))
                    events.append(sse_event({**head, "choices": [choice]}))
        if self.include_usage:
            events.append(sse_event({**head, "choices": [], "usage": self.usage()}))
        events.append(DONE)
        return events

    def _tool_delta(self, c: _Choice, k: int) -> dict[str, Any]:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": tool_arguments(c.ids)[k]}}
        if k == 0:  # the first piece also names the call, as vLLM's parsers send it
            call |= {"id": self._call_id(c), "type": "function"}
            call["function"] = {"name": self.tool, **call["function"]}
        return {"tool_calls": [call]}

    def _chunk_choice(self, c: _Choice, k: int, last: bool, offset: int) -> dict[str, Any]:
        t = c.ids[k]
        choice: dict[str, Any] = {"index": c.index}
        if self.kind == "chat":
            choice["delta"] = {"content": token_text(t)} if self.tool is None else self._tool_delta(c, k)
            choice["logprobs"] = self._chat_logprobs([t])
        else:
            choice["text"] = token_text(t)
            choice["logprobs"] = self._completion_logprobs([t], offset)
        choice["finish_reason"] = c.finish if last else None
        choice["stop_reason"] = c.stop_reason if last else None
        if self.with_ids:
            if self.kind == "completion":
                choice["prompt_token_ids"] = c.prompt if k == 0 else None
            choice["token_ids"] = [t]
        return choice
