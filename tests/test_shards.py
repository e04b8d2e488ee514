"""``AgentDaemon(proxy_shards=2)``: the LLM proxy as two Ray actors on a Ray cluster of two simulated nodes on this
machine (loopback only), in front of the mock backend. Agents' attempts are pinned to shards and call them
through their task's resources; shards admit calls from the table the store pushes, keep the records until
``POST /rollout`` takes them, follow the gate, and a shard killed with SIGKILL voids its attempts and comes back.
One Ray cluster for the module."""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import openai
import pytest
from helpers.tokenin import chat_turn

from aglverl import LLM, AgentDaemon, BatchConfig, Rollout, run_agents
from aglverl.client import AgentClient, TaskServerError
from aglverl.proxy.shard import ShardRestarted
from aglverl.proxy.shards import ProxyShards, place_shards
from aglverl.testing.mock_vllm import MockVLLM

pytestmark = pytest.mark.anyio

BATCH = BatchConfig(max_prompt_length=256, max_response_length=256)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine, listening on loopback only; ended with the module."""
    import ray
    from ray.cluster_utils import Cluster

    from aglverl.verl_plugin.patches import loopback_only_ray

    loopback_only_ray()
    head = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


@pytest.fixture
async def mock() -> Any:
    async with MockVLLM(completion_tokens=4) as backend:
        yield backend


def _daemon(mock: MockVLLM, **kwargs: Any) -> AgentDaemon:
    return AgentDaemon(backends=[mock.url], model="mock", batch=BATCH, proxy_shards=2, **kwargs)


def _shards(daemon: AgentDaemon) -> ProxyShards:
    assert isinstance(daemon.proxy, ProxyShards)
    return daemon.proxy


async def _claim(agent: AgentClient) -> tuple[Any, str]:
    """A claimed task and its attempt's base URL, from the task's own resources (as an agent gets it)."""
    task = await agent.next_task(wait=10)
    assert task is not None and task.attempt_id is not None
    update = await agent.resources(task.resources_id)
    assert update is not None
    llm = update.resources["main_llm"]
    assert isinstance(llm, LLM)
    return task, llm.get_base_url(task.rollout_id, task.attempt_id)


async def _chat(base: str, text: str = "hello") -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as http:
        body = {"model": "mock", "messages": [{"role": "user", "content": text}], "max_tokens": 3}
        async with http.post(f"{base}/chat/completions", json=body) as response:
            await response.read()
            return response


async def test_agents_spread_over_two_shards_on_two_nodes_and_every_call_is_recorded(
    ray_cluster: Any, mock: MockVLLM
) -> None:
    """8 rollouts of 3-turn chats (half of them streamed) that echo their history as text: the attempts spread
    over both shards (one per node), each agent calls its own shard, and each conversation trains as one row
    of the ids the backend generated (token-in sessions live in the shard that serves the attempt)."""
    used: Counter[str] = Counter()

    async def agent(task: dict[str, Any], llm: LLM) -> float:
        used[llm.endpoint.split("/rollout/")[0]] += 1
        messages: list[Any] = [{"role": "user", "content": f"question {task['q']}"}]
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0)
        try:
            for turn in range(3):
                answer = await chat_turn(client, messages, task["q"] % 2 == 0, model=llm.model)
                messages += [
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": f"tool result {turn}"},
                ]
        finally:
            await client.close()
        return 1.0

    async with _daemon(mock) as daemon:
        shards = _shards(daemon)
        assert len({s.node for s in shards.shards}) == 2  # one shard on each node
        assert all(url.startswith("http://127.0.0.1:") for url in shards.urls)  # the node's address: loopback
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, agent, concurrency=8))
            await daemon.submit([{"q": q} for q in range(4)], n=2)
            with anyio.fail_after(60):
                batch = await daemon.batches.receive()
            tg.cancel_scope.cancel()
        await daemon.refresh_proxy_figures()
        counters = daemon.proxy_counters()
        per_shard = {s.index: s.counters["proxy/calls_ok"] for s in shards.shards}
        async with aiohttp.ClientSession() as http, http.get(f"{daemon.server_url}/metrics") as response:
            metrics = await response.text()
    assert set(used) == set(shards.urls) and sum(used.values()) == 8  # both shards served attempts
    assert (
        batch.metrics["batch/n_calls"] == 24 and len(batch.data) == 8
    )  # every call, one row per conversation
    assert batch.metrics["batch/n_calls_drifted"] == 0
    assert Counter(batch.data.non_tensor_batch["rollout_id_list"]).most_common(1)[0][1] == 1
    assert (
        counters["proxy/calls_ok"] == 24 == len(mock.generation_requests())
    )  # one request per call, token-in too
    assert all(n > 0 for n in per_shard.values()) and sum(per_shard.values()) == 24
    assert counters["proxy/token_in_generated"] == 16  # each later turn generated from the earlier ids
    for index in (0, 1):  # /metrics renders every shard's registry, labelled
        assert f'aglverl_proxy_calls_total{{shard="{index}",outcome="ok"}} {per_shard[index]:g}' in metrics
    assert metrics.count("# TYPE aglverl_proxy_calls_total counter") == 1


async def test_shards_admit_only_what_the_table_says_and_records_are_taken_at_post(
    ray_cluster: Any, mock: MockVLLM
) -> None:
    """A claimed attempt's calls go through on its own shard only; a made-up attempt is a 404 and a finished
    rollout's a 409, never forwarded; the result's post takes the shard's records into the store."""
    async with _daemon(mock) as daemon, AgentClient(daemon.server_url) as agent:
        shards = _shards(daemon)
        rid = await daemon.queue_task({"q": 1})
        task, base = await _claim(agent)
        assert task.rollout_id == rid
        mine = next(s for s in shards.shards if base.startswith(s.url + "/"))
        other = next(s for s in shards.shards if s is not mine)
        assert task.resources_id.endswith(f"@shard{mine.index}-0")
        assert (await _chat(base)).status == 200
        assert (await _chat(base, "again")).status == 200
        before = len(mock.generation_requests())
        for url in (
            base.replace(mine.url, other.url),  # pinned elsewhere
            base.replace(task.attempt_id, "attempt-made-up"),
            f"{mine.url}/rollout/rollout-made-up/attempt/{task.attempt_id}/v1",
        ):
            assert (await _chat(url)).status == 404, url
        assert daemon.store.record(rid).calls == []  # still on the shard
        await agent.post_rollout(Rollout(rollout_id=rid, attempt_id=task.attempt_id, final_reward=1.0))
        calls = daemon.store.record(rid).calls
        assert [c.attempt_id for c in calls] == [task.attempt_id] * 2 and all(c.has_token_ids for c in calls)
        requests = mock.generation_requests()
        assert [c.response_token_ids for c in calls] == [mock.expected(r.json)[0][1] for r in requests]
        refused = await _chat(base)
        assert refused.status == 409
        assert len(mock.generation_requests()) == before  # nothing refused was forwarded


