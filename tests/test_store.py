"""TaskStore: queueing, leases, attempts, results, completion events (no HTTP here: the store is pure state)."""

from __future__ import annotations

import time

import anyio
import pytest

from aglverl.models import Rollout, Task, Triplet
from aglverl.store import (
    AlreadyFinished,
    InvalidResult,
    LLMCall,
    StepEnded,
    TaskStore,
    UnknownAttempt,
    UnknownRollout,
)

pytestmark = pytest.mark.anyio


def _call(rid: str, aid: str, seq: int, prompt: list[int], response: list[int]) -> LLMCall:
    return LLMCall(
        rollout_id=rid,
        attempt_id=aid,
        seq=seq,
        path="chat/completions",
        backend="http://b",
        started_at=time.monotonic(),
        prompt_token_ids=prompt,
        response_token_ids=response,
    )


async def test_claims_follow_queue_order_and_carry_attempt_ids() -> None:
    store = TaskStore()
    ids = [store.enqueue({"i": i}) for i in range(3)]
    tasks = [store.try_claim() for _ in range(3)]
    assert [t.rollout_id for t in tasks if t] == ids
    assert all(t and t.attempt_id and t.num_claims == 1 for t in tasks)
    assert store.try_claim() is None


async def test_expired_lease_requeues_with_new_attempt_and_same_rollout_id() -> None:
    store = TaskStore(lease_seconds=0.05, max_attempts=3)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        rid = store.enqueue("x")
        first = store.try_claim()
        assert first is not None
        with anyio.fail_after(2):
            second = await store.claim(wait=5)  # handed over the moment the first lease expires
        assert second is not None
        assert second.rollout_id == rid
        assert second.attempt_id != first.attempt_id
        assert second.num_claims == 2
        assert store.meters.requeued.value("lease_expired") == 1
        tg.cancel_scope.cancel()


async def test_no_lease_runs_while_frozen_and_thawing_adds_the_frozen_time() -> None:
    """A trainer holds the agents' calls for its update: the lease clock stops, then resumes where it was."""
    store = TaskStore(lease_seconds=0.1, max_attempts=3)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        rid = store.enqueue("x")
        task = store.try_claim()
        assert task is not None
        store.freeze_leases()
        with anyio.move_on_after(0.5):  # five leases' worth of frozen time: nobody gets the task
            await store.claim(wait=5)
            raise AssertionError("a frozen lease expired")
        assert store.state(rid) == "claimed"
        assert store.thaw_leases() >= 0.5
        assert store.heartbeat(rid, task.attempt_id) == 0.1  # still this attempt's
        with anyio.fail_after(2):
            again = await store.claim(wait=5)  # the clock runs again: the lease expires
        assert again is not None and again.rollout_id == rid and again.attempt_id != task.attempt_id
        assert store.meters.requeued.value("lease_expired") == 1
        tg.cancel_scope.cancel()


async def test_a_lease_renewed_or_claimed_during_a_freeze_counts_from_the_freeze() -> None:
    """An update longer than the lease: a heartbeat during it, and a claim made during it, each leave exactly
    ``lease_seconds`` at the thaw (as if made when the clock stopped), so a crashed agent's task is reclaimed one
    lease after the update, never one lease plus the update's length."""
    lease, update = 0.3, 2.0
    store = TaskStore(lease_seconds=lease, max_attempts=3)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        renewed = store.enqueue("renewed")
        first = store.try_claim()
        assert first is not None and first.rollout_id == renewed
        store.freeze_leases()
        with anyio.move_on_after(update):  # the update: no lease expires meanwhile
            await store.claim(wait=5)
            raise AssertionError("a frozen lease expired")
        assert store.heartbeat(renewed, first.attempt_id) == lease  # the agent renews, then crashes
        late = store.enqueue("claimed late")
        second = store.try_claim()  # an agent claims during the update, then crashes
        assert second is not None and second.rollout_id == late
        assert store.thaw_leases() >= update
        thawed = time.monotonic()
        with anyio.fail_after(lease + update / 2):  # before the fix: reclaimed at the thaw + lease + update
            again = {(await store.claim(wait=10)).rollout_id for _ in range(2)}  # type: ignore[union-attr]
        assert again == {renewed, late}
        assert time.monotonic() - thawed >= 0.9 * lease  # and not before their lease ran out
        tg.cancel_scope.cancel()


