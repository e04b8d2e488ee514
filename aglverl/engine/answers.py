"""Answer bodies and stream chunks, in vLLM's shapes, for chat, completions and generate.

A whole answer is one function of its finished :class:`~aglverl.engine.job.Job` (:func:`chat_body`,
:func:`completion_body`, :func:`generate_body`); a stream is written by :func:`stream_answer`, one chunk per
choice and delta (:func:`chat_chunk`, :func:`completion_chunk`, :func:`generate_chunk`), after each chat
choice's role chunk, then the usage chunk when asked for and ``[DONE]``. Field names, key order and which
fields are ``null`` follow vLLM 0.32's answers with ``"return_token_ids": true`` (recorded:
``tests/fixtures/vllm/``). Pure functions of the job, except :func:`stream_answer`, which writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import orjson
from aiohttp import web

from .._version import __version__
from .job import Choice, Delta, Job
from .requests import ApiError
from .token_routes import generate_logprobs, weight_versions
from .tokens import TokenCodec

__all__ = [
    "BODIES",
    "SSE_TYPE",
    "WEIGHT_VERSION_HEADER",
    "chat_body",
    "chat_chunk",
    "chat_role_chunk",
    "completion_body",
    "completion_chunk",
    "generate_body",
    "generate_chunk",
    "stream_answer",
]

#: Response header with the weight version a generation answer's tokens came from.
WEIGHT_VERSION_HEADER = "X-Weight-Version"
SSE_TYPE = "text/event-stream; charset=utf-8"
_DONE = b"data: [DONE]\n\n"


async def stream_answer(request: web.Request, response: web.StreamResponse, job: Job) -> None:
    """The SSE body: role chunks (chat), a chunk per token and choice, usage if asked, ``[DONE]``.

    Nothing is sent before every choice has started (or ended), as vLLM sends its first chunk with the
    first tokens: the headers then carry the weight version the tokens come from. A client that goes away
    raises ``ConnectionResetError`` (or cancels the handler); the caller then cancels the job.
    """
    updates = job.updates
    assert updates is not None
    chunk = _CHUNKS[job.plan.kind]
    with updates:
        early: list[tuple[Choice, Delta]] = []
        started: set[int] = set()
        async for item in updates:
            early.append(item)
            started.add(item[0].index)
            if len(started) == len(job.choices):
                break
        response.headers[WEIGHT_VERSION_HEADER] = str(job.weight_version)
        await response.prepare(request)
        roles = [_sse(chat_role_chunk(job, c)) for c in job.choices] if job.plan.kind == "chat" else []
        await response.write(b"".join(roles + _events_of(chunk(job, c, d) for c, d in early)))
        async for choice, delta in updates:
            items = [chunk(job, choice, delta)]
            while True:  # everything already delivered goes out in one write
                try:
                    choice, delta = updates.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                items.append(chunk(job, choice, delta))
            if events := _events_of(items):
                await response.write(b"".join(events))
    await response.write(b"".join(_tail(job)))
    await response.write_eof()


def _tail(job: Job) -> list[bytes]:
    """What ends a stream: an error event, or the usage chunk when asked for; then ``[DONE]``."""
    tail = []
    if job.error is not None:
        tail.append(_sse(ApiError(500, f"generation failed: {job.error}").body()))
    elif job.plan.include_usage and job.plan.kind == "generate":
        tail.append(
            _sse({"request_id": job.id, "usage": job.usage(True), "output_mode": "tokens", "choices": []})
        )
    elif job.plan.include_usage:
        head = _head(job, "chat.completion.chunk" if job.plan.kind == "chat" else "text_completion")
        tail.append(
            _sse({**head, "choices": [], "usage": job.usage(False), "system_fingerprint": _fingerprint()})
        )
    tail.append(_DONE)
    return tail


def _fingerprint() -> str:
    return f"aglverl-{__version__}"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _events_of(chunks: Iterable[dict[str, Any] | None]) -> list[bytes]:
    return [_sse(chunk) for chunk in chunks if chunk is not None]


def _head(job: Job, obj: str) -> dict[str, Any]:
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model}


def _chat_logprobs(codec: TokenCodec, ids: list[int], lps: list[float], tops: list[Any]) -> dict[str, Any]:
    content = []
    for k, (token, lp) in enumerate(zip(ids, lps, strict=True)):
        text = codec.token_text(token)
        alternatives = (
            [
                {"token": (t := codec.token_text(i)), "logprob": v, "bytes": list(t.encode())}
                for i, v in tops[k]
            ]
            if tops
            else []
        )
        content.append(
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alternatives}
        )
    return {"content": content}


def _completion_logprobs(
    codec: TokenCodec, ids: list[int], lps: list[float], tops: list[Any], offset: int
) -> dict[str, Any]:
    tokens = [codec.token_text(t) for t in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
    top = []
    for k, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
        entry = {token: lp}
        for i, v in tops[k] if tops else ():
            entry.setdefault(codec.token_text(i), v)
        top.append(entry)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": top}


def chat_body(job: Job) -> dict[str, Any]:
    """A whole ``/v1/chat/completions`` answer (vLLM's fields and key order)."""
    with_ids = job.plan.with_ids
    choices = []
    for c in job.choices:
        ids, lps = c.seq.token_ids[: c.consumed], c.seq.logprobs[: c.consumed]
        tops = c.seq.top_logprobs[: c.consumed] if c.seq.params.top_logprobs else []
        message, finish_reason = c.message()
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": _chat_logprobs(job.codec, ids, lps, tops) if job.plan.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": ids if with_ids else None,
                "routed_experts": None,
            }
        )
    body = _head(job, "chat.completion")
    body |= {"choices": choices, "service_tier": None, "system_fingerprint": _fingerprint()}
    body |= {"usage": job.usage(True), "prompt_logprobs": None}
    body |= {"prompt_token_ids": job.plan.prompts[0] if with_ids else None, "prompt_text": None}
    body |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    return body


