"""What the Agent Lightning API refuses and bounds (issue 39), over real HTTP on loopback, without the Agent
Lightning package: ids that would become paths or clash with retries, dot segments on the proxy path, outside
work on a trainer's daemon, a daemon open to the network without a key; the terminal cursor across restarts;
the bounds on what the API keeps."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from aglverl import AgentDaemon, BatchConfig
from aglverl.agl10.config import AgentLightningSettings
from aglverl.algorithm import AsyncVERL, ConfigError
from aglverl.testing.mock_vllm import MockVLLM

pytestmark = pytest.mark.anyio

BATCH = BatchConfig(max_prompt_length=256, max_response_length=16)


@asynccontextmanager
async def serving(**kwargs: Any) -> AsyncIterator[tuple[AgentDaemon, httpx.AsyncClient]]:
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=BATCH, **kwargs) as daemon,
        httpx.AsyncClient(base_url=daemon.server_url, timeout=60) as client,
    ):
        yield daemon, client


async def test_ids_that_would_be_paths_or_retries_are_refused_at_creation() -> None:
    """Findings 2 and 6: ``rollout_id`` must be URL-safe, at most 128 characters, without '/' or a leading '.',
    and not of the ``<id>-retry-<k>`` form aglverl's retries take; a refused one queues nothing (not even the
    good ids of the same request). Then ``job``'s retry is ``job-retry-1``, and nobody else's."""
    hostile = [
        "../../etc/cron.d/x",
        "/tmp/abs",
        ".hidden",
        "a/b",
        "a b",
        "x" * 129,
        "job-retry-1",
        "-rf",
        "é",
        "",
    ]
    async with serving(max_attempts=2) as (daemon, client):
        for rollout_id in hostile:
            answer = await client.post(
                "/api/rollouts",
                json=[{"input": {}, "rollout_id": "ok"}, {"input": {}, "rollout_id": rollout_id}],
            )
            assert answer.status_code == 422, (rollout_id, answer.text)
            assert f"rollout_id {rollout_id[:200]!r} is not allowed" in answer.json()["detail"]
        assert daemon.store.rollout_ids() == []
        good = await client.post(
            "/api/rollouts", json=[{"input": {}, "rollout_id": "job"}, {"input": {}, "rollout_id": "A.b_c~1"}]
        )
        assert good.status_code == 201 and [r["rollout_id"] for r in good.json()] == ["job", "A.b_c~1"]
        await client.patch("/api/rollouts/job", json={"status": {"state": "running"}})
        await client.patch("/api/rollouts/job", json={"status": {"state": "failed", "error_message": "x"}})
        retry = (await client.get("/api/rollouts/job-retry-1")).json()["rollout"]
        assert retry["status"]["state"] == "queuing" and daemon.store.attempts("job") != []


async def test_dot_segments_on_the_proxy_path_are_refused_and_record_nothing() -> None:
    """Finding 9: a call on rollout ``a``'s proxy path with ``..`` segments that the HTTP client would resolve to
    rollout ``b``'s aglverl path is refused with a 400; nothing is recorded under ``b`` (nor ``a``)."""
    async with serving() as (daemon, client):
        await client.post(
            "/api/rollouts", json=[{"input": {}, "rollout_id": "a"}, {"input": {}, "rollout_id": "b"}]
        )
        for rollout_id in ("a", "b"):
            assert (
                await client.patch(f"/api/rollouts/{rollout_id}", json={"status": {"state": "running"}})
            ).status_code == 200
        (attempt_b,) = daemon.store.attempts("b")
        path = (
            f"/proxy/rollout/a/attempt/0/mode/train/openai/v1/../../../../../rollout/b/attempt/{attempt_b}"
            "/v1/chat/completions"
        )
        host, port = daemon.server_url.removeprefix("http://").split(":")
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        async with await anyio.connect_tcp(host, int(port)) as stream:  # as sent: no client resolves the dots
            await stream.send(request)
            answer = b""
            with anyio.fail_after(30):
                while not answer.endswith(b"}") or b"\r\n\r\n" not in answer:
                    answer += await stream.receive()
        status = int(answer.split(b" ", 2)[1])
        assert status == 400 and b"has a '.' or '..' segment" in answer, answer
        assert daemon.store.calls_of("b", attempt_b) == []
        assert daemon.store.calls_of("a", daemon.store.attempts("a")[0]) == []


