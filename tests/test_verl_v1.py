"""aglverl as verl V1's trajectory producer, on one live trainer (verl's sync mode on CPU) and one Ray session:
rows filed in TransferQueue as verl's agent loop files them, the replay buffer waking on the daemon's events,
advantages on whole groups, and the proxy holding calls around the replicas' sleep."""

from __future__ import annotations

import math
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import ray
from helpers.v1 import assert_rows_are_the_engines_chains, live_trainer, multi_turn_agents

from aglverl.models import Rollout, Triplet
from aglverl.store.journal import read_records
from aglverl.trajectory.groups import Prompt
from aglverl.verl_v1 import trained_uids

pytestmark = pytest.mark.anyio

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = {
    # wide enough for a merged three-call chat of the tiny model (calls of 3 ids, the template between), and for
    # the full prompt of a call that drifted (it starts a row of its own)
    "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 48, "shuffle": False},
    "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"total_training_steps": 2, "val_before_train": False, "test_freq": -1, "save_freq": -1},
    "aglverl": {"journal": None},
}
TRAIN = [{"prompt": "Say yes.", "word": "yes", "id": i} for i in range(4)]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, Any]]:
    """verl's V1 trainer, initialised, and the daemon serving as its producer: ``(run, trainer)``; the daemon's
    journal and verl's checkpoints in a directory of their own."""
    directory = tmp_path_factory.mktemp("v1")
    config = {
        **CONFIG,
        "trainer": {**CONFIG["trainer"], "default_local_dir": str(directory / "checkpoints")},
        "aglverl": {"journal": str(directory / "aglverl.journal")},
    }
    async with live_trainer(config, TRAIN) as (run, trainer, _):
        yield run, trainer


def _tq_get(keys: Sequence[str], partition: str = "train", fields: list[str] | None = None) -> Any:
    import transfer_queue as tq

    return tq.kv_batch_get(keys=list(keys), partition_id=partition, select_fields=fields)


def _tq_tags(partition: str = "train") -> dict[str, dict[str, Any]]:
    import transfer_queue as tq

    return (tq.kv_list(partition) or {}).get(partition, {})


def _answer_with_triplets(
    store: Any, plan: dict[tuple[str, int], tuple[float, list[tuple[list[int], list[int]]]]]
) -> int:
    """Claim queued tasks and post, for (group, session), its reward and triplets (prompt ids, response ids)."""
    answered = 0
    while (task := store.try_claim()) is not None:
        reward, turns = plan[(task.metadata["data_id"], task.metadata["session"])]
        triplets = [Triplet(prompt={"token_ids": p}, response={"token_ids": r}) for p, r in turns]
        store.submit_result(
            Rollout(
                rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=reward, triplets=triplets
            )
        )
        answered += 1
    return answered


async def _agents_answer(run: Any, count: int, reply: dict[str, tuple[list[int], list[int]]]) -> None:
    """``count`` agents claim a task each and answer through the proxy with the openai SDK (reward by word)."""
    import openai

    from aglverl.cli.demo import word_reward
    from aglverl.client import AgentClient

    async with AgentClient(run.daemon.server_url) as agent:
        client = openai.AsyncOpenAI(api_key="-", max_retries=0)
        for _ in range(count):
            task = await agent.next_task(wait=30)
            assert task is not None
            llm = (await agent.resources(task.resources_id)).resources["main_llm"]
            answer = await client.with_options(
                base_url=llm.get_base_url(task.rollout_id, task.attempt_id)
            ).chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task.input["prompt"]}]
            )
            text = answer.choices[0].message.content or ""
            # the engine's ids, as vLLM returns them when asked (the proxy asked on the agent's behalf)
            reply[task.rollout_id] = (
                answer.model_extra["prompt_token_ids"],
                answer.choices[0].model_extra["token_ids"],
            )
            await agent.post_rollout(
                Rollout(
                    rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=word_reward(text)
                )
            )
        await client.close()