async def test_max_attempts_exhausted_fails_rollout_and_step_completes() -> None:
    store = TaskStore(lease_seconds=0.03, max_attempts=2)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        rid = store.enqueue("x")
        other = store.enqueue("y")
        assert store.try_claim() is not None
        assert store.try_claim() is not None
        store.submit_result(Rollout(rollout_id=other, final_reward=1.0))
        with anyio.fail_after(2):
            again = await store.claim(wait=5)
            assert again is not None and again.rollout_id == rid
            await store.wait_terminal([rid, other])
        record = store.record(rid)
        assert record.state == "failed"
        assert "attempt 2 of 2" in (record.error or "")
        assert store.record(other).state == "completed"
        tg.cancel_scope.cancel()


async def test_result_from_older_attempt_of_unfinished_rollout_wins() -> None:
    store = TaskStore(lease_seconds=0.03)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        rid = store.enqueue("x")
        first = store.try_claim()
        assert first is not None and first.attempt_id
        with anyio.fail_after(2):
            second = await store.claim(wait=5)
        assert second is not None and second.attempt_id
        store.record_calls(rid, first.attempt_id, [_call(rid, first.attempt_id, 1, [1], [2])])
        store.record_calls(rid, second.attempt_id, [_call(rid, second.attempt_id, 2, [3], [4])])
        store.submit_result(Rollout(rollout_id=rid, attempt_id=first.attempt_id, final_reward=0.5))
        with pytest.raises(AlreadyFinished, match=f"already completed by attempt {first.attempt_id}"):
            store.submit_result(Rollout(rollout_id=rid, attempt_id=second.attempt_id, final_reward=0.9))
        record = store.record(rid)
        assert record.attempt_id == first.attempt_id
        assert record.result is not None and record.result.final_reward == 0.5
        assert [c.prompt_token_ids for c in record.calls] == [[1]]  # the losing attempt's calls are gone
        tg.cancel_scope.cancel()


async def test_resent_result_is_acknowledged_and_a_different_one_refused() -> None:
    store = TaskStore()
    rid = store.enqueue("x")
    task = store.try_claim()
    assert task is not None
    store.submit_result(Rollout(rollout_id=rid, attempt_id=task.attempt_id, final_reward=1.0))
    message = store.submit_result(Rollout(rollout_id=rid, attempt_id=task.attempt_id, final_reward=1.0))
    assert "resend ignored" in message  # a retried POST whose first answer was lost
    store.fail([rid], "irrelevant: already completed")
    record = store.record(rid)
    assert record.result is not None and record.result.final_reward == 1.0
    assert store.meters.ignored.value("resent") == 1


async def test_result_after_failure_is_refused_with_the_reason() -> None:
    store = TaskStore(max_attempts=1)
    rid = store.enqueue("x")
    task = store.try_claim()
    assert task is not None
    store.submit_result(Rollout(rollout_id=rid, status="failed", metadata={"error": "boom"}))
    with pytest.raises(AlreadyFinished, match="already failed"):
        store.submit_result(Rollout(rollout_id=rid, attempt_id=task.attempt_id, final_reward=1.0))
    assert store.record(rid).state == "failed"


async def test_unknown_ids_are_refused_without_changing_anything() -> None:
    store = TaskStore()
    rid = store.enqueue("x")
    with pytest.raises(UnknownAttempt, match="has not been claimed"):
        store.submit_result(Rollout(rollout_id=rid, final_reward=1.0))
    task = store.try_claim()
    assert task is not None
    with pytest.raises(UnknownRollout, match="unknown rollout id 'nope'"):
        store.submit_result(Rollout(rollout_id="nope", final_reward=1.0))
    with pytest.raises(UnknownAttempt, match="unknown attempt id 'bad'"):
        store.submit_result(Rollout(rollout_id=rid, attempt_id="bad", final_reward=1.0))
    assert store.state(rid) == "claimed"


async def test_token_ids_beyond_vocabulary_are_refused() -> None:
    store = TaskStore(vocab_size=100)
    rid = store.enqueue("x")
    store.try_claim()
    bad = Triplet(prompt={"token_ids": [1, 2]}, response={"token_ids": [5, 100]})
    with pytest.raises(
        InvalidResult, match=r"triplets\[0\]\.response\.token_ids has id 100 >= vocabulary size 100"
    ):
        store.submit_result(Rollout(rollout_id=rid, final_reward=1.0, triplets=[bad]))
    assert store.state(rid) == "claimed"


