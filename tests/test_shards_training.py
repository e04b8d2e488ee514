"""Training through ``AsyncVERL`` with the LLM proxy as two shards (``aglverl.proxy_shards: 2``), on a Ray cluster
of two simulated nodes on this machine (loopback only; verl's worker and its rollout replica on the second node,
the shards beside it, the driver on the head): every call the agents made is recorded under its rollout and
shard, a shard killed with SIGKILL mid-step loses nothing and trains nothing twice, and a weight update holds
calls on both shards. One cluster for the module."""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import ray

from aglverl import LLM, AsyncVERL
from aglverl.algorithm import compose_config, verl_runtime
from aglverl.proxy.shards import ProxyShards

pytestmark = pytest.mark.anyio

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRAIN = [{"prompt": "Say yes.", "id": i} for i in range(16)]


def config(mode: str, steps: int) -> dict[str, Any]:
    return {
        "ray_kwargs": {"ray_init": {"address": os.environ["RAY_ADDRESS"]}},  # the module's cluster, named
        "data": {"train_batch_size": 2, "max_prompt_length": 96, "max_response_length": 32, "shuffle": False},
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "total_training_steps": steps,
            "val_before_train": False,
            "test_freq": -1,
            "save_freq": -1,
            "v1": {"trainer_mode": mode},
        },
        "aglverl": {"journal": None, "proxy_shards": 2, "agents": 8},
    }


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def two_nodes(tiny_model: Path) -> Iterator[Any]:
    """Two Ray nodes on loopback: the head (the driver's) with CPUs only, the second with the (fake) GPU verl's
    worker pool asks for, so the rollout replica and the shards beside it run off the driver's node."""
    from ray.cluster_utils import Cluster

    from aglverl.verl_plugin.patches import loopback_only_ray

    loopback_only_ray()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 16,
            "num_gpus": 0,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    saved = os.environ.get("RAY_ADDRESS")
    try:
        cluster.add_node(num_cpus=8, num_gpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address  # AsyncVERL joins it, as it joins a real cluster
        composed, _ = compose_config(config("sync", 1))
        with ExitStack() as stack:
            stack.enter_context(verl_runtime(composed))
            yield cluster
    finally:
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved
        cluster.shutdown()


class Lineage:
    """Agents (two chat turns each, the first answer echoed as text) and what the run did, observed: every
    attempt's calls and shard as the agent made them, each result the store accepted, each training group's
    rollouts and recorded calls as the producer filed them, each step's groups as the trainer took them."""

    def __init__(self) -> None:
        self.algo: AsyncVERL | None = None
        self.made: dict[tuple[str, str], tuple[str, int]] = {}  # (rollout, attempt) -> (shard URL, calls)
        self.accepted: list[tuple[str, str]] = []
        self.groups: dict[str, list[str]] = {}
        self.filed: dict[
            str, dict[str, Any]
        ] = {}  # rollout -> attempt, its calls' attempts, rows' call counts
        self.steps: list[tuple[int, list[str]]] = []
        self.kill_after: int | None = None  # kill the second shard when the N-th agent is on it
        self.killed: tuple[str, str] | None = None
        self.answers = 0

    @property
    def shards(self) -> ProxyShards:
        assert self.algo is not None and isinstance(self.algo.daemon.proxy, ProxyShards)
        return self.algo.daemon.proxy

    async def agent(self, task: dict[str, Any], llm: LLM) -> float:
        shard_url, _, rest = llm.endpoint.partition("/rollout/")
        rollout_id, _, rest = rest.partition("/attempt/")
        attempt_id = rest.split("/", 1)[0]
        key = (rollout_id, attempt_id)
        messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
        async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0) as client:
            for turn in range(2):
                reply = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=8)
                self.made[key] = (shard_url, turn + 1)
                self.answers += 1
                victim = self.shards.shards[1]
                if (
                    self.kill_after is not None
                    and self.answers >= self.kill_after
                    and shard_url == victim.url
                ):
                    self.kill_after = None
                    self.killed = key
                    os.kill(await victim.actor.pid.remote(), signal.SIGKILL)
                    return 1.0  # this attempt is void (its calls died with the shard): its result is refused
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": f"Tool: noted {turn}."},
                ]
        return float((reply.choices[0].message.content or "").count("e") % 2)

    def observe(self, daemon: Any) -> None:
        store, producer = daemon.store, daemon.producer
        submit, dispatch, take_stats, finished = (
            store.submit_result,
            producer.dispatch,
            producer.take_stats,
            producer.sink.finished,
        )

        def logged_submit(rollout: Any) -> str:
            message = submit(rollout)
            if message.endswith("received and stored"):
                self.accepted.append((rollout.rollout_id, rollout.attempt_id))
            return message

        def logged_dispatch(prompts: Any, **kwargs: Any) -> None:
            dispatch(prompts, **kwargs)
            for prompt in prompts:
                if prompt.partition == "train":
                    self.groups[prompt.uid] = producer._groups[prompt.uid].rollout_ids

        def logged_take_stats(uids: Any) -> Any:
            assert self.algo is not None
            self.steps.append((int(self.algo.trainer.global_steps), sorted(set(uids))))
            return take_stats(uids)

        async def logged_finished(group: Any) -> None:
            rows = Counter()
            for session, n_calls in zip(group.sessions.tolist(), group.n_calls.tolist(), strict=True):
                rows[session] += n_calls
            for session, record in enumerate(group.records):
                self.filed[record.rollout_id] = {
                    "attempt": record.attempt_id,
                    "state": record.state,
                    "call_attempts": [c.attempt_id for c in record.calls],
                    "row_calls": rows[session],
                }
            await finished(group)

        store.submit_result, producer.dispatch, producer.take_stats = (
            logged_submit,
            logged_dispatch,
            logged_take_stats,
        )
        producer.sink.finished = logged_finished

    def check(self, steps: int) -> dict[str, float]:
        """Every step trained once; each trained rollout answered once, by an attempt whose every call the proxy
        recorded (and nothing else); per shard, the calls recorded are the calls the agents made there."""
        assert [n for n, _ in self.steps] == list(range(1, steps + 1)), self.steps
        assert max(Counter(rid for rid, _ in self.accepted).values()) == 1, "a rollout was answered twice"
        accepted = dict(self.accepted)
        per_shard: Counter[str] = Counter()
        trained_uids = [uid for _, uids in self.steps for uid in uids]
        assert len(trained_uids) == len(set(trained_uids)), "a group was trained twice"
        for uid in trained_uids:
            for rollout_id in self.groups[uid]:
                filed = self.filed[rollout_id]
                attempt = accepted[rollout_id]
                assert filed["state"] == "completed" and filed["attempt"] == attempt
                shard_url, made = self.made[(rollout_id, attempt)]
                assert filed["call_attempts"] == [attempt] * made == [attempt] * 2  # every call, only its own
                assert filed["row_calls"] == made  # and every one of them in the group's rows
                per_shard[shard_url] += made
        assert len(per_shard) >= 2, per_shard  # both shards served trained rollouts
        return {url: float(n) for url, n in per_shard.items()}