async def test_pause_hold_and_resume_reach_every_shard(ray_cluster: Any) -> None:
    """``pause_calls`` returns once both shards drained; calls arriving while held wait on both shards and go on
    under the version ``resume_calls`` gives."""
    async with (
        MockVLLM(completion_tokens=4, latency=0.3) as mock,
        _daemon(mock) as daemon,
        AgentClient(daemon.server_url) as agent,
    ):
        shards = _shards(daemon)
        for q in range(4):
            await daemon.queue_task({"q": q})
        claimed = [await _claim(agent) for _ in range(4)]
        bases = [base for _, base in claimed]
        assert {next(s.index for s in shards.shards if b.startswith(s.url)) for b in bases} == {0, 1}
        async with anyio.create_task_group() as tg:
            for base in bases[:2]:
                tg.start_soon(_chat, base)
            with anyio.fail_after(20):
                await mock.wait_until(lambda m: m.active == 2)  # one call in flight on each shard
                await daemon.pause_calls()
            assert mock.completed == 2  # both drained before pause returned
        await daemon.resume_calls(3)
        await daemon.hold_calls()
        admitted = [await s.actor.calls_admitted.remote() for s in shards.shards]
        async with anyio.create_task_group() as tg:
            for base in bases[2:]:
                tg.start_soon(_chat, base)
            with anyio.fail_after(20):
                for shard, count in zip(shards.shards, admitted, strict=True):
                    await shard.actor.calls_admitted.remote(count + 1)  # each shard has its held call
            assert mock.completed == 2 and mock.active == 0  # none went on while held
            await daemon.resume_calls(7)
        await daemon.refresh_proxy_figures()
        assert daemon.proxy_counters()["proxy/held_calls"] == 2
        for task, _ in claimed:
            await agent.post_rollout(
                Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=0.0)
            )
        versions = [
            c.weight_version for task, _ in claimed for c in daemon.store.record(task.rollout_id).calls
        ]
    assert versions == [0, 0, 7, 7]
    assert mock.completed == 4