def test_a_trainers_daemon_refuses_outside_rollouts_and_no_daemon_listens_off_loopback_without_a_key(
    tiny_model: Path,
) -> None:
    """Findings 3: a trainer's daemon answers ``POST /api/rollouts`` with a 403, as ``POST /tasks``, unless
    ``aglverl.accept_outside_rollouts`` says otherwise; serving on an address that is not loopback without a
    token is refused at construction unless ``allow_unauthenticated`` asks for it."""
    base = {"data": {"train_batch_size": 2, "max_response_length": 4}, "aglverl": {"journal": None}}
    trainers = AsyncVERL(base).agent_lightning
    allowing = AsyncVERL(
        {**base, "aglverl": {"journal": None, "accept_outside_rollouts": True}}
    ).agent_lightning

    async def post(settings: AgentLightningSettings) -> httpx.Response:
        async with serving(agent_lightning=settings) as (daemon, client):
            answer = await client.post("/api/rollouts", json=[{"input": {"cmd": "rm -rf ~"}}])
            assert (answer.status_code == 201) == bool(daemon.store.rollout_ids())
            return answer

    refused = anyio.run(post, trainers)
    assert refused.status_code == 403 and "aglverl.accept_outside_rollouts" in refused.json()["detail"]
    assert anyio.run(post, allowing).status_code == 201

    with pytest.raises(ValueError, match=r"refusing to serve on '0\.0\.0\.0' without a token"):
        AgentDaemon(host="0.0.0.0")
    with pytest.raises(
        ConfigError, match=r"aglverl\.host: refusing to serve on '10\.1\.2\.3' without a token"
    ):
        AsyncVERL({**base, "aglverl": {"journal": None, "host": "10.1.2.3"}})
    AgentDaemon(host="0.0.0.0", token="t")  # constructed, never served
    AgentDaemon(host="0.0.0.0", allow_unauthenticated=True)
    AgentDaemon(host="localhost")


async def test_the_terminal_cursor_is_exact_across_three_restarts_with_readers_between(
    tmp_path: Path,
) -> None:
    """Finding 4: a reader that follows the cursor (``next_after``) through three restarts of the daemon on its
    journal reads every rollout that ended exactly once, in the order they ended, and no position is lost
    (``total_terminal`` counts them all)."""
    journal = tmp_path / "run.journal"
    read: list[str] = []
    cursor = 0
    ended = 0
    for run in range(4):
        async with serving(journal_path=journal, max_attempts=1) as (_daemon, client):
            new = [{"input": {"data_id": f"d{run}-{i}"}, "rollout_id": f"r{run}-{i}"} for i in range(3)]
            assert (await client.post("/api/rollouts", json=new)).status_code == 201
            for i in range(2):  # two end in each run, one stays queued (it ends in the next run)
                rollout_id = f"r{run}-{i}"
                await client.patch(f"/api/rollouts/{rollout_id}", json={"status": {"state": "running"}})
                await client.patch(f"/api/rollouts/{rollout_id}", json={"status": {"state": "failed"}})
            if run:
                last = f"r{run - 1}-2"
                await client.patch(f"/api/rollouts/{last}", json={"status": {"state": "failed"}})
            ended += 3 if run else 2
            page = (await client.get("/api/rollouts/terminal", params={"after": cursor})).json()
            read += [item["rollout_id"] for item in page["items"]]
            cursor = page["next_after"]
            assert page["total_terminal"] == ended and cursor == ended
    assert len(read) == len(set(read)) == ended
    assert read[:2] == ["r0-0", "r0-1"] and read[2:5] == ["r1-0", "r1-1", "r0-2"]


