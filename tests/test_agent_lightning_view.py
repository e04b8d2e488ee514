"""Agent Lightning's rollouts as a view of aglverl's store (no HTTP, no Agent Lightning package): one Agent
Lightning rollout per aglverl attempt, every path that ends an attempt seen once, the state machine, the
terminal cursor and its journal records, ``model_request`` events from the recorded calls."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest

from aglverl import Rollout
from aglverl.agl10.events import triplet_events
from aglverl.agl10.rollouts import AgentLightningRollouts, Conflict
from aglverl.agl10.wire import RolloutCreate, StatusPatch
from aglverl.store import AttemptChange, LLMCall, TaskStore

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store() -> AsyncIterator[TaskStore]:
    store = TaskStore(lease_seconds=600, max_attempts=2)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        yield store
        tg.cancel_scope.cancel()


def states(view: AgentLightningRollouts, *ids: str) -> list[str]:
    return [view.slot(i).state for i in ids]


async def test_an_attempt_is_a_rollout_and_a_retry_is_the_next_one(store: TaskStore) -> None:
    view = AgentLightningRollouts(store)
    view.create([RolloutCreate(input={"q": 1}, rollout_id="r")])
    assert states(view, "r") == ["queuing"]
    await view.patch("r", StatusPatch(state="running", last_attempt_id="0"))
    await view.patch("r", StatusPatch(state="failed", error_message="exit 1"))
    assert states(view, "r", "r-retry-1") == ["failed", "queuing"]
    assert view.slot("r").error_message == "agent reported failure: exit 1; retried as r-retry-1"
    assert [r.rollout_id for r in view.listed({"queuing"}, 10)] == ["r-retry-1"]
    await view.patch("r-retry-1", StatusPatch(state="running"))
    view.add_event("r-retry-1", "0", "reward", {"value": 0.5})
    await view.patch("r-retry-1", StatusPatch(state="succeeded"))
    record = store.record("r")
    assert record.state == "completed" and record.result.final_reward == 0.5 and record.num_claims == 2
    page = view.terminal_page(0, 10)
    assert [(i.rollout_id, i.state) for i in page.items] == [("r", "failed"), ("r-retry-1", "succeeded")]
    with pytest.raises(Conflict, match="cannot transition succeeded -> failed"):
        await view.patch("r-retry-1", StatusPatch(state="failed"))


async def test_every_way_an_attempt_ends_in_the_store_shows_once(store: TaskStore) -> None:
    """A 0.1 agent's claim and result, a lease running out, an undone claim, a step's deadline, a late result
    from a superseded attempt: each is one transition of the attempt's rollout."""
    view = AgentLightningRollouts(store)
    ended = anyio.Event()

    def on_end(change: AttemptChange) -> None:
        if change.kind == "ended":
            ended.set()

    store.on_attempt(on_end)
    a = store.enqueue({"n": 1}, rollout_id="a")
    task = await store.claim()
    assert task is not None and task.rollout_id == a and states(view, a) == ["running"]
    store.release(a, task.attempt_id or "")  # never reached its agent
    assert states(view, a) == ["queuing"] and view.slot(a).attempt_id is None
    first = await store.claim()
    assert first is not None
    store.heartbeat(a, first.attempt_id, seconds=0.05)
    with anyio.fail_after(10):
        await ended.wait()  # the lease ran out: retried
    assert (
        states(view, a, f"{a}-retry-1") == ["failed", "queuing"]
        and "lease expired" in view.slot(a).error_message
    )
    second = await store.claim()
    assert second is not None and states(view, f"{a}-retry-1") == ["running"]
    store.submit_result(
        Rollout(rollout_id=a, attempt_id=first.attempt_id, final_reward=1.0)
    )  # the late one wins
    assert states(view, a, f"{a}-retry-1") == ["failed", "failed"]
    assert "superseded" in view.slot(f"{a}-retry-1").error_message
    b = store.enqueue({"n": 2}, rollout_id="b")
    store.fail([b], "the step's deadline passed")
    assert states(view, b) == ["failed"] and view.slot(b).error_message == "the step's deadline passed"
    assert [i.rollout_id for i in view.terminal_page(0, 10).items] == [a, f"{a}-retry-1", b]


async def test_a_queuing_rollout_starts_once_and_finished_ones_cannot(store: TaskStore) -> None:
    view = AgentLightningRollouts(store, reward_fillna_value=0.25)
    view.create([RolloutCreate(input={}, rollout_id="x")])
    slot = await view.start("x")
    assert slot.state == "running" and (await view.start("x")) is slot  # the agent's next call: same attempt
    await view.finish(slot, succeeded=True)  # no reward event: reward_fillna_value
    assert store.record("x").result.final_reward == 0.25
    with pytest.raises(Conflict):
        await view.start("x")