async def test_a_shard_killed_with_sigkill_voids_its_attempts_and_serves_again(
    ray_cluster: Any, mock: MockVLLM
) -> None:
    """SIGKILL on one shard's process: its attempt's late result is refused (409), the rollout is handed out
    again and finishes through a live shard, the killed shard serves again with an empty table, and nothing
    of the other shard's attempt is lost."""
    async with _daemon(mock) as daemon, AgentClient(daemon.server_url) as agent:
        shards = _shards(daemon)
        step = await daemon.submit([{"q": 1}, {"q": 2}], n=1)
        (first, first_base), (second, second_base) = [await _claim(agent) for _ in range(2)]
        for base in (first_base, second_base):
            assert (await _chat(base)).status == 200
        victim = next(s for s in shards.shards if second_base.startswith(s.url + "/"))
        dead = victim.incarnation
        restarts = daemon.registry.counter("aglverl_proxy_shard_restarts_total", "")
        os.kill(await victim.actor.pid.remote(), signal.SIGKILL)
        with pytest.raises(TaskServerError) as refused:
            await agent.post_rollout(
                Rollout(rollout_id=second.rollout_id, attempt_id=second.attempt_id, final_reward=1.0)
            )
        assert refused.value.status == 409 and "void" in refused.value.detail
        try:  # the dead process's address serves it no more (a restarted process would not know it: a 404)
            assert (await _chat(second_base)).status == 404
        except aiohttp.ClientConnectionError:
            pass
        with anyio.fail_after(60):
            await shards.wait_up()
        assert restarts.value() == 1 and victim.incarnation != dead
        with pytest.raises(ShardRestarted):  # what a take meant for the dead process gets from the new one
            await victim.actor.take.remote(dead, second.rollout_id, second.attempt_id)
        again, again_base = await _claim(agent)  # the same rollout, a new attempt
        assert again.rollout_id == second.rollout_id and again.attempt_id != second.attempt_id
        assert (await _chat(again_base, "once more")).status == 200
        for task in (first, again):
            await agent.post_rollout(
                Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
            )
        with anyio.fail_after(20):
            batch = await daemon.batches.receive()
        assert batch.step == step.number
        records = [daemon.store.record(rid) for rid in step.rollout_ids]
        await daemon.refresh_proxy_figures()
        lost = daemon.registry.counter("aglverl_attempts_lost_total", "").value()
    assert [r.state for r in records] == ["completed", "completed"]
    assert [[c.attempt_id for c in r.calls] for r in records] == [[first.attempt_id], [again.attempt_id]]
    assert len(batch.data) == 2  # each rollout's one call: the first attempt's, and the new attempt's
    assert lost == 1