async def test_ended_api_rollouts_past_the_bound_go_oldest_first_and_event_counts_are_bounded() -> None:
    """Finding 7 of issue 39: a rollout keeps at most ``max_events_per_rollout`` events (413 past it); past
    ``max_finished_rollouts`` the oldest ended rollouts created through the API go, read or not."""
    settings = AgentLightningSettings(max_finished_rollouts=3, max_events_per_rollout=4)
    async with serving(agent_lightning=settings, max_attempts=1) as (daemon, client):
        await client.post("/api/rollouts", json=[{"input": {}, "rollout_id": f"r{i}"} for i in range(6)])
        event = {"event_type": "trace", "data": {}}
        for n in range(5):
            answer = await client.post("/api/rollouts/r0/attempt/0/events", json=event)
            assert answer.status_code == (200 if n < 4 else 413)
        assert "the most one rollout keeps (4)" in answer.json()["detail"]
        for i in range(5):
            await client.patch(f"/api/rollouts/r{i}", json={"status": {"state": "failed"}})
        await client.post(
            "/api/rollouts", json=[{"input": {}, "rollout_id": "r6"}]
        )  # new work: the bound applies
        assert daemon.store.rollout_ids() == ["r2", "r3", "r4", "r5", "r6"]
        assert (await client.get("/api/rollouts/r0")).status_code == 404


async def _page(client: httpx.AsyncClient, after: int, limit: int = 1000) -> tuple[list[str], int]:
    answer = await client.get("/api/rollouts/terminal", params={"after": after, "limit": limit})
    assert answer.status_code == 200, answer.text
    page = answer.json()
    return [item["rollout_id"] for item in page["items"]], page["next_after"]


async def test_reading_the_terminal_cursor_deletes_nothing_whatever_after_a_caller_sends() -> None:
    """Issue 50: ``GET /api/rollouts/terminal?after=N`` evicted every ended API rollout before ``N``, read or not:
    one wrong cursor wiped results before their consumer had them. Now a reader's ``after`` decides nothing:
    a second reader, from the start, sees the same pages as the first, and every rollout is still held."""
    async with serving(max_attempts=1) as (daemon, client):
        await client.post("/api/rollouts", json=[{"input": {}, "rollout_id": f"r{i}"} for i in range(4)])
        for i in range(4):
            await client.patch(f"/api/rollouts/r{i}", json={"status": {"state": "failed"}})
        assert await _page(client, 1000) == ([], 1000)  # a wrong cursor: nothing listed, nothing dropped
        first = [await _page(client, after, limit=2) for after in (0, 2, 4)]
        assert first == [(["r0", "r1"], 2), (["r2", "r3"], 4), ([], 4)]
        second = [await _page(client, after, limit=2) for after in (0, 2, 4)]
        assert second == first
        assert daemon.store.rollout_ids() == ["r0", "r1", "r2", "r3"]
        assert [(await client.get(f"/api/rollouts/r{i}")).status_code for i in range(4)] == [200] * 4


async def test_ended_api_rollouts_go_once_their_grace_after_a_listing_passed_or_when_deleted() -> None:
    """With ``terminal_grace_seconds: 0`` a listed rollout goes at the next request that drops any (one never
    listed stays, whatever cursor a caller sends); ``DELETE``, Agent Lightning's acknowledgement, drops one at
    once."""
    settings = AgentLightningSettings(terminal_grace_seconds=0.0)
    async with serving(agent_lightning=settings, max_attempts=1) as (daemon, client):
        await client.post("/api/rollouts", json=[{"input": {}, "rollout_id": f"r{i}"} for i in range(4)])
        for i in range(3):
            await client.patch(f"/api/rollouts/r{i}", json={"status": {"state": "failed"}})
        assert (await client.delete("/api/rollouts/r2")).status_code == 204
        assert await _page(client, 0, limit=1) == (["r0"], 1)
        assert await _page(client, 5) == ([], 5)  # r0's grace has passed; r1 was never listed
        assert daemon.store.rollout_ids() == ["r1", "r3"]
        assert await _page(client, 0) == (["r1"], 3)


