"""The token-in wire protocol of vLLM 0.32's scale-out routes, as the embedded server speaks it.

Request models and answer shapes for ``POST /v1/chat/completions/render``, ``POST /inference/v1/generate``
and ``POST /v1/chat/completions/derender`` (field names and nesting as vLLM's
``entrypoints/scale_out/token_in_token_out/protocol.py``); the handlers are :class:`aglverl.engine.scale_out.
ScaleOutRoutes`'. Pure functions and pydantic models: no I/O, nothing here touches the engine.

``sampling_params`` of a generate request take vLLM's fields; those the embedded engine does not implement
are accepted only at their neutral value (a 400 names any other), unknown ones are ignored (vLLM's render
writes bookkeeping fields such as ``output_kind`` and ``skip_clone``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "NEUTRAL_SAMPLING",
    "DerenderRequest",
    "GenerateRequest",
    "derender_state",
    "generate_logprobs",
    "render_sampling_params",
    "weight_versions",
]

#: vLLM sampling fields the embedded engine accepts only at these values.
NEUTRAL_SAMPLING: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_p": (0, 0.0, None),
    "top_k": (0, -1, None),
    "min_tokens": (0, None),
    "bad_words": ([], None),
    "include_stop_str_in_output": (False, None),
    "prompt_logprobs": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
}


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class GenerateRequest(BaseModel):
    """vLLM's ``GenerateRequest`` (the render endpoint's answer, or written by hand)."""

    model_config = ConfigDict(extra="ignore")
    request_id: str | None = Field(default=None, max_length=256)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    reasoning_ended: bool | None = None
    output_mode: str = "tokens"


class _GenerateChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    index: int = 0
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None


class _GenerateAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_id: str = "derender"
    choices: list[_GenerateChoice]
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None


class _StreamState(BaseModel):
    """vLLM's ``DerenderStreamState``; the embedded server uses the replay fields (parser path)."""

    model_config = ConfigDict(extra="ignore")
    output_token_ids: list[int] = Field(default_factory=list)
    output_chunk_lens: list[int] = Field(default_factory=list)
    role_sent: bool = False
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = Field(default_factory=list)


class DerenderRequest(BaseModel):
    """Both forms of vLLM's chat derender request (``stream`` tells them apart)."""

    model_config = ConfigDict(extra="ignore")
    stream: bool = False
    model: str | None = None
    generate_response: _GenerateAnswer | None = None
    generate_chunk: _GenerateAnswer | None = None
    stream_state: _StreamState | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)
    prompt_token_ids: list[int] | None = None
    chat_request: dict[str, Any] | None = None


def render_sampling_params(
    *,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int | None,
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    logprobs: int | None,
    ignore_eos: bool,
    skip_special_tokens: bool,
    structured_outputs: dict[str, Any] | None,
) -> dict[str, Any]:
    """``sampling_params`` as vLLM's render writes them (neutral fields included, unset ones left out)."""
    out: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    out |= {"temperature": temperature, "top_p": top_p, "min_p": 0.0}
    if seed is not None:
        out["seed"] = seed
    out |= {"stop": list(stop), "stop_token_ids": list(stop_token_ids), "max_tokens": max_tokens}
    if logprobs is not None:
        out["logprobs"] = logprobs
    if ignore_eos:
        out["ignore_eos"] = True
    if not skip_special_tokens:  # vLLM writes it only when a parser needs the markup kept
        out["skip_special_tokens"] = False
    out |= {"output_kind": 2, "skip_clone": True}
    if structured_outputs is not None:
        out["structured_outputs"] = structured_outputs
    out |= {"bad_words": [], "skip_reading_prefix_cache": False}
    return out


def generate_logprobs(
    ids: Sequence[int], logprobs: Sequence[float], ranks: Sequence[int], tops: Sequence[Any], k: int
) -> dict[str, Any]:
    """The generate answer's ``logprobs``: per token the sampled id first, then the top alternatives (``k``
    entries in all), with ranks (1 = most likely) where known."""
    content = []
    for n, (token, lp) in enumerate(zip(ids, logprobs, strict=True)):
        rank = ranks[n] if n < len(ranks) else None
        top: list[dict[str, Any]] = [{"token_id": token, "logprob": lp, "rank": rank}]
        for r, (alt, alp) in enumerate(tops[n] if n < len(tops) else (), start=1):
            if len(top) >= max(k, 1):
                break
            if alt != token:
                top.append({"token_id": alt, "logprob": alp, "rank": r})
        content.append({"token_id": token, "logprob": lp, "rank": rank, "top_logprobs": top[: max(k, 1)]})
    return {"content": content}


def weight_versions(version: int | None, count: int) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions`` spans: here one span, a sequence runs under the version it started with."""
    if version is None or count == 0:
        return []
    return [{"version": str(version), "start": 0, "end": count}]


def derender_state(
    previous: _StreamState | None,
    new_ids: Sequence[int],
    *,
    tools_streamed: bool,
    tool_call_ids: Sequence[str],
) -> dict[str, Any]:
    """The ``stream_state`` a streaming derender answer returns (vLLM's ``DerenderStreamState`` fields)."""
    state = previous or _StreamState()
    ids = [*state.output_token_ids, *new_ids]
    lens = [*state.output_chunk_lens, *([len(new_ids)] if new_ids else [])]
    return {
        "prev_tokens": [],
        "prefix_offset": 0,
        "read_offset": 0,
        "role_sent": True,
        "logprob_context_token_ids": ids[-4:],
        "logprob_text_offset": 0,
        "output_token_ids": ids,
        "output_chunk_lens": lens,
        "tools_streamed": tools_streamed,
        "last_tool_call_ids": list(tool_call_ids),
    }