async def test_sync_training_spreads_agents_over_two_shards_and_survives_one_killed_mid_step(
    two_nodes: Any,
) -> None:
    steps = 4
    lineage = Lineage()
    lineage.kill_after = 9  # during step 2 or 3, on the second shard
    algo = lineage.algo = AsyncVERL(config("sync", steps), agent=lineage.agent, progress=False)
    algo.on_serving.append(lineage.observe)
    metrics: dict[int, dict[str, float]] = {}
    algo.on_step.append(lambda step, m: metrics.__setitem__(step, dict(m)))
    await algo.run(TRAIN)
    shards = lineage.shards
    replica = next(iter(shards.backend_nodes.values()))
    assert {s.node for s in shards.shards} == {replica}  # beside the rollout replica, off the driver's node
    assert replica != ray.get_runtime_context().get_node_id()
    lineage.check(steps)
    assert (
        lineage.killed is not None and lineage.killed not in lineage.accepted
    )  # the void attempt was refused
    killed_rollout = lineage.killed[0]
    if killed_rollout in lineage.filed:  # its rollout was redone by another attempt (if its group was needed)
        assert lineage.filed[killed_rollout]["attempt"] != lineage.killed[1]
    assert algo.daemon.registry.counter("aglverl_attempts_lost_total", "").value() >= 1
    assert all(m["step/n_completed"] == 4 for m in metrics.values())
    assert metrics[steps]["proxy/calls_ok"] > 0