async def test_the_cursor_survives_a_restart_through_its_journal_records(store: TaskStore) -> None:
    view = AgentLightningRollouts(store)
    written: list[dict] = []

    class Journal:
        def write(self, record: dict) -> None:
            written.append(dict(record))

        def maybe_compact(self) -> None: ...

        async def commit(self) -> None: ...

    store.journal = Journal()  # type: ignore[assignment]
    view.create([RolloutCreate(input={"data_id": f"d{i}"}, rollout_id=f"r{i}") for i in range(3)])
    for rollout_id in ("r0", "r1"):
        await view.patch(rollout_id, StatusPatch(state="failed"))
    restarted = TaskStore(max_attempts=2)
    restarted.restore(written)
    again = AgentLightningRollouts(restarted)
    again.restore(written)
    again.sync()
    page = again.terminal_page(0, 10)
    assert [(i.rollout_id, i.state, i.data_id) for i in page.items] == [
        ("r0", "failed", "d0"),
        ("r1", "failed", "d1"),
    ]
    assert page.total_terminal == 2 and again.slot("r2").state == "queuing"
    assert again.config_of("r2") == view.config_of("r2")
    assert next(iter(again.live_records())) == {"kind": "agl_cursor", "total": 2}


async def test_recorded_calls_are_model_request_events_and_trim_to_triplets(store: TaskStore) -> None:
    view = AgentLightningRollouts(store)
    view.create([RolloutCreate(input={}, rollout_id="m")])
    slot = await view.start("m")
    assert slot.attempt_id is not None
    earlier = time.time() - 10  # the calls were made before the reward was posted
    for seq, (prompt, response) in enumerate([([1, 2], [3]), ([1, 2], [4, 5]), ([1, 2, 4, 5, 6], [7])]):
        call = LLMCall(
            "m",
            slot.attempt_id,
            seq,
            "/v1/chat/completions",
            "http://b",
            earlier + seq,
            0.01,
            model="tiny",
            prompt_token_ids=prompt,
            response_token_ids=response,
            logprobs=[-0.5] * len(response),
            finish_reason="stop",
        )
        store.record_calls("m", slot.attempt_id, [call])
    view.add_event("m", "0", "reward", {"value": 1, "source": "agent", "extra": "dropped in triplets"})
    events = view.events("m")
    assert [e.event_type for e in events] == ["model_request"] * 3 + ["reward"]
    assert events[0].data["response"]["choices"][0]["token_ids"] == [3]
    trimmed = triplet_events(events)
    assert [e.data.get("response_token_ids") for e in trimmed] == [
        [4, 5],
        [7],
        None,
    ]  # same prompt: the last kept
    assert trimmed[0].data["response_log_probs"] == [-0.5, -0.5]
    assert trimmed[-1].data == {"value": 1, "source": "agent"}
    assert view.detail("m").attempts == ["0"]


async def test_an_ended_api_rollout_goes_a_grace_after_a_page_last_listed_every_attempt(
    store: TaskStore,
) -> None:
    """Reading never deletes: an ended rollout created through the API goes ``terminal_grace_seconds`` after a
    page of the cursor last listed it (each listing starts the grace again), and only once every attempt it had
    was listed; ``clock`` is the retention's."""
    now = [0.0]
    view = AgentLightningRollouts(store, terminal_grace_seconds=10.0, clock=lambda: now[0])
    view.create([RolloutCreate(input={}, rollout_id="a"), RolloutCreate(input={}, rollout_id="b")])
    for agl_id in ("a", "b"):
        await view.patch(agl_id, StatusPatch(state="running"))
        await view.patch(agl_id, StatusPatch(state="failed", error_message="exit 1"))  # b, a retried
    await view.patch("a-retry-1", StatusPatch(state="running"))
    await view.patch("a-retry-1", StatusPatch(state="failed"))
    assert [i.rollout_id for i in view.terminal_page(0, 10).items] == ["a", "b", "a-retry-1"]
    await view.patch("b-retry-1", StatusPatch(state="running"))
    await view.patch("b-retry-1", StatusPatch(state="failed"))
    now[0] = 9.0
    assert [i.rollout_id for i in view.terminal_page(2, 1).items] == ["a-retry-1"]  # a listed again
    now[0] = 15.0
    assert view.evict() == 0 and store.knows("a") and store.knows("b")  # b's last attempt never listed
    now[0] = 19.0
    assert view.evict() == 1 and not store.knows("a") and store.knows("b")
    assert [i.rollout_id for i in view.terminal_page(0, 10).items] == ["b", "b-retry-1"]
    now[0] = 29.0
    assert view.evict() == 1 and not store.knows("b")
