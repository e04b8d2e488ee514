"""TrajectoryProducer over a real store (and, end to end, a real daemon with agents on loopback): prompt groups,
rows per finished group, events for samplers, and the journal that lets a restarted run lose nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from aglverl import LLM, AgentDaemon, BatchConfig, Rollout, SignalConfig, Triplet, run_agents
from aglverl.client import AgentClient
from aglverl.models import TRAINED_CALLS_KEY
from aglverl.store import LLMCall, TaskStore
from aglverl.testing import MockVLLM
from aglverl.trajectory.groups import (
    AgentsFailing,
    FinishedGroup,
    Prompt,
    TrajectoryProducer,
    aggregate_stats,
)

pytestmark = pytest.mark.anyio

BATCH = BatchConfig(max_prompt_length=8, max_response_length=4)


class RecordingSink:
    """A GroupSink that keeps what it is given, in order, and lets a test await a number of groups."""

    def __init__(self) -> None:
        self.started_uids: list[str] = []
        self.groups: list[FinishedGroup] = []
        self._changed = anyio.Event()

    async def started(self, prompts: Sequence[Prompt]) -> None:
        self.started_uids.extend(p.uid for p in prompts)

    async def finished(self, group: FinishedGroup) -> None:
        assert group.prompt.uid in self.started_uids, "a group finished before its start was filed"
        self.groups.append(group)
        self._changed.set()
        self._changed = anyio.Event()

    async def flush(self) -> None:
        return None

    async def wait_for(self, count: int) -> list[FinishedGroup]:
        with anyio.fail_after(10):
            while len(self.groups) < count:
                await self._changed.wait()
        return self.groups


@asynccontextmanager
async def producing(**kwargs: Any) -> AsyncIterator[tuple[TaskStore, TrajectoryProducer, RecordingSink]]:
    store = TaskStore(lease_seconds=30, max_attempts=2)
    sink = RecordingSink()
    producer = TrajectoryProducer(store, sink, batch=BATCH, signal=SignalConfig(**kwargs))
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        await tg.start(producer.serve)
        yield store, producer, sink
        tg.cancel_scope.cancel()


def _answer(store: TaskStore, rewards: dict[int, float | None], *, fail: Sequence[int] = ()) -> None:
    """Claim queued tasks while their session has a reward in ``rewards`` (or is in ``fail``) and answer them:
    that reward with one triplet, or a failure."""
    while (task := store.try_claim()) is not None:
        session = task.metadata["session"]
        if session not in rewards and session not in fail:
            store.release(task.rollout_id, task.attempt_id or "")
            break
        if session in fail:
            store.submit_result(
                Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, status="failed")
            )
            continue
        triplet = Triplet(prompt={"token_ids": [1, 2, 3]}, response={"token_ids": [4, 5 + session]})
        store.submit_result(
            Rollout(
                rollout_id=task.rollout_id,
                attempt_id=task.attempt_id,
                final_reward=rewards[session],
                triplets=[triplet],
            )
        )


async def test_a_groups_rows_reach_the_sink_once_all_its_rollouts_finished() -> None:
    async with producing() as (store, producer, sink):
        producer.dispatch([Prompt("p1", {"q": 1}, 3, global_steps=4, index=7)], resources_id=None)
        _answer(store, {0: 1.0, 1: 0.0})  # two of the three sessions
        await anyio.sleep(0.05)
        assert sink.groups == []
        assert sink.started_uids == ["p1"]
        _answer(store, {2: 0.5})
        (group,) = await sink.wait_for(1)
        assert group.status == "finished"
        assert group.sessions.tolist() == [0, 1, 2]  # rows in session order
        rows = group.rows
        assert len(rows) == 3
        by_session = dict(zip(group.sessions.tolist(), rows.scores.tolist(), strict=True))
        assert by_session == {0: 1.0, 1: 0.0, 2: 0.5}
        stats = group.stats
        assert (stats.n_rollouts, stats.n_completed, stats.reward_sum, stats.n_rows) == (3, 3, 1.5, 3)
        assert not stats.uniform
        assert producer.version == 1


async def test_only_the_calls_a_result_names_train_and_the_others_are_counted() -> None:
    """A result naming the response ids of the calls that train (``TRAINED_CALLS_KEY``, what ``agent_match``
    sets): the attempt's other recorded calls make no row and are counted in ``batch/n_calls_unselected``; a
    result naming none trains every call."""
    async with producing(trajectory="per_call") as (store, producer, sink):
        producer.dispatch([Prompt("p1", {}, 3)], resources_id=None)
        while (task := store.try_claim()) is not None:
            session, attempt = task.metadata["session"], task.attempt_id or ""
            calls = [
                LLMCall(
                    task.rollout_id,
                    attempt,
                    seq,
                    "/v1/chat/completions",
                    "b",
                    0.0,
                    prompt_token_ids=[1, 2],
                    response_token_ids=[3 + seq],
                    response_id=f"{agent}-{session}",
                )
                for seq, agent in enumerate(["write", "check", "write"])
            ]
            assert store.record_calls(task.rollout_id, attempt, calls)
            named = {TRAINED_CALLS_KEY: [f"write-{session}"]} if session < 2 else {}
            store.submit_result(
                Rollout(rollout_id=task.rollout_id, attempt_id=attempt, final_reward=1.0, metadata=named)
            )
        (group,) = await sink.wait_for(1)
        counts = group.stats.counts
        assert counts["batch/n_calls"] == 2 + 2 + 3  # the named calls of sessions 0 and 1, every call of 2
        assert counts["batch/n_calls_unselected"] == 1 + 1
        assert sorted(group.rows.n_calls.tolist()) == [1] * 7


async def test_a_sampler_waiting_for_groups_wakes_when_one_finishes_and_not_before() -> None:
    async with producing() as (store, producer, _):
        producer.dispatch([Prompt("a", {}, 1), Prompt("b", {}, 1)], resources_id=None)
        woke: list[int] = []

        async def sampler() -> None:
            woke.append(await producer.wait_changed(0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            await anyio.sleep(0.05)
            assert woke == []
            _answer(store, {0: 1.0})
        assert woke[0] >= 1
        assert await producer.wait_changed(0) >= 1  # a version already past returns at once


async def test_failed_rollouts_are_masked_and_a_group_left_without_rows_is_a_failure() -> None:
    async with producing(failure_reward=-1.0) as (store, producer, sink):
        producer.dispatch([Prompt("g1", {}, 2), Prompt("g2", {}, 2)], resources_id=None)
        # g1: one rollout fails for good (two attempts), the other answers; g2: both fail
        for _ in range(2):
            while (task := store.try_claim()) is not None:
                group, session = task.metadata["data_id"], task.metadata["session"]
                if group == "g1" and session == 0:
                    store.submit_result(
                        Rollout(
                            rollout_id=task.rollout_id,
                            attempt_id=task.attempt_id,
                            final_reward=1.0,
                            triplets=[Triplet(prompt={"token_ids": [1]}, response={"token_ids": [2]})],
                        )
                    )
                else:
                    store.submit_result(
                        Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, status="failed")
                    )
        groups = {g.prompt.uid: g for g in await sink.wait_for(2)}
        assert groups["g1"].status == "finished" and len(groups["g1"].rows) == 1
        assert groups["g2"].status == "failure" and len(groups["g2"].rows) == 0
        metrics = aggregate_stats([groups["g1"].stats, groups["g2"].stats])
        # reward over every finished rollout, failures included at their failure reward: (1 - 1 - 1 - 1) / 4
        assert metrics["training/reward"] == -0.5
        assert (metrics["step/n_rollouts"], metrics["step/n_failed"], metrics["filter/n_masked"]) == (4, 3, 3)


async def test_a_group_whose_scores_are_all_equal_is_flagged_for_the_sampler() -> None:
    async with producing() as (store, producer, sink):
        producer.dispatch([Prompt("same", {}, 2), Prompt("differ", {}, 2)], resources_id=None)
        while (task := store.try_claim()) is not None:
            reward = 1.0 if task.metadata["data_id"] == "same" or task.metadata["session"] == 0 else 0.0
            store.submit_result(
                Rollout(
                    rollout_id=task.rollout_id,
                    attempt_id=task.attempt_id,
                    final_reward=reward,
                    triplets=[Triplet(prompt={"token_ids": [1]}, response={"token_ids": [2]})],
                )
            )
        await sink.wait_for(2)
        assert producer.uniform("same") and not producer.uniform("differ")
        taken = producer.take_stats(["same"])
        assert [s.uid for s in taken] == ["same"]
        metrics = aggregate_stats(taken)
        # The producer dropped nothing: the sampler's evictions are verl's to count, not rejection/*_dropped.
        assert metrics["step/n_groups_uniform"] == 1.0 and metrics["rejection/n_groups_uniform"] == 1.0
        assert not [key for key in metrics if key.startswith("rejection/") and key.endswith("_dropped")]
        producer.evicted(["differ"])
        assert [s.uid for s in producer.take_stats([])] == ["differ"]  # evicted groups still count once


async def test_agents_failing_names_the_signal_option_that_masked_completed_rollouts() -> None:
    """Agents that completed every rollout, each with a response cut at the width (``truncated``), under
    ``mask_truncated``: no row is left, and the run stops naming that option, not blaming the agents for
    rollouts without a trainable turn."""
    store = TaskStore(lease_seconds=30, max_attempts=2)
    sink = RecordingSink()
    producer = TrajectoryProducer(
        store, sink, batch=BATCH, signal=SignalConfig(mask_truncated=True), max_failed_groups=1
    )
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        await tg.start(producer.serve)
        producer.dispatch([Prompt("cut", {}, 2)], resources_id=None)
        while (task := store.try_claim()) is not None:
            too_long = Triplet(
                prompt={"token_ids": [1]}, response={"token_ids": [2] * (BATCH.max_response_length + 1)}
            )
            store.submit_result(
                Rollout(
                    rollout_id=task.rollout_id,
                    attempt_id=task.attempt_id,
                    final_reward=1.0,
                    triplets=[too_long],
                )
            )
        (group,) = await sink.wait_for(1)
        tg.cancel_scope.cancel()
    assert group.status == "failure" and group.stats.n_completed == 2
    with pytest.raises(AgentsFailing) as caught:
        producer.check_agents()
    message = str(caught.value)
    assert "2x completed, but masked by aglverl.signal.mask_truncated=true: it ended truncated" in message
    assert "without a trainable turn" not in message


async def test_prompt_uids_and_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="no '_'"):
        Prompt("a_b", {}, 1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        Prompt("a", {}, 0)
    async with producing() as (_, producer, _sink):
        producer.dispatch([Prompt("x", {}, 1)], resources_id=None)
        with pytest.raises(ValueError, match="already dispatched"):
            producer.dispatch([Prompt("x", {}, 1)], resources_id=None)


# ---------------------------------------------------------------------------------------------- restart
class _Agents:
    """Agents that answer through the proxy; ``stop_after`` answers end the run abruptly (a crash)."""

    def __init__(self) -> None:
        self.answered: list[str] = []

    async def __call__(self, task: Any, llm: LLM) -> float:
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0)
        try:
            await client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "q"}])
        finally:
            await client.close()
        return 1.0


@asynccontextmanager
async def _daemon(journal: Path, mock: MockVLLM) -> AsyncIterator[tuple[AgentDaemon, RecordingSink]]:
    sink = RecordingSink()
    async with AgentDaemon(
        backends=[mock.url],
        model="mock",
        batch=BATCH,
        journal_path=journal,
        trajectory_sink=sink,
        sampling_parameters={"temperature": 1.0},
    ) as daemon:
        yield daemon, sink


async def _finish_some(daemon: AgentDaemon, count: int) -> list[str]:
    """Claim ``count`` tasks as agents and answer them through the proxy; returns their rollout ids."""
    done = []
    async with AgentClient(daemon.server_url) as agent:
        for _ in range(count):
            task = await agent.next_task(wait=5)
            assert task is not None
            update = await agent.resources(task.resources_id)
            assert update is not None
            llm = update.resources["main_llm"]
            client = openai.AsyncOpenAI(
                base_url=llm.get_base_url(task.rollout_id, task.attempt_id),
                api_key="-",
                max_retries=0,  # type: ignore[union-attr]
            )
            await client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "q"}])
            await client.close()
            await agent.post_rollout(
                Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
            )
            done.append(task.rollout_id)
    return done


async def test_a_restarted_daemon_reuses_finished_rollouts_and_redoes_the_rest_on_the_live_proxy(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "j.journal"
    async with MockVLLM(completion_tokens=3) as mock:
        async with _daemon(journal, mock) as (daemon, _):
            assert daemon.producer is not None
            resources = daemon.update_resources({"main_llm": daemon.main_llm()})
            daemon.producer.dispatch(
                [Prompt("old", {"q": 1}, 3, global_steps=2, index=5)], resources_id=resources
            )
            first = await _finish_some(daemon, 2)
            old_proxy = daemon.proxy_url
            all_ids = list(daemon.producer._groups["old"].rollout_ids)
        # the daemon is gone with one rollout unfinished; a new one starts on the same journal (new ports)
        async with _daemon(journal, mock) as (daemon, sink):
            producer = daemon.producer
            assert producer is not None and producer.recovered == 1
            assert daemon.proxy_url != old_proxy
            assert daemon.store.try_claim() is None  # nothing of the previous run is handed out by itself
            resources = daemon.update_resources({"main_llm": daemon.main_llm()})
            # the trainer asks for the same prompt of the same step again (a replayed data loader: new uid)
            producer.dispatch([Prompt("new", {"q": 1}, 3, global_steps=2, index=5)], resources_id=resources)
            assert producer.recovered == 0
            redone = await _finish_some(daemon, 1)
            (group,) = await sink.wait_for(1)
        assert set(redone) == set(all_ids) - set(first)  # the unfinished one, under its own rollout id
        assert [r.rollout_id for r in group.records] == all_ids
        assert group.stats.n_completed == 3 and len(group.rows) == 3
        # the redone call went through the live proxy: all three rows have the backend's ids
        assert all(len(r.calls) == 1 and r.calls[0].has_token_ids for r in group.records)


async def test_a_reissued_prompt_is_adopted_by_its_uid_and_checkpointed_groups_leave_the_journal(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "j.journal"
    async with MockVLLM(completion_tokens=3) as mock:
        async with _daemon(journal, mock) as (daemon, sink):
            assert daemon.producer is not None
            daemon.producer.dispatch(
                [Prompt("done", {"q": 0}, 1), Prompt("inflight", {"q": 1}, 2)], resources_id=None
            )
            await _finish_some(daemon, 1)
            # one of the three finished; if it was "done"'s, a checkpoint takes it out of the journal
            await anyio.sleep(0.05)
            finished = [g.prompt.uid for g in sink.groups]
            daemon.producer.checkpointed()
        async with _daemon(journal, mock) as (daemon, sink):
            producer = daemon.producer
            assert producer is not None
            expected = 1 if finished == ["done"] else 2
            assert producer.recovered == expected
            producer.dispatch([Prompt("inflight", {"q": 1}, 2)], resources_id=None)  # verl re-issues by uid
            assert producer.recovered == expected - 1
            assert producer.end_recovery() == expected - 1
            await _finish_some(daemon, 2 - (0 if finished == ["done"] else 1))
            (group,) = await sink.wait_for(1)
            assert group.prompt.uid == "inflight" and group.stats.n_completed == 2


async def test_recovered_collector_tasks_point_at_the_live_proxy(tmp_path: Path) -> None:
    journal = tmp_path / "j.journal"
    async with MockVLLM(completion_tokens=3) as mock:
        async with AgentDaemon(
            backends=[mock.url], model="mock", batch=BATCH, journal_path=journal
        ) as daemon:
            await daemon.submit([{"q": 1}], n=1)
            old = daemon.proxy_url
        async with AgentDaemon(
            backends=[mock.url], model="mock", batch=BATCH, journal_path=journal
        ) as daemon:
            (step,) = daemon.recovered_steps
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: run_agents(daemon.server_url, _Agents(), concurrency=1))
                report = await step.wait()
                tg.cancel_scope.cancel()
            assert daemon.proxy_url != old
            assert report.metrics["step/n_completed"] == 1  # its call reached the live proxy and was recorded
            assert report.metrics["step/n_rollouts_with_proxy_triplets"] == 1


async def _answer_group(daemon: AgentDaemon, sink: RecordingSink, prompt: Prompt) -> str:
    """Dispatch ``prompt`` and answer all its sessions through the proxy; returns its uid once finished."""
    assert daemon.producer is not None
    before = len(sink.groups)
    daemon.producer.dispatch([prompt], resources_id=None)
    await _finish_some(daemon, prompt.n)
    await sink.wait_for(before + 1)
    return prompt.uid


@pytest.mark.parametrize("killed_during_save", [False, True])
async def test_a_checkpoint_covers_exactly_the_groups_finished_before_its_save(
    tmp_path: Path, killed_during_save: bool
) -> None:
    """Group "a" finished before verl's save of step 3 began, "b" during it. After the save only "a" leaves the
    journal; killed during the save (both still journaled), "a" is never reused by a prompt of a step that
    checkpoint covers (it may be trained already), "b" always is."""
    journal = tmp_path / "j.journal"
    async with MockVLLM(completion_tokens=3) as mock:
        async with _daemon(journal, mock) as (daemon, sink):
            producer = daemon.producer
            assert producer is not None
            await _answer_group(daemon, sink, Prompt("a", {"q": 1}, 2, global_steps=3, index=5))
            a_ids = list(producer._groups["a"].rollout_ids)
            covered = await producer.covering(3)  # verl's save of step 3 starts
            assert covered == ["a"]
            await _answer_group(daemon, sink, Prompt("b", {"q": 2}, 2, global_steps=3, index=6))
            b_ids = list(producer._groups["b"].rollout_ids)
            if not killed_during_save:
                assert producer.checkpointed(covered) == 1
        async with _daemon(journal, mock) as (daemon, sink):
            producer = daemon.producer
            assert producer is not None
            assert producer.recovered == (2 if killed_during_save else 1)
            # the resumed trainer (from step 3's checkpoint) asks both samples again at step 4
            producer.dispatch(
                [
                    Prompt("a2", {"q": 1}, 2, global_steps=4, index=5),
                    Prompt("b2", {"q": 2}, 2, global_steps=4, index=6),
                ],
                resources_id=None,
            )
            assert producer.recovered == 0
            assert producer._groups["b2"].rollout_ids == b_ids  # reused as they were
            assert not set(producer._groups["a2"].rollout_ids) & set(a_ids + b_ids)  # "a" is redone
            (b2,) = await sink.wait_for(1)  # "b2" finished at once; "a2" is new work for agents
            assert b2.prompt.uid == "b2" and b2.stats.n_completed == 2
            assert daemon.store.try_claim() is not None


async def test_a_group_of_a_later_step_waits_for_that_step_of_a_replayed_run(tmp_path: Path) -> None:
    """Lockstep training with a checkpoint every few steps, killed during step 4 after training step 3 (saved:
    step 2): the restarted trainer replays its data loader, asking step 3's prompts at step 3 and step 4's at
    step 4. Step 4's journaled group must still be there for step 4 (its finished rollouts reused, never
    answered again), though step 3's sampling ended meanwhile."""
    journal = tmp_path / "j.journal"
    async with MockVLLM(completion_tokens=3) as mock:
        async with _daemon(journal, mock) as (daemon, sink):
            await _answer_group(daemon, sink, Prompt("s3", {"q": 3}, 2, global_steps=3, index=5))
            await _answer_group(daemon, sink, Prompt("s4", {"q": 4}, 2, global_steps=4, index=6))
            assert daemon.producer is not None
            answered = {uid: list(daemon.producer._groups[uid].rollout_ids) for uid in ("s3", "s4")}
        async with _daemon(journal, mock) as (daemon, sink):
            producer = daemon.producer
            assert producer is not None and producer.recovered == 2
            producer.dispatch([Prompt("r3", {"q": 3}, 2, global_steps=3, index=5)], resources_id=None)
            assert producer.end_recovery(3) == 0  # step 3's sampling ended: only groups up to step 3 go
            assert producer.recovered == 1
            producer.dispatch([Prompt("r4", {"q": 4}, 2, global_steps=4, index=6)], resources_id=None)
            assert producer._groups["r4"].rollout_ids == answered["s4"]  # reused as they were
            assert producer.end_recovery(4) == 0 and producer.recovered == 0
            await sink.wait_for(2)
            assert daemon.store.try_claim() is None  # nothing is answered a second time