async def test_a_shard_restarted_during_a_hold_comes_back_holding_with_its_new_attempts_admitted(
    ray_cluster: Any, mock: MockVLLM
) -> None:
    """The table and the gate are sent again to a restarted shard: killed while the trainer holds calls, it
    serves again held, admits the attempt pinned to it since, and lets its call go on at the resume."""
    async with _daemon(mock) as daemon, AgentClient(daemon.server_url) as agent:
        shards = _shards(daemon)
        for q in range(2):
            await daemon.queue_task({"q": q})
        (_, _), (second, second_base) = [await _claim(agent) for _ in range(2)]
        victim = next(s for s in shards.shards if second_base.startswith(s.url + "/"))
        await daemon.hold_calls()
        os.kill(await victim.actor.pid.remote(), signal.SIGKILL)
        with pytest.raises(TaskServerError) as refused:  # its attempt is void, the task queued again
            await agent.post_rollout(
                Rollout(rollout_id=second.rollout_id, attempt_id=second.attempt_id, final_reward=1.0)
            )
        assert refused.value.status == 409
        with anyio.fail_after(60):
            await shards.wait_up()
        again, again_base = await _claim(agent)
        assert again.rollout_id == second.rollout_id and again_base.startswith(
            victim.url + "/"
        )  # least loaded
        async with anyio.create_task_group() as tg:
            tg.start_soon(_chat, again_base)
            with anyio.fail_after(20):
                await victim.actor.calls_admitted.remote(1)
            assert mock.generation_requests() == []  # held on the restarted shard
            await daemon.resume_calls(5)
        await agent.post_rollout(
            Rollout(rollout_id=again.rollout_id, attempt_id=again.attempt_id, final_reward=1.0)
        )
        calls = daemon.store.record(again.rollout_id).calls
        await daemon.refresh_proxy_figures()
    assert [(c.attempt_id, c.weight_version) for c in calls] == [(again.attempt_id, 5)]
    assert victim.counters["proxy/held_calls"] == 1


class HeldActor:
    """A shard's Ray actor handle with one method held: a call of it waits for :attr:`release` (set by the
    test), then goes on to the actor, or fails with ``error`` as a call sent to a process that died meanwhile
    does. It fixes the order of two concurrent things (a reply and a death) that Ray leaves to the machine."""

    def __init__(self, actor: Any, method: str, error: BaseException | None = None) -> None:
        self.actor = actor
        self.method = method
        self.error = error
        self.sent = anyio.Event()
        self.release = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        if name == self.method:
            return self
        return getattr(self.actor, name)

    def remote(self, *args: Any) -> Any:
        return self._held(*args)

    async def _held(self, *args: Any) -> Any:
        self.sent.set()
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return await getattr(self.actor, self.method).remote(*args)


@asynccontextmanager
async def _second_shard_held(
    daemon: AgentDaemon, agent: AgentClient, method: str, error: BaseException | None = None
) -> AsyncIterator[tuple[Any, Any, HeldActor]]:
    """Two tasks claimed, one on each shard; the second's shard with ``method`` held (:class:`HeldActor`) until
    the block is left: ``(second task, its shard, the held handle)``."""
    for q in range(2):
        await daemon.queue_task({"q": q})
    (_, _), (second, second_base) = [await _claim(agent) for _ in range(2)]
    victim = next(s for s in _shards(daemon).shards if second_base.startswith(s.url + "/"))
    held = victim.actor = HeldActor(victim.actor, method, error)
    try:
        yield second, victim, held
    finally:
        victim.actor = held.actor  # ray.kill at the daemon's exit takes the real handle


@pytest.mark.parametrize("read", ["figures", "metrics_text"])
async def test_a_figures_call_in_flight_at_a_shards_death_voids_nothing_of_the_restarted_shard(
    ray_cluster: Any, mock: MockVLLM, read: str
) -> None:
    """A figures (or /metrics) call sent to a shard's process that dies, whose error reaches the driver only
    after Ray restarted the shard and a new attempt was pinned there: the error is of the dead process; the
    new attempt's result is accepted, and the death counts once (one restart, one attempt lost)."""
    import ray

    async with _daemon(mock) as daemon, AgentClient(daemon.server_url) as agent:
        shards = _shards(daemon)
        async with _second_shard_held(daemon, agent, read, ray.exceptions.RayActorError()) as (
            second,
            victim,
            held,
        ):
            pid = await held.actor.pid.remote()
            async with anyio.create_task_group() as tg:
                tg.start_soon(daemon.refresh_proxy_figures if read == "figures" else shards.metrics_text)
                with anyio.fail_after(20):
                    await held.sent.wait()  # in flight to the process about to die
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(TaskServerError) as refused:
                    await agent.post_rollout(
                        Rollout(rollout_id=second.rollout_id, attempt_id=second.attempt_id, final_reward=1.0)
                    )
                assert refused.value.status == 409
                with anyio.fail_after(60):
                    await shards.wait_up()
                again, again_base = await _claim(agent)
                assert again.rollout_id == second.rollout_id and again_base.startswith(victim.url + "/")
                assert (await _chat(again_base)).status == 200
                held.release.set()  # the dead process's error arrives now
        await agent.post_rollout(
            Rollout(rollout_id=again.rollout_id, attempt_id=again.attempt_id, final_reward=1.0)
        )
        calls = daemon.store.record(again.rollout_id).calls
        restarts = daemon.registry.counter("aglverl_proxy_shard_restarts_total", "").value()
        lost = daemon.registry.counter("aglverl_attempts_lost_total", "").value()
    assert [c.attempt_id for c in calls] == [again.attempt_id]
    assert (restarts, lost) == (1, 1)


