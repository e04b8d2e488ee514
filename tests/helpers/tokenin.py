"""What the token-in tests share: SDK agents that echo the text they got, and reading what the proxy did.

Agents: :func:`chat_turn` (one openai SDK chat call, as the agent sees it, streamed or not; :func:`greedy_turn`
the same, greedy, on the tiny model) and :func:`api_conversation` (three turns of a Responses API or Anthropic
Messages agent that send their history back as the SDK returned it). Checks: :func:`counts` (the proxy's
``aglverl_proxy_token_in_total`` outcomes), :func:`extends` (a call's prompt ids start with exactly an earlier
call's prompt + response ids) and :func:`completion` (what a backend itself generates greedily from ids).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import anthropic
import anyio
import openai

from aglverl import AgentDaemon, TrainingBatch, run_agents
from aglverl.proxy import LLMProxy
from aglverl.proxy.tokenin import OUTCOMES
from aglverl.store import LLMCall

GREEDY: dict[str, Any] = {"temperature": 0.0}
Agent = Callable[[dict[str, Any], Any], Awaitable[float]]


def counts(proxy: LLMProxy) -> dict[str, float]:
    """The non-zero ``aglverl_proxy_token_in_total`` outcomes of ``proxy``."""
    assert proxy.token_in is not None
    return {o: v for o in OUTCOMES if (v := proxy.token_in.m_calls.value(o))}


def extends(earlier: LLMCall, later: LLMCall) -> bool:
    """Whether ``later``'s prompt ids start with exactly ``earlier``'s prompt + response ids."""
    assert earlier.prompt_token_ids is not None and earlier.response_token_ids is not None
    head = earlier.prompt_token_ids + earlier.response_token_ids
    return later.prompt_token_ids is not None and later.prompt_token_ids[: len(head)] == head


async def chat_turn(
    client: openai.AsyncOpenAI, messages: list[Any], stream: bool, *, model: str, **kwargs: Any
) -> dict[str, Any]:
    """One chat completion as the agent sees it: ``content``, ``reasoning``, ``tool_calls`` (as dicts the agent
    sends back), ``finish_reason``; a stream's deltas put together."""
    kwargs = {"model": model, "messages": messages, **kwargs}
    if not stream:
        reply = await client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        return {
            "content": message.content,
            "reasoning": (message.model_extra or {}).get("reasoning"),
            "tool_calls": [c.model_dump() for c in message.tool_calls or ()],
            "finish_reason": reply.choices[0].finish_reason,
        }
    content, reasoning, calls, finish_reason = "", "", {}, None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            for call in choice.delta.tool_calls or ():
                function = {"name": "", "arguments": ""}
                entry = calls.setdefault(
                    call.index, {"id": call.id, "type": "function", "function": function}
                )
                if call.function is not None:
                    entry["function"]["name"] += call.function.name or ""
                    entry["function"]["arguments"] += call.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return {
        "content": content,
        "reasoning": reasoning or None,
        "tool_calls": list(calls.values()),
        "finish_reason": finish_reason,
    }


async def api_conversation(
    api: str, base: str, stream: bool, *, model: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> list[str]:
    """Three turns of a Responses API (``api="responses"``) or Anthropic Messages agent on ``base`` (the proxy's
    ``.../v1``) that sends its history back as the SDK returned it, a user turn after each answer; returns the
    texts it got."""
    texts = []
    if api == "responses":
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            history: list[Any] = [{"role": "user", "content": "question"}]
            for _ in range(3):
                kwargs: dict[str, Any] = dict(model=model, input=history, max_output_tokens=max_tokens)
                kwargs["extra_body"] = extra or {}
                if stream:
                    events = [e async for e in await client.responses.create(**kwargs, stream=True)]
                    ends = ("response.completed", "response.incomplete")
                    reply = next(e for e in events if e.type in ends).response
                else:
                    reply = await client.responses.create(**kwargs)
                texts.append(reply.output_text)
                history += [o.model_dump(exclude_none=True) for o in reply.output]
                history.append({"role": "user", "content": "again"})
        return texts
    # The Anthropic SDK appends /v1/messages itself: its base URL is the proxy's without /v1.
    async with anthropic.AsyncAnthropic(
        base_url=base.removesuffix("/v1"), api_key="unused", max_retries=0
    ) as c:
        messages: list[Any] = [{"role": "user", "content": "question"}]
        for _ in range(3):
            kwargs = dict(model=model, max_tokens=max_tokens, messages=messages, extra_body=extra or {})
            if stream:
                async with c.messages.stream(**kwargs) as events_:
                    message = await events_.get_final_message()
            else:
                message = await c.messages.create(**kwargs)
            texts.append("".join(b.text for b in message.content if b.type == "text"))
            messages += [
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                {"role": "user", "content": "again"},
            ]
    return texts


async def greedy_turn(
    client: openai.AsyncOpenAI, messages: list[Any], stream: bool, **kwargs: Any
) -> dict[str, Any]:
    """:func:`chat_turn` on the tiny model (``"tiny"``), greedy, 8 tokens unless told."""
    kwargs["extra_body"] = {**GREEDY, **kwargs.get("extra_body", {})}
    kwargs.setdefault("max_tokens", 8)
    return await chat_turn(client, messages, stream, model="tiny", **kwargs)


async def completion(url: str, prompt: list[int], tokens: int, **extra: Any) -> dict[str, Any]:
    """What the backend at ``url`` itself generates greedily from ``prompt`` on ``/v1/completions`` (its
    choice, with ids): for a token-in call, the same ids when it was generated from that prompt and nothing else."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": tokens,
        "return_token_ids": True,
        **GREEDY,
        **extra,
    }
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]


async def long_second_turn(base: str, tokens: int) -> dict[str, Any]:
    """The body of a conversation's second call, streamed and greedy, ``tokens`` long (end of sequence ignored,
    logprobs asked): the first turn (greedy, 8 tokens) is played on ``base`` first, so this one is token-in."""
    messages: list[Any] = [{"role": "user", "content": "Tell me everything."}]
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        first = await greedy_turn(client, messages, False)
    messages += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "More."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    return body | {"logprobs": True, "stream_options": {"include_usage": True}, **GREEDY}


async def a_step(
    daemon: AgentDaemon, agent: Agent, seconds: float = 30
) -> tuple[TrainingBatch, dict[str, float]]:
    """One step of ``agent`` (4 at once) on two samples, two rollouts each, within ``seconds``: the batch and the
    proxy's counters."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_agents(daemon.server_url, agent, concurrency=4))
        await daemon.submit([{"q": 1}, {"q": 2}], n=2)
        with anyio.fail_after(seconds):
            batch = await daemon.batches.receive()
        tg.cancel_scope.cancel()
    return batch, daemon.proxy_counters()
