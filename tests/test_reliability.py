"""Backend faults through the whole daemon: openai-SDK agents (run_agents) -> proxy -> a faulty mock vLLM.

Every fault must end in one of three ways, and be counted: the proxy retries it and the agent never sees it
(``aglverl_proxy_retries_total``); the agent gets an OpenAI-shaped error naming the status, its attempt fails
and the rollout is requeued (``step/n_requeued``) or failed (``step/n_failed``); or the call succeeds but cannot
be trained on (``step/n_calls_unusable``, ``step/n_rollouts_without_calls``). Whatever happens, the step ends
(``step.wait()`` under ``fail_after``) with completed + failed == queued, and no (rollout, turn) in its batch
twice.
"""

from __future__ import annotations

import functools
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import openai
import orjson
import pytest
from aiohttp import web

from aglverl import LLM, AgentDaemon, BatchConfig, Rollout, run_agents
from aglverl._net import bind_listener, url_of
from aglverl.client import AgentClient
from aglverl.proxy import RetryPolicy
from aglverl.testing import MockVLLM
from aglverl.trajectory.steps import StepReport, TrainingBatch

pytestmark = pytest.mark.anyio

BATCH = BatchConfig(max_prompt_length=256, max_response_length=16)
#: Quick retries, generous budget: a fault test takes milliseconds unless it waits on purpose.
FAST_RETRY = RetryPolicy(attempts=3, total_timeout=5.0, backoff_initial=0.01, backoff_max=0.05)
#: One try per call: every backend failure reaches the agent.
NO_RETRY = RetryPolicy(attempts=1)
#: Bound on any one step in this file.
STEP_TIMEOUT = 10.0


# ---------------------------------------------------------------------------------------------- helpers
class ChatAgent:
    """An agent holding ``turns`` chat calls through its rollout's proxy URL with the official openai SDK.

    Keeps every ``openai.APIError`` it saw (then re-raises it, so run_agents posts a failed rollout) and how
    long each successful call took; ``first_error`` is set at the first error.
    """

    def __init__(self, turns: int = 1, *, stream: bool = False) -> None:
        self.turns = turns
        self.stream = stream
        self.errors: list[openai.APIError] = []
        self.call_seconds: list[float] = []
        self.first_error = anyio.Event()

    async def __call__(self, task_input: Any, llm: LLM) -> float:
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": f"question {task_input['q']}"}]
        try:
            for _ in range(self.turns):
                started = time.monotonic()
                content = await self._chat(client, llm.model, messages)
                self.call_seconds.append(time.monotonic() - started)
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
        except openai.APIError as exc:
            self.errors.append(exc)
            self.first_error.set()
            raise
        finally:
            await client.close()
        return 1.0

    async def _chat(self, client: openai.AsyncOpenAI, model: str, messages: list[Any]) -> str:
        if not self.stream:
            reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
            return reply.choices[0].message.content or ""
        parts = []
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)


@asynccontextmanager
async def daemon_for(
    backends: Sequence[str],
    *,
    retry: RetryPolicy = FAST_RETRY,
    request_timeout: float | None = None,
    eject_seconds: float = 0.2,
    **kwargs: Any,
) -> AsyncIterator[AgentDaemon]:
    """A daemon on ``backends`` with small timeouts (``request_timeout``: the proxy's default unless given)."""
    kwargs.setdefault("lease_seconds", 5.0)
    kwargs.setdefault("max_attempts", 3)
    if request_timeout is not None:
        kwargs["request_timeout"] = request_timeout
    daemon = AgentDaemon(
        backends=backends, model="mock", batch=BATCH, retry=retry, eject_seconds=eject_seconds, **kwargs
    )
    async with daemon:
        yield daemon


