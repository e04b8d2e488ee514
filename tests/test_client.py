"""run_agents against a real daemon on loopback: what it refuses, what a bad result becomes, how it logs outages."""

from __future__ import annotations

import functools
import logging
import math
import socket
from typing import Any

import anyio
import numpy as np
import pytest

from aglverl import LLM, AgentDaemon, Rollout, run_agents
from aglverl.client import check_agent

pytestmark = pytest.mark.anyio


async def test_an_agent_that_returns_nothing_fails_its_rollout_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def forgetful(task_input: Any, llm: LLM) -> float:
        if task_input["kind"] == "text":
            return "yes"  # type: ignore[return-value]
        return None  # type: ignore[return-value]

    caplog.set_level(logging.WARNING, logger="aglverl.client")
    async with AgentDaemon(max_attempts=1) as daemon, anyio.create_task_group() as tg:
        ids = [await daemon.queue_task({"kind": kind}) for kind in ("none", "none", "none", "text")]
        tg.start_soon(lambda: run_agents(daemon.server_url, forgetful, concurrency=2))
        with anyio.fail_after(20):
            results = [await daemon.wait_for_rollout(rollout_id) for rollout_id in ids]
        tg.cancel_scope.cancel()
    for result in results[:3]:
        assert result is not None and result.status == "failed" and result.final_reward is None
        assert "the agent returned None: return a float reward or a Rollout" in result.metadata["error"]
    assert results[3] is not None
    assert (
        "the agent returned 'yes' (str): return a float reward or a Rollout" in results[3].metadata["error"]
    )
    # each distinct error is logged once, however many rollouts it failed
    logged = [r.getMessage() for r in caplog.records if "agent failed on" in r.getMessage()]
    assert len(logged) == 2, logged


async def test_agents_that_cannot_be_awaited_with_task_and_llm_are_refused_before_any_task() -> None:
    def plain(task_input: Any, llm: LLM) -> float:
        return 1.0

    async def one_argument(task_input: Any) -> float:
        return 1.0

    async def generator(task_input: Any, llm: LLM) -> Any:
        yield 1.0

    with pytest.raises(
        TypeError, match=r"'plain' is a plain function.*make it `async def plain\(task_input, llm\)`"
    ):
        await run_agents("http://127.0.0.1:9", plain)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"must take two positional arguments \(task_input, llm\).*one_argument\("
    ):
        check_agent(one_argument)
    with pytest.raises(TypeError, match="async generator"):
        check_agent(generator)

    class Agent:
        async def __call__(self, task_input: Any, llm: LLM) -> float:
            return 1.0

    check_agent(Agent())  # an object whose __call__ is async is an agent


async def _results(agent: Any, inputs: list[str]) -> list[Rollout | None]:
    """The rollouts ``agent`` (two loops of :func:`run_agents`) made of one task per input, in their order."""
    async with AgentDaemon(max_attempts=1) as daemon, anyio.create_task_group() as tg:
        ids = [await daemon.queue_task(task_input) for task_input in inputs]
        tg.start_soon(lambda: run_agents(daemon.server_url, agent, concurrency=2))
        with anyio.fail_after(20):
            results = [await daemon.wait_for_rollout(rollout_id) for rollout_id in ids]
        tg.cancel_scope.cancel()
    return results


async def test_an_agent_that_returns_a_bool_or_a_numpy_scalar_gets_that_reward() -> None:
    """A reward is any finite real number an agent returns: ``answer == "yes"`` is 1.0 or 0.0, as numpy's bool
    and float are (the old check refused Python's bool and took numpy's)."""

    async def judge(task_input: Any, llm: LLM) -> Any:
        return {"bool": True, "false": False, "numpy_bool": np.bool_(True), "numpy": np.float32(0.25)}[
            task_input
        ]

    kinds = ["bool", "false", "numpy_bool", "numpy"]
    results = await _results(judge, kinds)
    rewards = {
        kind: (r.status, r.final_reward) for kind, r in zip(kinds, results, strict=True) if r is not None
    }
    assert rewards == {
        "bool": ("succeeded", 1.0),
        "false": ("succeeded", 0.0),
        "numpy_bool": ("succeeded", 1.0),
        "numpy": ("succeeded", 0.25),
    }