async def test_a_training_batch_is_filed_and_sampled_the_way_verls_agent_loop_does_it(live: Any) -> None:
    run, trainer = live
    trainer.replay_buffer.poll_interval = 3600.0  # were it still polling, sample() would not return in time
    replies: dict[str, tuple[list[int], list[int]]] = {}
    async with anyio.create_task_group() as tg:
        await anyio.to_thread.run_sync(
            trainer._add_batch_to_generate
        )  # verl's own dispatch: pending tags, then us
        tg.start_soon(_agents_answer, run, 4, replies)
        with anyio.fail_after(120):
            batch, metrics = await anyio.to_thread.run_sync(trainer.replay_buffer.sample, 1, "train", 2)
    assert len(batch) == 4 and metrics == {}
    uids = {key.split("_")[0] for key in batch.keys}
    assert len(uids) == 2
    assert sorted(key.split("_", 1)[1] for key in batch.keys) == ["0_0", "0_0", "1_0", "1_0"]
    for tag in batch.tags:
        assert tag["status"] == "success" and tag["global_steps"] == 1
        assert tag["min_global_steps"] == tag["max_global_steps"] == 0  # generated under the initial weights
        assert tag["seq_len"] == tag["prompt_len"] + tag["response_len"]
    data = _tq_get(batch.keys)
    assert "rollout_log_probs" in data.keys()  # verl's default: the engine's log-probs ride along
    rows = []
    for i in range(len(batch)):
        prompt = data["prompts"][i].tolist()
        response = data["responses"][i].tolist()
        rows.append((prompt, response))
        assert data["input_ids"][i].tolist() == prompt + response
        assert data["position_ids"][i].tolist() == list(range(len(prompt) + len(response)))
        assert data["response_mask"][i].tolist() == data["loss_mask"][i].tolist() == [1] * len(response)
        scores = data["rm_scores"][i].tolist()
        assert scores[:-1] == [0.0] * (len(scores) - 1)
        assert len(data["rollout_log_probs"][i]) == len(response)
    assert data["weight_version"].tolist() == [0] * 4
    assert sorted(rows) == sorted(replies.values())  # exactly the ids the engine generated, one row each
    for uid in uids:
        assert uid not in _tq_tags()  # sampled groups' prompt entries are cleared, as verl's own sampler does
    import transfer_queue as tq

    await anyio.to_thread.run_sync(lambda: tq.kv_clear(keys=batch.keys, partition_id="train"))
    taken = run.daemon.producer.take_stats(sorted(uids))
    assert sum(s.n_rollouts for s in taken) == 4


async def test_a_multi_turn_agents_calls_are_filed_as_one_row_per_chain(live: Any) -> None:
    """Agents chat three turns through the proxy; the tiny model's chat template renders each call's history.
    Each chain of calls is one TransferQueue key in verl's agent-loop layout (calls that drifted: a new key)."""
    run, trainer = live
    async with anyio.create_task_group() as tg:
        await anyio.to_thread.run_sync(trainer._add_batch_to_generate)
        seen = {}

        async def agents() -> None:
            seen.update(await multi_turn_agents(run, 4, 3))

        tg.start_soon(agents)
        with anyio.fail_after(120):
            batch, _ = await anyio.to_thread.run_sync(trainer.replay_buffer.sample, 1, "train", 2)
    data = _tq_get(batch.keys)
    assert len(seen) == 4
    merged = assert_rows_are_the_engines_chains(batch.keys, data, seen)
    assert merged == 4 and len(batch) == 4  # each rollout's three calls are one row
    for tag in batch.tags:
        assert tag["min_global_steps"] == tag["max_global_steps"] == 0
        assert tag["seq_len"] == tag["prompt_len"] + tag["response_len"]
    uids = sorted({key.split("_")[0] for key in batch.keys})
    stats = run.daemon.producer.take_stats(uids)
    counts = {k: sum(s.counts.get(k, 0.0) for s in stats) for k in ("batch/n_calls", "batch/n_rows")}
    assert counts == {"batch/n_calls": 12.0, "batch/n_rows": float(len(batch))}
    import transfer_queue as tq

    await anyio.to_thread.run_sync(lambda: tq.kv_clear(keys=batch.keys, partition_id="train"))