async def test_long_poll_wakes_the_moment_a_task_is_queued() -> None:
    store = TaskStore()
    got: list[float] = []

    async def agent() -> None:
        task = await store.claim(wait=10)
        assert task is not None
        got.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent)
        await anyio.wait_all_tasks_blocked()
        queued_at = time.perf_counter()
        store.enqueue("x")
    assert got and got[0] - queued_at < 0.5


async def test_long_poll_times_out_with_no_task() -> None:
    store = TaskStore()
    with anyio.fail_after(2):
        assert await store.claim(wait=0.05) is None
    assert not store._waiters  # a long-poll that ends empty leaves nothing behind


async def test_cancelled_long_poll_gives_its_task_back_to_the_front_of_the_queue() -> None:
    store = TaskStore()
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.claim, 10)
        await anyio.wait_all_tasks_blocked()
        rid = store.enqueue("x")  # handed straight to the parked waiter...
        assert store.state(rid) == "claimed"
        tg.cancel_scope.cancel()  # ...which vanishes before it could deliver it
    assert store.state(rid) == "queued"
    task = store.try_claim()
    assert task is not None and task.rollout_id == rid and task.num_claims == 1
    assert store.meters.released.value() == 1


async def test_heartbeat_extends_the_lease() -> None:
    store = TaskStore(lease_seconds=0.2)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        rid = store.enqueue("x")
        task = store.try_claim()
        assert task is not None
        for _ in range(4):
            await anyio.sleep(0.1)
            store.heartbeat(rid, task.attempt_id)
        assert store.state(rid) == "claimed"
        assert store.meters.requeued.value("lease_expired") == 0
        with pytest.raises(UnknownAttempt):
            store.heartbeat(rid, "other")
        tg.cancel_scope.cancel()


async def test_agent_reported_failure_retries_then_fails() -> None:
    store = TaskStore(max_attempts=2)
    rid = store.enqueue("x")
    for attempt in (1, 2):
        task = store.try_claim()
        assert task is not None and task.num_claims == attempt
        store.submit_result(
            Rollout(rollout_id=rid, attempt_id=task.attempt_id, status="failed", metadata={"error": "boom"})
        )
    record = store.record(rid)
    assert record.state == "failed"
    assert "boom" in (record.error or "")


async def test_wait_terminal_returns_when_the_last_rollout_ends() -> None:
    store = TaskStore()
    ids = [store.enqueue(i) for i in range(3)]
    for _ in ids:
        store.try_claim()
    finished_at: list[float] = []

    async def waiter() -> None:
        await store.wait_terminal(ids)
        finished_at.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        for rid in ids[:2]:
            store.submit_result(Rollout(rollout_id=rid, final_reward=1.0))
        await anyio.wait_all_tasks_blocked()
        assert not finished_at
        last = time.perf_counter()
        store.submit_result(Rollout(rollout_id=ids[2], final_reward=1.0))
    assert finished_at and finished_at[0] - last < 0.5


async def test_forgotten_rollout_answers_step_ended() -> None:
    store = TaskStore()
    rid = store.enqueue("x")
    store.try_claim()
    store.submit_result(Rollout(rollout_id=rid, final_reward=1.0))
    store.forget([rid])
    with pytest.raises(StepEnded, match="already ended"):
        store.submit_result(Rollout(rollout_id=rid, final_reward=1.0))


async def test_close_wakes_parked_agents_with_no_task() -> None:
    store = TaskStore()
    results: list[object] = []

    async def agent() -> None:
        results.append(await store.claim(wait=30))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent)
            tg.start_soon(agent)
            await anyio.wait_all_tasks_blocked()
            store.close()
    assert results == [None, None]


async def test_old_server_verbs_wait_for_and_retrieve_owner_less_rollouts() -> None:
    store = TaskStore()
    rid = store.enqueue({"q": 1})
    owned = store.enqueue({"q": 2}, owner="step-0")
    for _ in range(2):
        store.try_claim()
    assert store.pop_finished(rid) is None
    async with anyio.create_task_group() as tg:

        async def report() -> None:
            await anyio.wait_all_tasks_blocked()
            store.submit_result(Rollout(rollout_id=rid, final_reward=0.25))
            store.submit_result(Rollout(rollout_id=owned, final_reward=1.0))

        tg.start_soon(report)
        with anyio.fail_after(2):
            rollout = await store.wait_for_rollout(rid, timeout=5)
    assert rollout is not None and rollout.final_reward == 0.25
    assert store.pop_all_finished() == []  # the step-owned rollout is the collector's, not the caller's
    assert store.state(owned) == "completed"