async def test_events_are_bounded_in_bytes_per_rollout_and_in_total_with_a_413_naming_the_limit() -> None:
    """Issue 50: events were bounded by count only (24 events of 8 MB grew the trainer by 206 MB). Bytes as
    posted are bounded per rollout and for all rollouts together; a refused event is not stored, and a rollout
    that goes gives its bytes back."""
    settings = AgentLightningSettings(max_event_bytes_per_rollout=10_000, max_event_bytes=25_000)
    async with serving(agent_lightning=settings, max_attempts=1) as (daemon, client):
        await client.post("/api/rollouts", json=[{"input": {}, "rollout_id": f"r{i}"} for i in range(4)])
        event = {"event_type": "trace", "data": {"blob": "x" * 4_000}}  # about 4 KB of data
        answers = [await client.post("/api/rollouts/r0/attempt/0/events", json=event) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 413]
        assert (
            "past the 10,000 bytes one rollout keeps (max_event_bytes_per_rollout)"
            in answers[2].json()["detail"]
        )
        for rollout_id in ("r1", "r2"):
            for _ in range(2):
                assert (
                    await client.post(f"/api/rollouts/{rollout_id}/attempt/0/events", json=event)
                ).is_success
        refused = await client.post("/api/rollouts/r3/attempt/0/events", json=event)
        assert refused.status_code == 413
        assert "past the 25,000 bytes the daemon keeps (max_event_bytes)" in refused.json()["detail"]
        stored = (await client.get("/api/rollouts/r0/events")).json()
        assert len(stored) == 2 and (await client.get("/api/rollouts/r3/events")).json() == []
        budget = daemon.agent_lightning.rollouts.budget
        held = budget.held
        await client.delete("/api/rollouts/r0")
        assert budget.held == held * 2 // 3  # r0's two events of six
        assert (await client.post("/api/rollouts/r3/attempt/0/events", json=event)).status_code == 200


async def test_a_reward_event_after_the_rollout_ended_is_409_and_changes_nothing() -> None:
    """Issue 50: a reward posted after the rollout ended was answered 200 and kept among the events while the
    stored result kept the old reward. Now: 409 naming the state; the events and the result are unchanged."""
    async with serving(max_attempts=1) as (daemon, client):
        await client.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r"}])
        await client.patch("/api/rollouts/r", json={"status": {"state": "running"}})
        reward = {"event_type": "reward", "data": {"value": 0.25}}
        assert (await client.post("/api/rollouts/r/attempt/0/events", json=reward)).status_code == 200
        await client.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
        late = await client.post(
            "/api/rollouts/r/attempt/0/events", json={"event_type": "reward", "data": {"value": 9}}
        )
        assert late.status_code == 409
        assert "rollout r is succeeded: a reward posted after its end is refused" in late.json()["detail"]
        events = (await client.get("/api/rollouts/r/events", params={"event_type": "reward"})).json()
        assert [e["data"]["value"] for e in events] == [0.25]
        assert daemon.store.record("r").result.final_reward == 0.25  # type: ignore[union-attr]
        trace = await client.post(
            "/api/rollouts/r/attempt/0/events", json={"event_type": "trace", "data": {}}
        )
        assert trace.status_code == 200  # other events on a finished rollout stay allowed (Agent Lightning's)


@pytest.mark.parametrize("value", ["1e39", "-1e39", "1" + "0" * 40, "3.4028236e38"])
async def test_a_reward_event_not_finite_as_float32_is_refused_and_fails_the_attempt(value: str) -> None:
    """Issue 50: 1e39 is finite as a Python float and infinite in the float32 rows; its GRPO step raised and the
    run ended. The reward event is refused (422 naming the value), and the attempt fails naming it, even when the
    controller reports success."""
    async with serving(max_attempts=1) as (daemon, client):
        await client.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r"}])
        await client.patch("/api/rollouts/r", json={"status": {"state": "running"}})
        body = b'{"event_type": "reward", "data": {"value": ' + value.encode() + b"}}"
        answer = await client.post(
            "/api/rollouts/r/attempt/0/events", content=body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 422
        shown = repr(float(value))
        assert f"the reward event's value {shown}: not a finite float32 number" in answer.json()["detail"]
        assert (await client.get("/api/rollouts/r/events", params={"event_type": "reward"})).json() == []
        ended = await client.patch("/api/rollouts/r", json={"status": {"state": "succeeded"}})
        assert ended.json()["status"]["state"] == "failed"
        assert shown in ended.json()["status"]["error_message"]
        record = daemon.store.record("r")
        assert record.state == "failed" and shown in (record.error or "")