async def run_step(
    daemon: AgentDaemon, agent: ChatAgent, n_samples: int, *, concurrency: int = 2
) -> tuple[StepReport, TrainingBatch]:
    """Submit ``n_samples`` samples, serve them with ``concurrency`` agents; the step's report and batch.

    Checks what must hold after any fault: the step ends in time, completed + failed == queued, and the batch
    has no (rollout, turn) twice and no row from another step.
    """
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(run_agents, daemon.server_url, agent, concurrency=concurrency))
        step = await daemon.submit([{"q": i} for i in range(n_samples)])
        with anyio.fail_after(STEP_TIMEOUT):
            report = await step.wait()
            batch = await daemon.batches.receive()
        tg.cancel_scope.cancel()
    m = report.metrics
    assert m["step/n_queued"] == n_samples
    assert m["step/n_completed"] + m["step/n_failed"] == m["step/n_queued"]
    columns = batch.data.non_tensor_batch
    rows = list(zip(columns["rollout_id_list"], columns["turn_index_list"], strict=True))
    assert len(rows) == len(set(rows))
    assert {rid for rid, _ in rows} <= set(step.rollout_ids)
    return report, batch


def calls(daemon: AgentDaemon) -> dict[str, float]:
    """The proxy's ``aglverl_proxy_calls_total`` by outcome (zeros left out)."""
    outcomes = ("ok", "upstream_error", "failed", "cancelled", "rejected")
    return {o: v for o in outcomes if (v := daemon.proxy.m_calls.value(o))}


def metric_line(daemon: AgentDaemon, series: str) -> float:
    """The value of one series in the daemon's Prometheus text (``GET /metrics``), e.g. ``name{l="v"}``."""
    for line in daemon.registry.render().splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    raise AssertionError(f"{series} not in the daemon's metrics")