async def test_a_pause_while_a_shard_restarts_pauses_it_too(ray_cluster: Any, mock: MockVLLM) -> None:
    """``pause_calls`` while a shard's new process has been started but not yet sent its table and gate (the
    driver's sync held by the test): the pause reaches that process too, and the older open gate the sync
    then brings does not open it; no shard serves under the open gate once ``pause_calls`` returned."""
    async with _daemon(mock) as daemon, AgentClient(daemon.server_url) as agent:
        shards = _shards(daemon)
        async with _second_shard_held(daemon, agent, "sync") as (_, victim, held):
            os.kill(await held.actor.pid.remote(), signal.SIGKILL)
            with anyio.fail_after(60):
                await held.sent.wait()  # restarted, serving, its table and gate not sent yet
            assert not victim.up
            with anyio.fail_after(20):
                await daemon.pause_calls()
            assert (await held.actor.figures.remote(0.0))["gate"] == "paused"
            held.release.set()
            with anyio.fail_after(20):
                await shards.wait_up()
            states = [(await s.actor.figures.remote(0.0))["gate"] for s in shards.shards]
            await daemon.resume_calls()
            resumed = [(await s.actor.figures.remote(0.0))["gate"] for s in shards.shards]
    assert states == ["paused", "paused"] and resumed == ["open", "open"]


def _outcomes(daemon: AgentDaemon) -> dict[str, float]:
    """Rollouts completed and failed, and takes a shard did not answer in time (the daemon's registry)."""
    count = lambda name: daemon.registry.counter(name, "").value()  # noqa: E731
    return {
        "completed": count("aglverl_rollouts_completed_total"),
        "failed": count("aglverl_rollouts_failed_total"),
        "take_timeouts": count("aglverl_proxy_shard_take_timeouts_total"),
    }


async def test_a_hung_shard_bounds_post_rollout_and_the_step_still_ends(
    ray_cluster: Any, mock: MockVLLM
) -> None:
    """A shard alive but not answering (its process stopped with SIGSTOP): ``POST /rollout`` of an attempt on
    it gets its 409 ("... is void") after ``take_timeout``, its rollout is failed (one attempt allowed) without
    calls, and the step ends; the other shard's rollout trains with its call."""
    async with _daemon(mock, max_attempts=1) as daemon, AgentClient(daemon.server_url) as agent:
        shards = _shards(daemon)
        shards.take_timeout = 2.0
        step = await daemon.submit([{"q": 1}, {"q": 2}], n=1)
        (first, first_base), (second, second_base) = [await _claim(agent) for _ in range(2)]
        for base in (first_base, second_base):
            assert (await _chat(base)).status == 200
        victim = next(s for s in shards.shards if second_base.startswith(s.url + "/"))
        pid = await victim.actor.pid.remote()
        os.kill(pid, signal.SIGSTOP)
        try:
            await agent.post_rollout(
                Rollout(rollout_id=first.rollout_id, attempt_id=first.attempt_id, final_reward=1.0)
            )
            with anyio.fail_after(20), pytest.raises(TaskServerError) as refused:
                await agent.post_rollout(
                    Rollout(rollout_id=second.rollout_id, attempt_id=second.attempt_id, final_reward=1.0)
                )
            with anyio.fail_after(20):
                batch = await daemon.batches.receive()
        finally:
            os.kill(pid, signal.SIGCONT)
        outcomes = _outcomes(daemon)
    assert refused.value.status == 409 and "did not hand over its LLM calls within 2s" in refused.value.detail
    assert batch.step == step.number and (
        batch.metrics["batch/n_rollouts"],
        batch.metrics["batch/n_calls"],
    ) == (1, 1)
    assert outcomes == {"completed": 1, "failed": 1, "take_timeouts": 1}