def completion_body(job: Job) -> dict[str, Any]:
    """A whole ``/v1/completions`` answer."""
    with_ids = job.plan.with_ids
    choices = []
    for c in job.choices:
        ids, lps = c.seq.token_ids[: c.consumed], c.seq.logprobs[: c.consumed]
        tops = c.seq.top_logprobs[: c.consumed] if c.seq.params.top_logprobs else []
        choices.append(
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _completion_logprobs(job.codec, ids, lps, tops, 0) if job.plan.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": ids if with_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": c.prompt if with_ids else None,
                "routed_experts": None,
            }
        )
    body = _head(job, "text_completion")
    body |= {"choices": choices, "service_tier": None, "system_fingerprint": _fingerprint()}
    body |= {
        "usage": job.usage(True),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    return body


def _generate_choice(job: Job, c: Choice, ids: list[int], start: int) -> dict[str, Any]:
    seq = c.seq
    out: dict[str, Any] = {"index": c.index, "finish_reason": None, "stop_reason": None, "token_ids": ids}
    out |= {"routed_experts": None, "sampling_mask": None, "weight_versions": None}
    end = start + len(ids)
    if job.plan.logprobs:
        out["logprobs"] = generate_logprobs(
            ids,
            seq.logprobs[start:end],
            seq.ranks[start:end],
            seq.top_logprobs[start:end],
            seq.params.top_logprobs,
        )
    else:
        out["logprobs"] = None
    return out


def generate_body(job: Job) -> dict[str, Any]:
    """A whole ``/inference/v1/generate`` answer (token ids, log-probs, weight versions)."""
    choices = []
    for c in job.choices:
        ids = c.seq.token_ids[: c.consumed]
        choice = _generate_choice(job, c, ids, 0)
        choice |= {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        choice["weight_versions"] = weight_versions(c.seq.weight_version, len(ids))
        choices.append(choice)
    body: dict[str, Any] = {"request_id": job.id, "model": job.model, "created": job.created}
    body |= {"usage": job.usage(True), "prompt_logprobs": None, "prompt_token_id_logprobs": None}
    body |= {"prompt_token_ids": None, "mm_placeholders": None, "metrics": None, "kv_transfer_params": None}
    body |= {"ec_transfer_params": None, "output_mode": "tokens", "choices": choices}
    return body


def generate_chunk(job: Job, c: Choice, d: Delta) -> dict[str, Any] | None:
    """One choice's streamed generate chunk; ``None`` when the delta holds nothing to send."""
    if not d.ids and d.finish_reason is None:
        return None
    start = (
        c.consumed - len(d.ids)
        if d.finish_reason is None
        else len(c.seq.token_ids[: c.consumed]) - len(d.ids)
    )
    choice = _generate_choice(job, c, d.ids, start)
    if d.finish_reason is not None:
        choice |= {"finish_reason": d.finish_reason, "stop_reason": c.stop_reason}
        choice["weight_versions"] = weight_versions(c.seq.weight_version, c.consumed)
    return {"request_id": job.id, "usage": None, "output_mode": "tokens", "choices": [choice]}


def chat_role_chunk(job: Job, c: Choice) -> dict[str, Any]:
    """A chat stream's first chunk for a choice: the role, and the prompt ids when asked for."""
    choice = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    choice["finish_reason"] = None
    chunk = {**_head(job, "chat.completion.chunk"), "choices": [choice]}
    if job.plan.with_ids:
        chunk |= {"prompt_token_ids": c.prompt, "prompt_text": None}
    return chunk


def chat_chunk(job: Job, c: Choice, d: Delta) -> dict[str, Any] | None:
    """One choice's chunk; ``None`` when a parser holds the text back and nothing else must be sent."""
    delta, finish_reason = c.delta(d)
    if delta is None:
        if d.finish_reason is None and not job.plan.logprobs and not job.plan.with_ids:
            return None
        delta = {}
    choice: dict[str, Any] = {"index": c.index, "delta": delta}
    choice["logprobs"] = _chat_logprobs(job.codec, d.ids, d.logprobs, d.tops) if job.plan.logprobs else None
    choice["finish_reason"] = finish_reason
    if d.finish_reason is not None:
        choice["stop_reason"] = c.stop_reason
    if job.plan.with_ids:
        choice["token_ids"] = d.ids
    chunk = {**_head(job, "chat.completion.chunk"), "choices": [choice]}
    if d.finish_reason is not None and not job.plan.include_usage:  # else the usage chunk carries it
        chunk["system_fingerprint"] = _fingerprint()
    return chunk


def completion_chunk(job: Job, c: Choice, d: Delta) -> dict[str, Any] | None:
    """One choice's streamed completions chunk."""
    choice: dict[str, Any] = {"index": c.index, "text": d.text}
    choice["logprobs"] = (
        _completion_logprobs(job.codec, d.ids, d.logprobs, d.tops, d.offset) if job.plan.logprobs else None
    )
    choice |= {"finish_reason": d.finish_reason, "stop_reason": c.stop_reason if d.finish_reason else None}
    with_ids = job.plan.with_ids
    choice["prompt_token_ids"] = c.prompt if with_ids and d.first else None
    choice["token_ids"] = d.ids if with_ids else None
    chunk = {**_head(job, "text_completion"), "choices": [choice]}
    if d.finish_reason is not None and not job.plan.include_usage:  # else the usage chunk carries it
        chunk["system_fingerprint"] = _fingerprint()
    return chunk


_CHUNKS: dict[str, Callable[[Job, Choice, Delta], dict[str, Any] | None]] = {
    "chat": chat_chunk,
    "completion": completion_chunk,
    "generate": generate_chunk,
}
#: Whole answers by the plan's kind.
BODIES: dict[str, Callable[[Job], dict[str, Any]]] = {
    "chat": chat_body,
    "completion": completion_body,
    "generate": generate_body,
}