def refused_port() -> socket.socket:
    """A socket bound to a loopback port without listening: connections to it are refused while it is open."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


def error_of(exc: openai.APIError) -> dict[str, Any]:
    """The OpenAI error object the agent received (``{"message", "type", "param", "code"}``)."""
    body = exc.body
    assert isinstance(body, dict), body
    return body


# ---------------------------------------------------------------------------------------------- refused
async def test_refused_backend_next_to_a_healthy_one_is_ejected_and_its_calls_retried_on_the_healthy_one() -> (
    None
):
    with refused_port() as dead:
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        async with MockVLLM(completion_tokens=4) as mock, daemon_for([dead_url, mock.url]) as daemon:
            agent = ChatAgent(turns=2)
            report, batch = await run_step(daemon, agent, 4)
            assert daemon.proxy.healthy_backends == [mock.url]
    assert agent.errors == []
    assert report.metrics["step/n_completed"] == 4 and report.metrics["step/n_requeued"] == 0
    assert report.metrics["step/n_rollouts_with_proxy_triplets"] == 4 and len(batch.data) == 8
    # The first new rollout goes to the (idle, first-listed) dead backend, is refused and retried once.
    assert metric_line(daemon, "aglverl_proxy_backend_ejections_total") == 1
    assert metric_line(daemon, "aglverl_proxy_retries_total") >= 1
    assert calls(daemon) == {"ok": 8}  # a retried call is still one call


async def test_only_backend_refusing_fails_attempts_with_502_until_it_is_revived_and_the_step_completes() -> (
    None
):
    with refused_port() as dead:
        port = dead.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        async with daemon_for([url], max_attempts=50) as daemon:
            agent = ChatAgent()
            revived = MockVLLM(port=port, completion_tokens=4)

            async def revive_after_first_error() -> None:
                await agent.first_error.wait()
                dead.close()
                await revived.start()

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(revive_after_first_error)
                    report, _ = await run_step(daemon, agent, 2, concurrency=1)
            finally:
                await revived.stop()
    assert report.metrics["step/n_completed"] == 2 and report.metrics["step/n_failed"] == 0
    requeued = report.metrics["step/n_requeued"]
    assert requeued >= 1 and requeued == len(agent.errors)
    first = agent.errors[0]
    assert isinstance(first, openai.APIStatusError) and first.status_code == 502
    error = error_of(first)
    assert error["type"] == "BadGatewayError" and error["code"] == 502
    assert "unreachable" in error["message"] and url in error["message"]
    assert daemon.store.meters.requeued.value("agent_failed") == requeued
    assert daemon.proxy.m_ejections.value() >= 1
    assert calls(daemon) == {"failed": requeued, "ok": 2}


async def test_only_backend_dead_for_good_fails_every_rollout_after_max_attempts_and_the_step_still_ends() -> (
    None
):
    with refused_port() as dead:
        url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        async with daemon_for([url], max_attempts=2) as daemon:
            agent = ChatAgent()
            report, batch = await run_step(daemon, agent, 3)
    m = report.metrics
    assert m["step/n_failed"] == 3 and m["step/n_completed"] == 0
    assert m["step/n_requeued"] == 3  # each rollout: attempt 1 failed -> requeued, attempt 2 failed -> failed
    assert len(agent.errors) == 6 and {e.status_code for e in agent.errors} == {502}  # type: ignore[attr-defined]
    assert daemon.store.meters.failed.value() == 3
    assert len(batch.data) == 0


# ---------------------------------------------------------------------------------------------- 5xx / 429
async def test_backend_500s_within_the_retry_budget_are_absorbed_by_the_proxy() -> None:
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url]) as daemon:
        mock.fail_next(2)  # FAST_RETRY makes 3 tries: the first call succeeds on its third
        agent = ChatAgent()
        report, batch = await run_step(daemon, agent, 3, concurrency=1)
    assert agent.errors == []
    assert report.metrics["step/n_completed"] == 3 and report.metrics["step/n_requeued"] == 0
    assert len(batch.data) == 3
    assert daemon.proxy.m_retries.value() == 2
    assert calls(daemon) == {"ok": 3}


async def test_backend_500_on_every_try_reaches_the_agent_as_an_openai_500_and_the_attempt_is_requeued() -> (
    None
):
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url], retry=NO_RETRY) as daemon:
        mock.fail_next(1)
        agent = ChatAgent()
        report, batch = await run_step(daemon, agent, 2, concurrency=1)
    [error] = agent.errors
    assert isinstance(error, openai.InternalServerError) and error.status_code == 500
    assert error_of(error)["message"] == "injected failure (500)"  # the backend's own error body, unchanged
    m = report.metrics
    assert m["step/n_completed"] == 2 and m["step/n_requeued"] == 1 and m["step/n_failed"] == 0
    assert m["step/n_calls_unusable"] == 0  # the failed call belonged to the superseded attempt
    assert len(batch.data) == 2
    assert daemon.store.meters.requeued.value("agent_failed") == 1
    assert calls(daemon) == {"upstream_error": 1, "ok": 2}


async def test_429_with_retry_after_is_waited_out_by_the_proxy_and_the_agent_sees_only_a_slower_answer() -> (
    None
):
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url]) as daemon:
        mock.throttle_next(1, retry_after=0.4)
        agent = ChatAgent()
        report, _ = await run_step(daemon, agent, 1, concurrency=1)
    assert agent.errors == []
    assert agent.call_seconds[0] >= 0.4  # Retry-After honoured, not the 10 ms backoff
    assert report.metrics["step/n_completed"] == 1 and report.metrics["step/n_requeued"] == 0
    assert daemon.proxy.m_retries.value() == 1
    assert calls(daemon) == {"ok": 1}


async def test_429_asking_past_the_retry_budget_reaches_the_agent_as_a_rate_limit_error_at_once() -> None:
    budget = RetryPolicy(attempts=3, total_timeout=0.5, backoff_initial=0.01)
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url], retry=budget) as daemon:
        mock.throttle_next(1, retry_after=30)
        agent = ChatAgent()
        started = time.monotonic()
        report, batch = await run_step(daemon, agent, 1, concurrency=1)
        elapsed = time.monotonic() - started
    [error] = agent.errors
    assert isinstance(error, openai.RateLimitError) and error.status_code == 429
    assert error.response.headers["Retry-After"] == "30"  # passed on for the agent to decide
    assert elapsed < 3  # neither the proxy nor the next attempt waited 30 s for that backend
    assert report.metrics["step/n_completed"] == 1 and report.metrics["step/n_requeued"] == 1
    assert len(batch.data) == 1
    assert daemon.proxy.m_retries.value() == 0
    assert calls(daemon) == {"upstream_error": 1, "ok": 1}


# ---------------------------------------------------------------------------------------------- stalls
async def test_stalled_backend_call_ends_in_a_504_at_request_timeout_and_the_attempt_is_requeued() -> None:
    async with (
        MockVLLM(completion_tokens=4) as mock,
        daemon_for([mock.url], request_timeout=0.5) as daemon,
    ):
        mock.stall_next(1)
        agent = ChatAgent()
        report, _ = await run_step(daemon, agent, 2, concurrency=1)
        with anyio.fail_after(2):
            await mock.wait_until(lambda m: m.cancelled == 1)  # the stalled upstream request was abandoned
    [error] = agent.errors
    assert isinstance(error, openai.APIStatusError) and error.status_code == 504
    assert error_of(error)["type"] == "GatewayTimeoutError" and "request_timeout=0.5" in error.message
    assert report.metrics["step/n_completed"] == 2 and report.metrics["step/n_requeued"] == 1
    assert calls(daemon) == {"failed": 1, "ok": 2}


async def test_call_stalled_past_the_lease_is_overtaken_by_a_new_attempt_and_cancelled_when_the_agent_goes() -> (
    None
):
    async with (
        MockVLLM(completion_tokens=4) as mock,
        daemon_for([mock.url], lease_seconds=0.5) as daemon,  # the proxy's request_timeout stays 600 s
    ):
        mock.stall_next(1)
        agent = ChatAgent()
        report, batch = await run_step(daemon, agent, 1, concurrency=2)
        # run_step cancelled the agents: the stalled one's connection closed, so the proxy's upstream did too.
        with anyio.fail_after(2):
            await mock.wait_until(lambda m: m.cancelled == 1 and m.active == 0)
    assert agent.errors == []
    assert report.metrics["step/n_completed"] == 1 and report.metrics["step/n_requeued"] == 1
    assert daemon.store.meters.requeued.value("lease_expired") == 1
    assert len(batch.data) == 1
    assert calls(daemon) == {"ok": 1, "cancelled": 1}


# ---------------------------------------------------------------------------------------------- broken
async def test_backend_closing_a_stream_midway_ends_the_agents_stream_with_an_error_and_requeues() -> None:
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url]) as daemon:
        mock.break_next(1, after_events=2)
        agent = ChatAgent(turns=2, stream=True)
        report, batch = await run_step(daemon, agent, 2, concurrency=1)
    [error] = agent.errors
    error_body = error_of(error)
    assert error_body["code"] == 502 and "broke off the response" in error_body["message"]
    m = report.metrics
    assert m["step/n_completed"] == 2 and m["step/n_requeued"] == 1 and m["step/n_calls_unusable"] == 0
    assert len(batch.data) == 4
    assert mock.broken == 1
    assert calls(daemon) == {"failed": 1, "ok": 4}


async def test_connection_closed_before_any_answer_is_retried_by_the_proxy() -> None:
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url]) as daemon:
        mock.break_next(1)
        agent = ChatAgent()
        report, _ = await run_step(daemon, agent, 2, concurrency=1)
    assert agent.errors == []
    assert report.metrics["step/n_completed"] == 2 and report.metrics["step/n_requeued"] == 0
    assert daemon.proxy.m_retries.value() == 1
    assert calls(daemon) == {"ok": 2}


# ---------------------------------------------------------------------------------------------- no ids
async def test_answer_without_token_ids_completes_the_rollout_but_is_counted_unusable_not_invented() -> None:
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url]) as daemon:
        mock.omit_ids_next(1)
        agent = ChatAgent()
        report, batch = await run_step(daemon, agent, 3, concurrency=1)
    assert agent.errors == []  # the agent got its answer; only training cannot use it
    m = report.metrics
    assert m["step/n_completed"] == 3 and m["step/n_requeued"] == 0
    assert m["step/n_calls_unusable"] == 1
    assert m["step/n_rollouts_without_calls"] == 1
    assert m["step/n_rollouts_with_proxy_triplets"] == 2
    assert len(batch.data) == 2
    assert daemon.proxy.m_no_ids.value() == 1
    assert metric_line(daemon, "aglverl_proxy_calls_without_token_ids_total") == 1
    assert calls(daemon) == {"ok": 3}


async def test_call_without_ids_in_a_multi_turn_rollout_is_skipped_and_counted() -> None:
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url]) as daemon:
        mock.omit_ids_next(1)  # the first rollout's first turn
        agent = ChatAgent(turns=2)
        report, batch = await run_step(daemon, agent, 2, concurrency=1)
    m = report.metrics
    assert m["step/n_completed"] == 2 and m["step/n_calls_unusable"] == 1
    turns = Counter(batch.data.non_tensor_batch["rollout_id_list"].tolist())
    assert sorted(turns.values()) == [1, 2]


# ---------------------------------------------------------------------------------------------- known defects
# Each test below shows a defect found while writing this file or running benchmarks/soak.py. They are strict
# xfails, so the suite stays green until the fix lands; then the marker must go.


@asynccontextmanager
async def odd_backend(token_ids: Any) -> AsyncIterator[str]:
    """A vLLM-shaped chat backend on loopback that answers every call with ``token_ids`` as the response ids."""

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        choice = {"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"}
        body = {"id": "odd", "object": "chat.completion", "created": 0, "model": "mock"}
        body |= {"prompt_token_ids": [1, 2, 3], "choices": [{**choice, "token_ids": token_ids}]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = bind_listener("127.0.0.1", 0)
    try:
        await web.SockSite(runner, sock).start()
        yield url_of(sock)
    finally:
        await runner.cleanup()
        sock.close()


async def test_hung_backend_next_to_a_healthy_one_does_not_fail_the_rollouts_pinned_to_it() -> None:
    async with MockVLLM(completion_tokens=4) as hung, MockVLLM(completion_tokens=4) as healthy:
        hung.stall_next(1000)
        async with daemon_for([hung.url, healthy.url], request_timeout=0.3, max_attempts=3) as daemon:
            report, _ = await run_step(daemon, ChatAgent(), 4, concurrency=4)
    assert report.metrics["step/n_failed"] == 0  # today: 2 (both rollouts first routed to the hung backend)


@pytest.mark.parametrize(
    "ids", [[2**63], ["a"], [[1, 2]], 7, [-1]], ids=["over_int64", "str", "nested", "int", "neg"]
)
async def test_malformed_token_ids_from_a_backend_are_counted_unusable_without_stopping_the_daemon(
    ids: Any,
) -> None:
    async with odd_backend(ids) as url, daemon_for([url]) as daemon:
        report, batch = await run_step(daemon, ChatAgent(), 1, concurrency=1)
        assert report.metrics["step/n_calls_unusable"] == 1 and len(batch.data) == 0
        report, _ = await run_step(daemon, ChatAgent(), 1, concurrency=1)  # the daemon still serves steps


async def test_posted_token_id_beyond_int64_is_refused_and_the_daemon_keeps_serving() -> None:
    async with daemon_for([], max_attempts=1) as daemon, AgentClient(daemon.server_url) as client:
        step = await daemon.submit([{"q": 0}])
        task = await client.next_task(wait=1)
        assert task is not None
        body = (
            b'{"rollout_id": "%s", "attempt_id": "%s", "final_reward": 1.0, "triplets": [{"prompt": '
            b'{"token_ids": [1, 9223372036854775808]}, "response": {"token_ids": [3]}}]}'
        ) % (task.rollout_id.encode(), (task.attempt_id or "").encode())
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{daemon.server_url}/rollout", data=body) as resp,
        ):
            assert resp.status == 422
            assert "triplets.0.prompt.token_ids.1" in (await resp.json())["detail"]
        rollout = Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, status="failed")
        await client.post_rollout(rollout)  # the agent reports the failure instead
        with anyio.fail_after(STEP_TIMEOUT):
            report = await step.wait()
            await daemon.batches.receive()
        assert report.metrics["step/n_completed"] + report.metrics["step/n_failed"] == 1
        assert await client.next_task(wait=0) is None  # still serving


async def test_long_polls_that_time_out_leave_no_waiter_behind() -> None:
    async with daemon_for([]) as daemon, AgentClient(daemon.server_url) as client:
        for _ in range(20):
            assert await client.next_task(wait=0.01) is None
        assert metric_line(daemon, "aglverl_agents_waiting") == 0  # today: 20


async def test_proxy_keeps_no_routing_state_for_rollouts_whose_step_was_handed_over() -> None:
    async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url]) as daemon:
        _, batch = await run_step(daemon, ChatAgent(), 3)
        routed = set(batch.data.non_tensor_batch["rollout_id_list"].tolist())
        assert len(routed) == 3
        assert routed.isdisjoint(daemon.proxy._pool._sticky)  # today: all 3 are still there


async def test_run_agents_keeps_serving_across_a_task_server_restart() -> None:
    with refused_port() as reserved:
        port = reserved.getsockname()[1]
    agent = ChatAgent()
    async with anyio.create_task_group() as tg:
        async with daemon_for([], port=port) as first:
            tg.start_soon(functools.partial(run_agents, first.server_url, agent, concurrency=2))
            with anyio.fail_after(STEP_TIMEOUT):
                while len(first.store._waiters) < 2:  # noqa: ASYNC110  # no event tells when agents are parked
                    await anyio.sleep(0.01)
        # The daemon is down for a moment (a restart); agents polling now are refused.
        async with MockVLLM(completion_tokens=4) as mock, daemon_for([mock.url], port=port) as second:
            step = await second.submit([{"q": 1}])
            with anyio.fail_after(3):
                report = await step.wait()
        tg.cancel_scope.cancel()
    assert report.metrics["step/n_completed"] == 1


async def test_agent_outliving_a_daemon_restart_finishes_its_recovered_rollout_through_the_live_proxy(
    tmp_path: Any,
) -> None:
    """The restarted daemon rebinds the journal's resources to its new proxy in place (same resources id); an
    agent that cached them before the restart must not keep calling the dead proxy."""
    with refused_port() as reserved:
        port = reserved.getsockname()[1]
    journal = tmp_path / "restart.journal"
    first_call_done = anyio.Event()
    seen_endpoints: list[str] = []

    async def agent(task_input: Any, llm: LLM) -> float:
        seen_endpoints.append(llm.endpoint)
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="x", max_retries=0)
        try:
            await client.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        finally:
            await client.close()
        if len(seen_endpoints) == 1:  # the attempt in flight when the daemon goes away never returns
            first_call_done.set()
            await anyio.sleep_forever()
        return 1.0

    async with anyio.create_task_group() as tg:
        async with (
            MockVLLM(completion_tokens=4) as mock,
            daemon_for([mock.url], port=port, journal_path=journal, max_attempts=2) as first,
        ):
            step = await first.submit([{"q": 0}])
            tg.start_soon(functools.partial(run_agents, first.server_url, agent, concurrency=2))
            with anyio.fail_after(STEP_TIMEOUT):
                await first_call_done.wait()
            first_proxy = first.proxy.url
        async with (
            MockVLLM(completion_tokens=4) as mock,
            daemon_for([mock.url], port=port, journal_path=journal, max_attempts=2) as second,
        ):
            (recovered,) = second.recovered_steps
            assert recovered.rollout_ids == step.rollout_ids
            assert second.proxy.url != first_proxy
            with anyio.fail_after(STEP_TIMEOUT):
                report = await recovered.wait()
        tg.cancel_scope.cancel()
    assert report.metrics["step/n_completed"] == 1, report.metrics
    assert report.metrics["step/n_failed"] == 0
    assert len(seen_endpoints) == 2
    assert seen_endpoints[1].startswith(second.proxy.url)