async def test_an_agent_returning_a_reward_not_finite_as_float32_fails_its_attempt_naming_it() -> None:
    """Issue 50: ``exp(100)`` (or 1e39) is a finite Python float and infinity in the float32 rows, where one
    such score ended the run's GRPO step. Returned as a number or in a :class:`Rollout` it fails its attempt,
    naming the value; the largest float32 is still a reward."""

    async def agent(task_input: Any, llm: LLM) -> Any:
        if task_input == "rollout":
            rollout = Rollout(rollout_id="x", final_reward=0.5)
            rollout.final_reward = 1e39  # assigned after construction: never validated there
            return rollout
        return {"exp": math.exp(100), "numpy": np.float64(-1e39), "max": 3.4028235e38}[task_input]

    kinds = ["exp", "numpy", "rollout", "max"]
    exp, numpy, rollout, largest = await _results(agent, kinds)
    shown = {"exp": repr(math.exp(100)), "numpy": "-1e+39", "rollout": "1e+39"}
    for kind, result in zip(kinds, (exp, numpy, rollout), strict=False):
        assert result is not None and result.status == "failed", kind
        error = result.metadata["error"]
        assert f"the agent returned the reward {shown[kind]}: not a finite float32 number" in error, error
    assert largest is not None and (largest.status, largest.final_reward) == ("succeeded", 3.4028235e38)


def _logged(agent: Any) -> Any:
    """A decorator whose wrapper is a plain function returning the async agent's coroutine."""

    @functools.wraps(agent)
    def wrapper(task_input: Any, llm: LLM) -> Any:
        return agent(task_input, llm)

    return wrapper


async def test_an_async_agent_behind_a_plain_decorator_is_awaited_and_a_wrapper_that_hides_it_is_named() -> (
    None
):
    @_logged
    async def decorated(task_input: Any, llm: LLM) -> float:
        return 0.5

    check_agent(decorated)  # the wrapper shows the async agent behind it (functools.wraps)

    def hiding(task_input: Any, llm: LLM) -> Any:  # no functools.wraps: nothing says an agent is behind it
        return decorated(task_input, llm)

    with pytest.raises(
        TypeError, match=r"'hiding' is a plain function, and no `async def` is behind it.*functools\.wraps"
    ):
        check_agent(hiding)

    async def eager_agent(task_input: Any, llm: LLM) -> float:
        return 1.0

    @functools.wraps(eager_agent)
    def eager(task_input: Any, llm: LLM) -> float:  # says it wraps an async agent, but returns a number
        return 1.0

    async with AgentDaemon(max_attempts=1) as daemon, anyio.create_task_group() as tg:
        awaited = await daemon.queue_task("decorated")
        tg.start_soon(lambda: run_agents(daemon.server_url, decorated, max_tasks=1))
        with anyio.fail_after(20):
            result = await daemon.wait_for_rollout(awaited)
        assert result is not None and (result.status, result.final_reward) == ("succeeded", 0.5)
        refused = await daemon.queue_task("eager")
        tg.start_soon(lambda: run_agents(daemon.server_url, eager, max_tasks=1))
        with anyio.fail_after(20):
            result = await daemon.wait_for_rollout(refused)
        tg.cancel_scope.cancel()
    assert result is not None and result.status == "failed"
    assert (
        "calling the agent 'eager_agent' returned 1.0 (float), not an awaitable" in result.metadata["error"]
    )


async def test_an_unreachable_task_server_is_one_line_and_the_agents_give_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def agent(task_input: Any, llm: LLM) -> float:
        return 1.0

    caplog.set_level(logging.WARNING, logger="aglverl.client")
    with anyio.fail_after(30):
        done = await run_agents(f"http://127.0.0.1:{port}", agent, concurrency=8, give_up_after=1.0)
    assert done == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "aglverl.client"]
    assert len(lines) == 2, (
        lines
    )  # eight loops retrying for a second: one line when it went, one when they stop
    assert "unreachable" in lines[0] and "retry with backoff for up to 1 s" in lines[0]
    assert "unreachable for more than 1 s: agents stop (0 tasks done)" in lines[1]