async def test_a_failed_rollout_whose_shard_hangs_settles_and_its_step_ends(
    ray_cluster: Any, mock: MockVLLM
) -> None:
    """A rollout whose lease expires (its last attempt) while its shard is stopped: taking its records is
    bounded by ``take_timeout``, so the rollout settles failed without them and its step ends."""
    async with (
        _daemon(mock, max_attempts=1, lease_seconds=5.0) as daemon,
        AgentClient(daemon.server_url) as agent,
    ):
        shards = _shards(daemon)
        shards.take_timeout = 2.0
        step = await daemon.submit([{"q": 1}, {"q": 2}], n=1)
        (first, first_base), (_, second_base) = [await _claim(agent) for _ in range(2)]
        for base in (first_base, second_base):
            assert (await _chat(base)).status == 200
        await agent.post_rollout(
            Rollout(rollout_id=first.rollout_id, attempt_id=first.attempt_id, final_reward=1.0)
        )
        victim = next(s for s in shards.shards if second_base.startswith(s.url + "/"))
        pid = await victim.actor.pid.remote()
        os.kill(pid, signal.SIGSTOP)
        try:
            with anyio.fail_after(40):
                batch = await daemon.batches.receive()  # the second lease expires, the take gives up
        finally:
            os.kill(pid, signal.SIGCONT)
        outcomes = _outcomes(daemon)
    assert batch.step == step.number and (
        batch.metrics["batch/n_rollouts"],
        batch.metrics["batch/n_calls"],
    ) == (1, 1)
    assert outcomes == {"completed": 1, "failed": 1, "take_timeouts": 1}


def test_shards_go_beside_the_backends_nodes_or_on_every_alive_node(ray_cluster: Any) -> None:
    import ray

    alive = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    assert len(alive) == 2
    assert place_shards("per_node") == alive  # no backend placement known: one per alive node
    assert place_shards(3) == [alive[0], alive[1], alive[0]]
    beside = {"http://127.0.0.1:1": alive[1], "http://127.0.0.1:2": alive[1]}
    assert place_shards("per_node", beside) == [alive[1]]  # one per node hosting replicas
    assert place_shards(2, beside) == [alive[1], alive[1]]
    assert place_shards(1, {"http://127.0.0.1:3": "a-node-that-is-gone"}) == [alive[0]]
    with pytest.raises(ValueError, match="proxy_shards must be an integer >= 1 or 'per_node', got 0"):
        AgentDaemon(proxy_shards=0)


async def test_agent_lightnings_proxy_path_reaches_each_attempts_shard(
    ray_cluster: Any, mock: MockVLLM, tmp_path: Any
) -> None:
    """Agent processes (aglverl's runner, a command using the OpenAI SDK's environment) call the task server's
    Agent Lightning proxy path; each call is relayed to the shard its attempt is pinned to, where it is
    recorded: every rollout completes with its call's ids, over both shards."""
    import sys
    from pathlib import Path

    from aglverl.process_runner import ProcessOptions, ProcessRunner

    program = [sys.executable, str(Path(__file__).parent / "helpers" / "agl_style_agents.py"), "sdk"]
    async with _daemon(mock) as daemon:
        runner = ProcessRunner(
            daemon, ProcessOptions.from_mapping({"command": program}), concurrency=4, log_dir=tmp_path
        )
        async with anyio.create_task_group() as tg:
            await tg.start(runner.serve)
            ids = [await daemon.queue_task({"prompt": f"p{i}", "reward": 1.0}) for i in range(6)]
            with anyio.fail_after(120):
                await daemon.store.wait_terminal(ids)
            tg.cancel_scope.cancel()
        records = [daemon.store.record(r) for r in ids]
        await daemon.refresh_proxy_figures()
        per_shard = {s.index: s.counters.get("proxy/calls_ok", 0) for s in _shards(daemon).shards}
    assert all(
        r.state == "completed" and len(r.calls) == 1 and r.calls[0].response_token_ids for r in records
    )
    assert sum(per_shard.values()) == 6 and all(n > 0 for n in per_shard.values())