async def test_a_step_on_rows_with_masked_turns_and_verls_padding_trains_on_whole_group_advantages(
    live: Any,
) -> None:
    run, trainer = live
    producer, store = run.daemon.producer, run.daemon.store
    long_prompt = list(range(1, 71))  # 70 ids > max_prompt_length 64: the row is kept for its group, masked
    plan = {
        # the second call continues the first (one merged row, [5] between them masked); the third is a branch:
        # two rows, one member
        ("ga", 0): (1.0, [([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6]), ([7], [8])]),
        ("ga", 1): (0.0, [([1, 2], [7, 8, 9])]),
        ("ga", 2): (0.5, [(long_prompt, [5])]),
        ("gb", 0): (1.0, [([1], [2])]),
        ("gb", 1): (1.0, [([1], [3])]),  # all equal: advantages 0
    }
    prompts = [Prompt("ga", {}, 3, global_steps=1), Prompt("gb", {}, 2, global_steps=1)]
    import transfer_queue as tq

    def pending() -> None:
        tags = [{"is_prompt": True, "status": "pending", "global_steps": 1}] * 2
        tq.kv_batch_put(keys=["ga", "gb"], partition_id="train", tags=tags)

    await anyio.to_thread.run_sync(pending)
    producer.dispatch(prompts, resources_id=None)
    assert _answer_with_triplets(store, plan) == 5
    with anyio.fail_after(60):
        batch, _ = await anyio.to_thread.run_sync(trainer.replay_buffer.sample, 1, "train", 2)
    assert len(batch) == 6
    # verl's own phases up to the advantages: balancing pads the batch to whole mini-batches (multiples of
    # 2 prompts x 2 = 4 rows) with rows of a group of their own; then the actor's old log-probs
    metrics: dict[str, Any] = {}
    batch = await anyio.to_thread.run_sync(trainer._balance_batch, batch, metrics)
    assert len(batch) == 8
    batch = await anyio.to_thread.run_sync(trainer._compute_old_log_prob, batch, metrics)
    batch = await anyio.to_thread.run_sync(trainer._compute_advantage, batch, metrics)
    data = await anyio.to_thread.run_sync(_tq_get, batch.keys, "train", ["advantages", "response_mask"])
    got = {key: data["advantages"][i].tolist() for i, key in enumerate(batch.keys)}
    masks = {key: data["response_mask"][i].tolist() for i, key in enumerate(batch.keys)}
    # group ga by hand: one member per rollout, scores (1, 0, 0.5): mean 0.5, unbiased std 0.5
    mean, std = 0.5, math.sqrt(((1 - 0.5) ** 2 + (0 - 0.5) ** 2 + 0.0) / 2)
    high, low = (1 - mean) / (std + 1e-6), (0 - mean) / (std + 1e-6)
    assert masks["ga_0_0"] == [1, 1, 0, 1]
    assert got["ga_0_0"] == pytest.approx([high, high, 0.0, high], rel=1e-6)
    assert got["ga_0_2"] == pytest.approx([high], rel=1e-6)  # the branch gets its rollout's advantage
    assert got["ga_1_0"] == pytest.approx([low] * 3, rel=1e-6)
    assert masks["ga_2_0"] == [0] and got["ga_2_0"] == [0.0]  # counted in the statistics, not in the loss
    assert got["gb_0_0"] == [0.0] and got["gb_1_0"] == [0.0]
    pads = [key for key in batch.keys if key.startswith("pad")]
    assert len(pads) == 2 and all(set(got[key]) <= {0.0} for key in pads)

    # aglverl's step metrics on the padded batch: verl's padding rows (tagged is_padding, keys pad{hex}_{i}_0)
    # are no group of ours, so none of the step's groups counts as restored from a previous run's checkpoint
    assert trained_uids(batch) == [key.split("_")[0] for key in batch.keys if not key.startswith("pad")]
    await anyio.to_thread.run_sync(trainer.on_step_begin)
    step_metrics: dict[str, Any] = {}
    await anyio.to_thread.run_sync(trainer._compute_metrics, batch, step_metrics, {"step": 1.0}, 1, 0)
    assert step_metrics["step/n_groups_restored"] == 0.0  # before the fix: 1.0, verl's padding group
    assert step_metrics["step/n_rollouts"] >= 5.0  # ga and gb (and any group evicted before)

    # the rest of verl's step on this batch: the actor update, then the weight sync serves the new weights
    gap, before = await anyio.to_thread.run_sync(_in_worker, trainer, _weight_gap)
    assert gap == 0.0
    await anyio.to_thread.run_sync(trainer.checkpoint_manager.sleep_replicas)
    await anyio.to_thread.run_sync(trainer._update_actor, batch, metrics)
    assert metrics["actor/grad_norm"] > 0.0
    gap, still_served = await anyio.to_thread.run_sync(_in_worker, trainer, _weight_gap)
    assert gap > 0.0 and still_served == before  # trained, not yet synced
    await anyio.to_thread.run_sync(trainer.checkpoint_manager.update_weights, 5)
    gap, after = await anyio.to_thread.run_sync(_in_worker, trainer, _weight_gap)
    assert gap == 0.0 and after != before
    await anyio.to_thread.run_sync(lambda: tq.kv_clear(keys=batch.keys, partition_id="train"))
    producer.take_stats(["ga", "gb"])


def _in_worker(trainer: Any, fn: Any) -> Any:
    return ray.get(trainer.actor_rollout_wg.workers[0].__ray_call__.remote(fn))