def _called(store: TaskStore, task: Task | None, seq: int, prompt: list[int], response: list[int]) -> Task:
    """Record one proxy call under ``task``'s attempt, as the proxy would; returns the task."""
    assert task is not None and task.attempt_id
    store.record_calls(
        task.rollout_id, task.attempt_id, [_call(task.rollout_id, task.attempt_id, seq, prompt, response)]
    )
    return task


async def test_agent_failure_on_the_last_attempt_is_an_agent_error_with_that_attempts_calls() -> None:
    store = TaskStore(lease_seconds=0.03, max_attempts=2)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        rid = store.enqueue("x")
        _called(store, store.try_claim(), 1, [1], [2])
        with anyio.fail_after(2):
            second = _called(store, await store.claim(wait=5), 2, [3], [4])  # the first lease expired
        store.submit_result(Rollout(rollout_id=rid, attempt_id=second.attempt_id, status="failed"))
        tg.cancel_scope.cancel()
    record = store.record(rid)
    assert (record.state, record.termination) == ("failed", "agent_error")
    assert [c.prompt_token_ids for c in record.calls] == [[3]]  # the last attempt's, for a trainer to use


async def test_lease_expiry_on_the_last_attempt_is_recorded_as_such() -> None:
    store = TaskStore(lease_seconds=0.03, max_attempts=1)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        rid = store.enqueue("x")
        _called(store, store.try_claim(), 1, [1], [2])
        with anyio.fail_after(2):
            await store.wait_terminal([rid])
        tg.cancel_scope.cancel()
    record = store.record(rid)
    assert (record.state, record.termination) == ("failed", "lease_expired")
    assert [c.response_token_ids for c in record.calls] == [[2]]


async def test_step_deadline_failure_is_a_step_timeout() -> None:
    store = TaskStore()
    claimed, queued = store.enqueue("a"), store.enqueue("b")
    _called(store, store.try_claim(), 1, [1], [2])
    assert store.fail([claimed, queued], "step deadline passed") == 2
    assert [store.record(r).termination for r in (claimed, queued)] == ["step_timeout", "step_timeout"]
    assert len(store.record(claimed).calls) == 1 and store.record(queued).calls == []


@pytest.mark.parametrize(
    ("declared", "recorded"), [("max_turns", "max_turns"), ("finished", None), (None, None)]
)
async def test_reason_an_agent_declares_is_recorded_with_its_result(
    declared: str | None, recorded: str | None
) -> None:
    store = TaskStore()
    rid = store.enqueue("x")
    store.try_claim()
    metadata = {"termination_reason": declared} if declared else {}
    store.submit_result(Rollout(rollout_id=rid, final_reward=0.0, metadata=metadata))
    assert store.record(rid).termination == recorded


async def test_every_state_change_is_one_of_the_transition_table_announced_as_it_says() -> None:
    """A rollout's life (queued, claimed, a claim undone, an attempt failed and retried, finished) moves only
    along :data:`~aglverl.store.TRANSITIONS`, each change announced with an attempt event the table allows for
    it, with the state after the change; a move the table lacks is refused with nothing changed."""
    from aglverl.store import TRANSITIONS, AttemptChange

    store = TaskStore(max_attempts=3)
    heard: list[AttemptChange] = []
    store.on_attempt(heard.append)
    rid = store.enqueue("x")
    first = store.try_claim()
    assert first is not None and first.attempt_id
    assert store.release(rid, first.attempt_id)
    second = store.try_claim()
    assert second is not None and second.attempt_id
    store.submit_result(Rollout(rollout_id=rid, attempt_id=second.attempt_id, status="failed"))
    third = store.try_claim()
    assert third is not None and third.attempt_id
    store.submit_result(Rollout(rollout_id=rid, attempt_id=third.attempt_id, final_reward=1.0))
    states = ["queued", *(change.state for change in heard[1:])]
    assert [c.kind for c in heard] == [
        "queued",
        "claimed",
        "released",
        "claimed",
        "ended",
        "claimed",
        "ended",
    ]
    assert states == ["queued", "claimed", "queued", "claimed", "queued", "claimed", "completed"]
    for before, change in zip(states, heard[1:], strict=False):
        assert change.kind in TRANSITIONS[(before, change.state)]  # type: ignore[index]
    entry = store._entries[rid]
    with pytest.raises(RuntimeError, match="no transition completed -> queued"):
        entry.move("queued", "ended")
    assert store.state(rid) == "completed"
