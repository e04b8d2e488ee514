"""Agents written the way Agent Lightning 0.2/0.3's ``agl.VERL`` programs write them (its docs, calc_x, spider,
agent-framework's samples): an ``@agl.rollout`` function (sync or async), a ``LitAgent`` class. Nothing here
imports aglverl. They run in Agent Lightning's runner processes (forked by ``Trainer.fit``).

Every task row carries ``reward`` (what the agent reports), optionally ``raise`` (the agent raises),
``kill_once`` (the first attempt kills its own runner process: a path whose existence marks it done), ``split``
(``train`` or ``val``), and ``log``: a JSON-lines file to which each rollout appends what it saw (the sampling
parameters, the endpoint, the row's ``data_id``, the answers), so tests see the runners' side.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import agentlightning as agl
import openai


def _note(task: dict[str, Any], **seen: Any) -> None:
    with open(task["log"], "a", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {"pid": os.getpid(), "split": task.get("split"), "data_id": task.get("data_id"), **seen}
            )
            + "\n"
        )


def _first_to_create(path: str) -> bool:
    """Whether this call created ``path`` (atomically: of two runners racing, exactly one does)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _chat(base_url: str, llm: agl.LLM, messages: list[dict[str, Any]]) -> str:
    client = openai.OpenAI(base_url=base_url, api_key=llm.api_key or "unused", max_retries=0)
    reply = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


@agl.rollout
def function_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    """The docs' agent: one chat call at ``llm.endpoint`` (already this rollout's), its reward returned."""
    if task.get("raise"):
        raise RuntimeError("this agent raises on purpose")
    answer = _chat(llm.endpoint, llm, [{"role": "user", "content": task["prompt"]}])
    _note(task, kind="function", sampling=llm.sampling_parameters, endpoint=llm.endpoint, answers=[answer])
    return float(task["reward"])


@agl.rollout
async def multiturn_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    """An async agent of three turns that re-sends its history as text (a tool message between turns)."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    answers = []
    for turn in range(3):
        reply = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        answer = reply.choices[0].message.content or ""
        answers.append(answer)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Again ({turn})."},
        ]
    await client.close()
    _note(task, kind="multiturn", sampling=llm.sampling_parameters, endpoint=llm.endpoint, answers=answers)
    return float(task["reward"])


class EmittingAgent(agl.LitAgent[dict[str, Any]]):
    """A ``LitAgent`` class (calc_x's shape): it resolves its ``ProxyLLM`` itself and reports its reward with
    ``agl.emit_reward`` (returning nothing), so the reward travels as a span through the tracer."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> None:
        llm = resources["main_llm"]
        assert isinstance(llm, agl.LLM) and isinstance(rollout, agl.AttemptedRollout)
        if task.get("kill_once") and _first_to_create(task["kill_once"]):
            os.kill(os.getpid(), signal.SIGKILL)  # the runner process dies mid-rollout
        base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        answer = _chat(base_url, llm, [{"role": "user", "content": task["prompt"]}])
        _note(
            task,
            kind="lit",
            mode=rollout.mode,
            sampling=llm.sampling_parameters,
            endpoint=base_url,
            direct=llm.endpoint,
            answers=[answer],
        )  # `direct`: what agents that skip get_base_url call
        agl.emit_reward(float(task["reward"]))


@agl.rollout
def reporting_agent(task: dict[str, Any], llm: agl.LLM) -> float | None:
    """One chat call, then the row's reward returned, or, when the row says ``emit``, reported with
    ``agl.emit_reward`` (returning nothing): the two ways a 0.3 agent reports it. A row's ``huge_once`` (a path
    whose existence marks it done) makes its first rollout report 1e39 instead (-1e39 when emitted)."""
    _chat(llm.endpoint, llm, [{"role": "user", "content": task["prompt"]}])
    reward = float(task["reward"])
    if task.get("huge_once") and _first_to_create(task["huge_once"]):
        reward = -1e39 if task.get("emit") else 1e39
    if task.get("emit"):
        agl.emit_reward(reward)
        return None
    return reward
