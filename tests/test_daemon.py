"""AgentDaemon end to end on loopback: agents (openai SDK via run_agents) -> proxy -> mock vLLM -> batches."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import anyio
import openai
import pytest

from aglverl import LLM, AgentDaemon, BatchConfig, LLMProxy, ProxyLLM, Rollout, SignalConfig, run_agents
from aglverl.client import AgentClient
from aglverl.daemon import DaemonConfig, ProxyConfig
from aglverl.proxy import OverloadPolicy, RetryPolicy
from aglverl.testing.mock_vllm import MockVLLM

pytestmark = pytest.mark.anyio

BATCH = BatchConfig(max_prompt_length=256, max_response_length=16)


def _chat_agent(turns: int, *, stream: bool = False):
    """An agent that holds a multi-turn chat through the per-rollout URL and scores the last answer."""

    async def agent(task_input, llm: LLM) -> float:
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": f"question {task_input['q']}"}]
        try:
            for _ in range(turns):
                if stream:
                    parts = []
                    async for chunk in await client.chat.completions.create(
                        model=llm.model, messages=messages, max_tokens=4, stream=True
                    ):
                        if chunk.choices and chunk.choices[0].delta.content:
                            parts.append(chunk.choices[0].delta.content)
                    content = "".join(parts)
                else:
                    reply = await client.chat.completions.create(
                        model=llm.model, messages=messages, max_tokens=4
                    )
                    content = reply.choices[0].message.content or ""
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
        finally:
            await client.close()
        return float(task_input["q"] % 2)

    return agent


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_step_through_proxy_yields_batch_with_the_backends_token_ids(stream: bool) -> None:
    # Relayed as text (token_in=False): the mock's chat answers for re-rendered histories, one row per call
    # (tests/test_tokenin.py has the same agents generated from ids, one row per conversation).
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=BATCH, token_in=False) as daemon,
    ):
        assert isinstance(daemon.main_llm(), ProxyLLM)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, _chat_agent(2, stream=stream), concurrency=4))
            step = await daemon.submit([{"q": 1}, {"q": 2}], n=2)
            with anyio.fail_after(20):
                batch = await daemon.batches.receive()
            tg.cancel_scope.cancel()
    data = batch.data
    assert batch.step == step.number
    assert len(data) == 8  # 2 samples x n=2 x 2 turns
    assert batch.metrics["step/n_rollouts_with_proxy_triplets"] == 4
    # Every row's ids are exactly what the mock answered for that call.
    answered = {}
    for seen in mock.generation_requests():
        ((prompt, response),) = mock.expected(seen.json)
        answered[tuple(prompt)] = response
    prompts = data.batch["prompts"]
    mask = data.batch["attention_mask"][:, : BATCH.max_prompt_length].bool()
    for row in range(len(data)):
        prompt = prompts[row][mask[row]].tolist()
        response = data.batch["responses"][row][: int(data.batch["response_mask"][row].sum())].tolist()
        assert answered[tuple(prompt)] == response
    # Rewards: q % 2 on the last response token of every turn, GRPO groups per sample.
    scores = data.batch["token_level_scores"].sum(-1).tolist()
    assert sorted(scores) == [0.0] * 4 + [1.0] * 4
    uids = list(data.non_tensor_batch["uid"])
    assert len(set(uids)) == 2 and all(uids.count(u) == 4 for u in set(uids))
    assert sorted(data.non_tensor_batch["turn_index_list"].tolist()) == [0, 0, 0, 0, 1, 1, 1, 1]


async def test_validation_step_returns_metrics() -> None:
    async with (
        MockVLLM(completion_tokens=3) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=BATCH) as daemon,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, _chat_agent(1), concurrency=2))
            with anyio.fail_after(20):
                metrics = await daemon.validate([{"q": 1}, {"q": 3}, {"q": 4}])
            tg.cancel_scope.cancel()
    assert metrics["val/n_rollouts"] == 3
    assert metrics["val/reward"] == pytest.approx(2 / 3)
    assert metrics["val/turn_count"] == 1 and metrics["val/mean_response_length"] == 3


async def test_agent_exception_becomes_a_failed_attempt_that_is_retried() -> None:
    calls = 0

    async def flaky(task_input, llm: LLM) -> float:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("tool crashed")
        return 1.0

    async with AgentDaemon(batch=BATCH, max_attempts=2) as daemon, anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_agents(daemon.server_url, flaky, concurrency=1))
        step = await daemon.submit([{"q": 0}])
        with anyio.fail_after(20):
            report = await step.wait()
        tg.cancel_scope.cancel()
    assert calls == 2
    assert report.metrics["step/n_completed"] == 1 and report.metrics["step/n_requeued"] == 1


async def test_agents_cancelled_mid_long_poll_do_not_swallow_the_next_step() -> None:
    async with AgentDaemon(batch=BATCH) as daemon:
        async with anyio.create_task_group() as doomed:
            doomed.start_soon(lambda: run_agents(daemon.server_url, _chat_agent(1), concurrency=8))
            with anyio.fail_after(10):
                while len(daemon.store._waiters) < 8:  # noqa: ASYNC110  # test side: nothing signals 'parked in the store'
                    await anyio.sleep(0.01)
            doomed.cancel_scope.cancel()  # eight agents vanish while parked in GET /task?wait=...
        step = await daemon.submit([{"q": i} for i in range(6)])

        async def reward_one(task_input, llm: LLM) -> float:
            return 1.0

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, reward_one, concurrency=2))
            with anyio.fail_after(10):
                report = await step.wait()
            tg.cancel_scope.cancel()
    assert report.metrics["step/n_completed"] == 6
    assert report.metrics["step/n_requeued"] == 0  # nothing waited for a lease to expire


async def test_agent_lightning_server_verbs_work_against_the_daemon() -> None:
    async with AgentDaemon(batch=BATCH) as daemon, AgentClient(daemon.server_url) as client:
        rid = await daemon.queue_task({"q": 7}, mode="val", metadata={"source": "old"})
        task = await client.next_task(wait=1)
        assert task is not None and task.rollout_id == rid and task.metadata == {"source": "old"}
        assert await daemon.get_completed_rollout(rid) is None
        async with anyio.create_task_group() as tg:

            async def report() -> None:
                await client.post_rollout(Rollout(rollout_id=rid, final_reward=0.75))

            tg.start_soon(report)
            with anyio.fail_after(5):
                rollout = await daemon.wait_for_rollout(rid, timeout=10)
        assert rollout is not None and rollout.final_reward == 0.75
        other = await daemon.queue_task({"q": 8})
        task = await client.next_task(wait=1)
        assert task is not None
        await client.post_rollout(Rollout(rollout_id=other, final_reward=0.5))
        assert [r.rollout_id for r in await daemon.retrieve_completed_rollouts()] == [other]
        assert await daemon.retrieve_completed_rollouts() == []


async def test_plain_llm_resource_for_agent_lightning_01_clients() -> None:
    async with (
        AgentDaemon(llm_resource="plain", model="m") as daemon,
        AgentClient(daemon.server_url) as client,
    ):
        update = await client.resources()
        assert update is not None
        llm = update.resources["main_llm"]
        assert type(llm) is LLM and llm.endpoint == f"{daemon.proxy_url}/v1" and llm.model == "m"


async def test_leaving_the_block_shuts_everything_down() -> None:
    threads_before = set(threading.enumerate())
    tasks_before = asyncio.all_tasks()
    async with MockVLLM() as mock:
        async with AgentDaemon(backends=[mock.url], model="mock", batch=BATCH) as daemon:
            addresses = [daemon.server_url, daemon.proxy_url]
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: run_agents(daemon.server_url, _chat_agent(1), concurrency=3))
                step = await daemon.submit([{"q": 1}])
                with anyio.fail_after(20):
                    await daemon.batches.receive()
                tg.cancel_scope.cancel()
            await step.wait()
    for url in addresses:
        host, port = url.removeprefix("http://").split(":")
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=1).close()
    assert asyncio.all_tasks() - tasks_before == set()
    # Idle pool threads of the event loop itself may stay: anyio's worker threads (batches are built off the
    # loop) and asyncio's default executor (aiohttp resolves host names there). The loop owns and closes them.
    loop_pools = ("AnyIO worker", "asyncio_")
    left = [t for t in set(threading.enumerate()) - threads_before if not t.name.startswith(loop_pools)]
    assert left == []


async def test_heartbeats_keep_a_long_rollout_from_being_requeued() -> None:
    async def slow(task_input, llm: LLM) -> float:
        await anyio.sleep(0.8)  # longer than the lease
        return 1.0

    async with AgentDaemon(batch=BATCH, lease_seconds=0.3) as daemon, anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_agents(daemon.server_url, slow, concurrency=2, heartbeat_seconds=0.1))
        step = await daemon.submit([{"q": 0}])
        with anyio.fail_after(10):
            report = await step.wait()
        tg.cancel_scope.cancel()
    assert report.metrics["step/n_completed"] == 1 and report.metrics["step/n_requeued"] == 0


# ---------------------------------------------------------------------------------------------- sampling
TRAINER_SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_tokens": 5}


async def _one_call(daemon: AgentDaemon, **params: object) -> tuple[str, object]:
    """Queue one task, claim it like an agent and make one chat call on its proxy URL with ``params``."""
    rollout_id = await daemon.queue_task({"q": 1})
    async with AgentClient(daemon.server_url) as agent:
        task = await agent.next_task()
        assert task is not None and task.rollout_id == rollout_id
        llm = (await agent.resources(task.resources_id)).resources["main_llm"]
        assert isinstance(llm, ProxyLLM)
        client = openai.AsyncOpenAI(
            base_url=llm.get_base_url(task.rollout_id, task.attempt_id), api_key="-", max_retries=0
        )
        try:
            reply: object = await client.chat.completions.create(
                model="mock", messages=[{"role": "user", "content": "hi"}], **params
            )
        except openai.BadRequestError as exc:
            reply = exc
        finally:
            await client.close()
        await agent.post_rollout(
            Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
        )
    return rollout_id, reply


async def test_the_proxy_fills_in_the_trainers_sampling_parameters_and_records_them() -> None:
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", sampling_parameters=TRAINER_SAMPLING) as daemon,
    ):
        rollout_id, _ = await _one_call(daemon)  # the agent names no sampling parameter at all
        sent = mock.generation_requests()[-1].json
        assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["max_tokens"]) == (1.0, 0.9, 20, 5)
        (call,) = daemon.store.record(rollout_id).calls
        assert call.sampling == {"temperature": 1.0, "top_p": 0.9, "top_k": 20.0}
        assert call.off_policy is False
        # the same values set explicitly are on-policy too (top_k given as -1/0 means none: only 20 is equal)
        _, reply = await _one_call(daemon, temperature=1.0, top_p=0.9, max_tokens=3, extra_body={"top_k": 20})
        assert not isinstance(reply, Exception)
        assert mock.generation_requests()[-1].json["max_tokens"] == 3  # an agent's own limit is kept
        assert daemon.proxy.m_sampling.value("filled") == 1  # the second call named all of them


async def test_a_call_with_other_sampling_parameters_is_refused_naming_them() -> None:
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", sampling_parameters=TRAINER_SAMPLING) as daemon,
    ):
        before = len(mock.generation_requests())
        rollout_id, reply = await _one_call(daemon, temperature=0.7, presence_penalty=0.5)
        assert isinstance(reply, openai.BadRequestError)
        message = str(reply)
        assert "temperature=0.7" in message and "temperature=1.0" in message and "presence_penalty" in message
        assert "sampling_mismatch" in message
        assert len(mock.generation_requests()) == before  # never forwarded
        assert daemon.store.record(rollout_id).calls == []
        assert daemon.proxy.m_sampling.value("refused") == 1


async def test_under_the_mask_rule_an_off_policy_call_is_kept_and_its_row_masked() -> None:
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(
            backends=[mock.url],
            model="mock",
            sampling_parameters=TRAINER_SAMPLING,
            sampling_mismatch="mask",
            batch=BATCH,
        ) as daemon,
    ):
        rollout_id, reply = await _one_call(daemon, temperature=0.2)
        assert not isinstance(reply, Exception)
        assert mock.generation_requests()[-1].json["temperature"] == 0.2
        (call,) = daemon.store.record(rollout_id).calls
        assert call.off_policy is True and call.sampling is not None and call.sampling["temperature"] == 0.2
        assert daemon.proxy.m_sampling.value("masked") == 1
        # the row stays in the batch (its reward counts in its group) but is marked not to train
        from aglverl.trajectory.batch import build_batch
        from aglverl.trajectory.rollouts import finished_rollout, trajectory_of

        record = daemon.store.record(rollout_id)
        data, metrics = build_batch([finished_rollout(record, trajectory_of(record), "g")], BATCH)
        assert data.batch["is_drop_mask"].tolist() == [True]
        assert metrics["batch/n_rows_off_policy"] == 1.0


def test_max_buffered_batches_has_no_effect_and_says_so() -> None:
    """The batch stream is a rendezvous (a finished step's batch waits in its step, journaled, until received):
    a bound on buffered batches would mean nothing, so asking for one warns rather than pretending."""
    with pytest.warns(DeprecationWarning, match="max_buffered_batches=...\\) has no effect"):
        AgentDaemon(max_buffered_batches=4)


# ---------------------------------------------------------------------------------------------- settings as values
def test_the_keywords_and_a_daemon_config_build_the_same_daemon_whose_parts_hold_their_values() -> None:
    keywords: dict[str, Any] = {
        "backends": ["http://127.0.0.1:9"],
        "model": "m",
        "token": "s3cret",
        "lease_seconds": 30.0,
        "pause_timeout": 20.0,
        "signal": SignalConfig(request_logprobs=True),
    }
    config = AgentDaemon(**keywords).config
    assert config == DaemonConfig.from_keywords(**keywords)
    assert config.store.lease_seconds == 30.0 and config.backends == ("http://127.0.0.1:9",)
    assert config.proxy.hold_timeout == 20.0  # a hold_timeout left out is pause_timeout, as the keyword says
    assert config.proxy.token == "s3cret"  # one token for the task server and the proxy
    assert config.proxy.request_logprobs  # the trainer's behaviour log-probs: the proxy asks for them
    daemon = AgentDaemon(config=config)
    assert daemon.config is config
    assert isinstance(daemon.proxy, LLMProxy)
    assert daemon.proxy.config is config.proxy and daemon.store.config is config.store  # handed on whole
    assert daemon.collector.signal is config.signal and daemon.collector.batch_config is config.batch
    with pytest.raises(TypeError, match="not both: lease_seconds"):
        AgentDaemon(config=config, lease_seconds=1.0)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match="unexpected keyword argument 'lease_second'; did you mean 'lease_seconds'"
    ):
        AgentDaemon(lease_second=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="token"):
        DaemonConfig(token="a", proxy=ProxyConfig(token="b"))


async def test_a_running_proxy_takes_new_settings_in_every_part_and_refuses_an_assigned_one() -> None:
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock") as daemon,
    ):
        proxy = daemon.proxy
        assert isinstance(proxy, LLMProxy)
        with pytest.raises(AttributeError, match=r"proxy\.reconfigure\(pause_timeout=\.\.\.\)"):
            proxy.pause_timeout = 0.1  # type: ignore[misc]
        await daemon.hold_calls()
        proxy.reconfigure(pause_timeout=0.2, hold_timeout=0.2)  # was 600 s: a held call would wait that long
        client = openai.AsyncOpenAI(base_url=f"{daemon.proxy_url}/v1", api_key="-", max_retries=0)
        try:
            with anyio.fail_after(20), pytest.raises(openai.InternalServerError) as refused:
                await client.chat.completions.create(
                    model="mock", messages=[{"role": "user", "content": "hi"}]
                )
        finally:
            await client.close()
        assert refused.value.status_code == 503  # the gate read the new bound
        assert proxy.pause_timeout == 0.2 and proxy.config.hold_timeout == 0.2


async def test_a_weight_update_freezes_leases_and_holds_calls_until_released_under_the_new_version() -> None:
    """What verl's hooks do around an update, through the daemon alone: the held call's lease does not run out
    however long the update takes, and the call goes on under the version the release names."""
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", lease_seconds=0.5, max_attempts=1) as daemon,
    ):
        await daemon.hold_for_update(drain=False)
        assert daemon.store.leases_frozen and daemon.proxy_counters()["proxy/held_calls"] == 0
        async with anyio.create_task_group() as tg:
            answered = anyio.Event()
            outcome: list[tuple[str, object]] = []

            async def call() -> None:
                outcome.append(await _one_call(daemon))
                answered.set()

            tg.start_soon(call)
            await anyio.sleep(1.5)  # the update outlasts the lease three times over
            assert not answered.is_set() and daemon.proxy_counters()["proxy/held_calls"] == 1
            await daemon.release_after_update(5)
            with anyio.fail_after(20):
                await answered.wait()
        assert not daemon.store.leases_frozen and daemon.weight_version == 5
        ((rollout_id, reply),) = outcome
        assert not isinstance(reply, Exception)
        record = daemon.store.record(rollout_id)
        assert record.state == "completed" and record.num_claims == 1  # the lease never expired
        assert [c.weight_version for c in record.calls] == [5]


#: A value other than the default for every proxy setting (``ProxyConfig``'s fields but host, port, token).
NOT_DEFAULTS: dict[str, Any] = {
    "backend_api_key": "k",
    "retry": RetryPolicy(attempts=5),
    "request_timeout": 7.0,
    "connect_timeout": 2.0,
    "max_body_bytes": 1000,
    "max_response_bytes": 2000,
    "eject_seconds": 3.0,
    "pause_timeout": 9.0,
    "hold_timeout": 11.0,
    "shutdown_grace": 1.0,
    "upstream_keepalive": 2.5,
    "request_logprobs": True,
    "sampling_mismatch": "mask",
    "token_in": False,
    "max_header_lines": 64,
    "max_line_bytes": 4096,
    "head_timeout": 5.0,
    "idle_timeout": 30.0,
    "max_connections": 100,
    "responses_per_attempt": 3,
    "response_bytes_per_attempt": 4096,
    "overload": OverloadPolicy(refuse=False),
}


def test_every_proxy_setting_is_a_daemon_keyword_or_a_field_of_its_proxy_section() -> None:
    """Every field of ``ProxyConfig`` reaches the daemon's proxy as a keyword of the same name (no list of
    them to keep in step by hand), or whole as ``proxy=`` (a config, or a mapping as a run's section has
    them); the keywords change what the section says; ``max_request_bytes`` is ``max_body_bytes``' old name."""
    from aglverl.proxy.config import POLICY_FIELDS

    assert set(NOT_DEFAULTS) == POLICY_FIELDS  # a new setting gets its line here
    default = ProxyConfig()
    assert all(getattr(default, name) != value for name, value in NOT_DEFAULTS.items())
    by_keyword = DaemonConfig.from_keywords(**NOT_DEFAULTS, proxy_port=1234, host="127.0.0.2").proxy
    expected = ProxyConfig(**NOT_DEFAULTS, port=1234, host="127.0.0.2")
    assert by_keyword == expected
    mapping = {
        **NOT_DEFAULTS,
        "retry": {"attempts": 5},
        "overload": {"refuse": False},
        "port": 1234,
        "host": "127.0.0.2",
    }
    assert DaemonConfig.from_keywords(proxy=mapping).proxy == expected
    assert DaemonConfig.from_keywords(proxy=expected).proxy == expected
    changed = DaemonConfig.from_keywords(proxy=expected, pause_timeout=1.0, max_request_bytes=5)
    assert (changed.proxy.pause_timeout, changed.proxy.max_body_bytes, changed.proxy.hold_timeout) == (
        1.0,
        5,
        11.0,
    )
    daemon = AgentDaemon(max_request_bytes=4096)
    assert isinstance(daemon.proxy, LLMProxy)
    assert daemon.proxy.max_body_bytes == daemon.proxy.max_request_bytes == 4096
    with pytest.raises(
        ValueError, match="unknown proxy setting 'pause_timout'; did you mean 'pause_timeout'"
    ):
        DaemonConfig.from_keywords(proxy={"pause_timout": 1.0})
    with pytest.raises(ValueError, match="max_request_bytes is the old name of max_body_bytes"):
        DaemonConfig.from_keywords(max_request_bytes=1, max_body_bytes=2)