async def test_colocate_async_training_over_two_shards_records_every_call_and_holds_on_both(
    two_nodes: Any,
) -> None:
    """Agents run ahead of the trainer; at each update the proxy holds new calls on both shards (and continues
    the generations verl aborts), and every trained rollout's calls are recorded on the shard that served it."""
    steps = 3
    lineage = Lineage()
    algo = lineage.algo = AsyncVERL(config("colocate_async", steps), agent=lineage.agent, progress=False)
    algo.on_serving.append(lineage.observe)
    await algo.run(TRAIN)
    lineage.check(steps)
    held = {
        s.index: s.counters.get("proxy/held_calls", 0.0) + s.counters.get("proxy/resumed", 0.0)
        for s in lineage.shards.shards
    }
    assert all(n > 0 for n in held.values()), held  # calls waited for the weight update on both shards


async def test_a_weight_update_holds_calls_on_both_shards_and_they_go_on_under_the_new_weights(
    two_nodes: Any,
) -> None:
    """Two agents, one per shard, each make a call, then a second one while verl's colocate_async update is
    under way: both wait at their shard and are answered under the new weights once the trainer resumes."""
    from helpers.v1 import live_trainer

    from aglverl.client import AgentClient
    from aglverl.models import Rollout

    async with live_trainer(config("colocate_async", 2), TRAIN) as (run, trainer, _):
        daemon = run.daemon
        shards = daemon.proxy
        assert isinstance(shards, ProxyShards)
        before = [await s.actor.calls_admitted.remote() for s in shards.shards]
        holding = anyio.Event()
        first_answers = [anyio.Event(), anyio.Event()]
        versions: dict[str, list[int]] = defaultdict(list)
        urls: list[str] = []

        async def agent(client: AgentClient, task: Any, answered: anyio.Event) -> None:
            llm = (await client.resources(task.resources_id)).resources["main_llm"]
            urls.append(llm.endpoint.split("/rollout/")[0])
            base = llm.get_base_url(task.rollout_id, task.attempt_id)
            async with openai.AsyncOpenAI(base_url=base, api_key="-", max_retries=0) as sdk:
                for _ in range(2):
                    await sdk.chat.completions.create(
                        model=llm.model, messages=[{"role": "user", "content": "Say yes."}], max_tokens=4
                    )
                    if not holding.is_set():
                        answered.set()
                        await holding.wait()
            await client.post_rollout(
                Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
            )

        from aglverl.trajectory.groups import Prompt

        finished = run.producer.sink.finished
        filed = anyio.Event()

        async def observed(group: Any) -> None:  # the group's records as the producer files them
            for record in group.records:
                versions[record.rollout_id] = [c.weight_version for c in record.calls]
            filed.set()
            await finished(group)

        run.producer.sink.finished = observed

        run.producer.dispatch(
            [Prompt("held", {"prompt": "Say yes."}, 2, global_steps=1)], resources_id=run.resources["train"]
        )
        async with AgentClient(daemon.server_url) as client:
            tasks = [await client.next_task(wait=30) for _ in range(2)]
            with anyio.fail_after(180):
                async with anyio.create_task_group() as tg:
                    for task, answered in zip(tasks, first_answers, strict=True):
                        tg.start_soon(agent, client, task, answered)
                    for answered in first_answers:
                        await answered.wait()
                    trainer.global_steps = 2
                    await anyio.to_thread.run_sync(trainer.on_step_begin)
                    await anyio.to_thread.run_sync(trainer.on_sample_end)  # hold on both shards, abort, sleep
                    holding.set()  # the agents' second calls now wait at their shards
                    for shard, count in zip(shards.shards, before, strict=True):
                        await shard.actor.calls_admitted.remote(count + 2)
                    await anyio.to_thread.run_sync(trainer.on_step_end)  # weights of step 2, resume on both
                await filed.wait()
        await daemon.refresh_proxy_figures()
        held = {s.index: s.counters["proxy/held_calls"] for s in shards.shards}
    assert sorted(urls) == sorted(shards.urls)  # one agent on each shard
    assert held == {0: 1.0, 1: 1.0}  # each shard held its agent's second call through the update
    assert sorted(versions.values()) == [[0, 2], [0, 2]]  # the held calls answered under the new weights