def _weight_gap(worker_dict: Any) -> tuple[float, dict[str, float]]:
    """Inside the worker: max |actor - served| over all weights, and a checksum of the served weights."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from aglverl.verl_plugin.rollout import local_rollout

    actor = next(w for w in worker_dict.worker_dict.values() if isinstance(w, ActorRolloutRefWorker))
    params, _ = actor.actor.engine.get_per_tensor_param()
    served = dict(local_rollout().server.model.named_parameters())
    gap = 0.0
    for name, tensor in params:
        if name in served:
            gap = max(gap, float((tensor.detach().cpu() - served[name].detach()).abs().max()))
    return gap, {name: float(p.detach().double().sum()) for name, p in served.items()}


async def test_the_proxy_drains_calls_before_the_replicas_sleep_and_holds_new_ones_until_the_update(
    live: Any,
) -> None:
    run, trainer = live
    daemon = run.daemon
    rollout_id = await daemon.queue_task({"prompt": "x"})
    task = daemon.store.try_claim()
    assert task is not None and task.rollout_id == rollout_id
    base = f"{daemon.proxy_url}/rollout/{rollout_id}/attempt/{task.attempt_id}/v1"
    body = {"model": daemon.model, "messages": [{"role": "user", "content": "x"}]}
    events: list[str] = []
    first_byte = anyio.Event()
    served: list[int] = []  # the weight version the engine reports generating the first call with
    version = int(trainer.global_steps) + 1
    trainer.global_steps = version  # the step whose weights on_step_end syncs
    async with aiohttp.ClientSession() as http:

        async def long_call() -> None:
            # a generation queued in the engine when the trainer's step ends its sampling
            long_body = {**body, "max_tokens": 8, "stream": True, "temperature": 1.0}
            async with http.post(f"{base}/chat/completions", json=long_body) as response:
                assert response.status == 200, await response.text()
                served.append(int(response.headers["X-Weight-Version"]))
                async for _ in response.content.iter_any():
                    first_byte.set()
                events.append("long call done")

        async def held_call() -> None:
            async with http.post(f"{base}/chat/completions", json=body) as response:
                assert response.status == 200
                await response.read()
            events.append("held call done")

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_call)
            with anyio.fail_after(30):
                await first_byte.wait()
            await anyio.to_thread.run_sync(trainer.on_step_begin)
            await anyio.to_thread.run_sync(trainer.on_sample_end)  # pause (drain), then sleep the replicas
            events.append("asleep")
            assert events.index("long call done") < events.index("asleep")
            assert daemon.proxy.paused
            tg.start_soon(held_call)
            await anyio.sleep(0.2)
            assert "held call done" not in events  # held by the proxy while the weights change
            await anyio.to_thread.run_sync(
                trainer.on_step_end
            )  # weights synced, replicas awake, calls resume
            events.append("updated")
        assert events.index("updated") < events.index("held call done")
    daemon.store.submit_result(Rollout(rollout_id=rollout_id, attempt_id=task.attempt_id, final_reward=0.0))
    first, held = daemon.store.record(rollout_id).calls
    assert first.status == held.status == "ok"
    # each call is recorded under the version its engine reported; the one held across the update was
    # generated by the new weights
    assert (first.weight_version, held.weight_version) == (served[0], version)


async def test_bypass_mode_trains_rows_without_engine_log_probs_against_the_trainers_not_zero(
    live: Any,
) -> None:
    """verl's bypass copies rollout_log_probs into old_log_probs; a row whose call came back without the
    engine's log-probs must get the trainer's log-probs there, never the 0 its column holds."""
    from omegaconf import open_dict

    run, trainer = live
    producer, store = run.daemon.producer, run.daemon.store
    engine = [-0.5, -0.25, -0.125]
    plan = {("gc", 0): [5, 6, 7], ("gc", 1): [8, 9, 10]}
    prompts = [Prompt("gc", {}, 2, global_steps=1)]
    import transfer_queue as tq

    await anyio.to_thread.run_sync(
        lambda: tq.kv_batch_put(
            keys=["gc"],
            partition_id="train",
            tags=[{"is_prompt": True, "status": "pending", "global_steps": 1}],
        )
    )
    producer.dispatch(prompts, resources_id=None)
    while (task := store.try_claim()) is not None:
        session = task.metadata["session"]
        response: dict[str, Any] = {"token_ids": plan[("gc", session)]}
        if session == 0:
            response["logprobs"] = engine  # the engine's, posted by the agent; session 1 posted none
        store.submit_result(
            Rollout(
                rollout_id=task.rollout_id,
                attempt_id=task.attempt_id,
                final_reward=float(session),
                triplets=[Triplet(prompt={"token_ids": [1, 2]}, response=response)],
            )
        )
    with anyio.fail_after(60):
        batch, _ = await anyio.to_thread.run_sync(trainer.replay_buffer.sample, 1, "train", 1)
    assert sorted(batch.keys) == ["gc_0_0", "gc_1_0"]
    correction = trainer.config.algorithm.rollout_correction

    def old_log_probs(bypass: bool) -> dict[str, list[float]]:
        with open_dict(correction):
            correction.bypass_mode = bypass
        try:
            trainer._compute_old_log_prob(batch, {})
        finally:
            with open_dict(correction):
                correction.bypass_mode = False
        data = _tq_get(batch.keys, "train", ["old_log_probs"])
        return {key: data["old_log_probs"][i].tolist() for i, key in enumerate(batch.keys)}

    bypassed = await anyio.to_thread.run_sync(old_log_probs, True)
    recomputed = await anyio.to_thread.run_sync(old_log_probs, False)  # the trainer's own, same weights
    assert bypassed["gc_0_0"] == pytest.approx(engine)  # the engine's log-probs, as bypass promises
    assert all(v < -1e-3 for v in bypassed["gc_1_0"]), bypassed  # before the fix: [0.0, 0.0, 0.0]
    assert bypassed["gc_1_0"] == pytest.approx(recomputed["gc_1_0"], abs=1e-5)
    await anyio.to_thread.run_sync(lambda: tq.kv_clear(keys=batch.keys, partition_id="train"))
    producer.take_stats(["gc"])


async def test_a_checkpoint_covers_exactly_the_groups_its_save_hook_files_in_transferqueue(live: Any) -> None:
    """verl's save hook, called as its fit() calls it (in the trainer's thread): the groups finished when the
    save begins are filed in TransferQueue and journaled as covered by its checkpoint, in one step on the loop.
    A group that finishes the moment the filing's write returns is neither (were it covered without being in
    the snapshot, a crash would have it answered again). The sink's flush is wrapped to finish that group at
    exactly that moment; the filing itself is the real TransferQueue write."""
    run, trainer = live
    producer, store = run.daemon.producer, run.daemon.store
    import transfer_queue as tq

    steps = int(trainer.global_steps)
    await anyio.to_thread.run_sync(
        lambda: tq.kv_batch_put(
            keys=["ca", "cb"],
            partition_id="train",
            tags=[{"is_prompt": True, "status": "pending", "global_steps": steps}] * 2,
        )
    )
    producer.dispatch(
        [Prompt("ca", {}, 1, global_steps=steps), Prompt("cb", {}, 1, global_steps=steps)], resources_id=None
    )
    tasks = {}
    while (task := store.try_claim()) is not None:
        tasks[task.metadata["data_id"]] = task

    def answer(uid: str) -> None:
        task = tasks[uid]
        triplet = Triplet(prompt={"token_ids": [1, 2]}, response={"token_ids": [3]})
        store.submit_result(
            Rollout(
                rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0, triplets=[triplet]
            )
        )

    seen = producer.version
    answer("ca")
    with anyio.fail_after(30):
        await producer.wait_changed(seen, 1)
    sink, filed = producer.sink, []
    write = sink.flush

    async def write_then_finish_cb() -> None:
        await write()
        filed.append(set(_tq_tags()))
        if len(filed) == 1:
            answer("cb")
            await producer.wait_changed(producer.version, 1)  # cb's group is finished, not yet filed

    sink.flush = write_then_finish_cb
    try:
        with anyio.fail_after(120):
            await anyio.to_thread.run_sync(trainer._save_checkpoint)
    finally:
        del sink.flush
    assert "ca_0_0" in filed[0] and "cb_0_0" not in filed[0]  # what the checkpoint's snapshot could hold
    covered = [r for r in read_records(run.daemon.journal.path) if r["kind"] == "covered"]
    assert covered[-1]["global_steps"] == steps
    # every finished group not covered yet (the module's earlier ones too), but not cb (before the fix: cb too)
    assert "ca" in covered[-1]["uids"] and "cb" not in covered[-1]["uids"]
    await producer.flush()  # cb is filed at the next look, as a group that finished during the save
    assert "cb_0_0" in _tq_tags()
    await anyio.to_thread.run_sync(
        lambda: tq.kv_clear(keys=["ca_0_0", "cb_0_0", "ca", "cb"], partition_id="train")
    )
    producer.take_stats(["ca", "cb"])
    producer.checkpointed(["cb"])
