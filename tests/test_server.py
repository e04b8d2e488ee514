"""TaskServer over real loopback HTTP (uvicorn + Starlette): Agent Lightning routes, long-poll, bad input."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator

import aiohttp
import anyio
import orjson
import pytest

from aglverl.models import PromptTemplate
from aglverl.server import TaskServer
from aglverl.store import TaskStore

pytestmark = pytest.mark.anyio


@pytest.fixture
async def served() -> AsyncIterator[tuple[TaskStore, TaskServer, aiohttp.ClientSession]]:
    store = TaskStore(lease_seconds=30)
    server = TaskServer(store, max_body_bytes=64 << 10)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        await tg.start(server.serve)
        async with aiohttp.ClientSession(server.url) as http:
            yield store, server, http
        tg.cancel_scope.cancel()


async def _json(resp: aiohttp.ClientResponse) -> dict:
    return orjson.loads(await resp.read())


async def test_agent_lightning_routes_round_trip(served) -> None:
    store, _, http = served
    async with http.get("/resources/latest") as resp:
        assert resp.status == 404
    update = store.add_resources({"prompt": PromptTemplate(template="Q: {q}", engine="f-string")})
    rid = store.enqueue({"q": "2+2"}, mode="train", resources_id=update.resources_id, metadata={"k": 1})

    async with http.get("/task") as resp:
        body = await _json(resp)
    assert body["is_available"] is True
    task = body["task"]
    assert task["rollout_id"] == rid and task["input"] == {"q": "2+2"} and task["mode"] == "train"
    assert task["resources_id"] == update.resources_id and task["num_claims"] == 1 and task["attempt_id"]
    assert task["metadata"] == {"k": 1}

    async with http.get(f"/resources/{update.resources_id}") as resp:
        res = await _json(resp)
    assert res["resources"]["prompt"] == {
        "resource_type": "prompt_template",
        "template": "Q: {q}",
        "engine": "f-string",
    }
    async with http.get("/resources/latest") as resp:
        assert (await _json(resp))["resources_id"] == update.resources_id

    # Exactly what an Agent Lightning 0.1 client posts: Rollout.model_dump() with the echoed task.
    posted = {
        "rollout_id": rid,
        "task": task,
        "final_reward": 1.0,
        "triplets": [
            {"prompt": {"token_ids": [1, 2]}, "response": {"token_ids": [3]}, "reward": None, "metadata": {}}
        ],
        "trace": None,
        "logs": None,
        "metadata": {},
    }
    async with http.post("/rollout", data=orjson.dumps(posted)) as resp:
        assert resp.status == 200
        assert (await _json(resp))["status"] == "ok"
    record = store.record(rid)
    assert record.state == "completed" and record.attempt_id == task["attempt_id"]

    async with http.get("/task") as resp:
        assert await _json(resp) == {"is_available": False, "task": None}


async def test_long_poll_answers_the_moment_a_task_is_queued(served) -> None:
    store, _, http = served

    async def poll() -> tuple[dict, float]:
        async with http.get("/task?wait=10") as resp:
            body = await _json(resp)
        return body, time.perf_counter()

    async with anyio.create_task_group() as tg:
        result: list[tuple[dict, float]] = []

        async def run() -> None:
            result.append(await poll())

        tg.start_soon(run)
        while not store._waiters:  # noqa: ASYNC110  # test side: nothing signals "parked in the store"
            await anyio.sleep(0.005)
        queued_at = time.perf_counter()
        rid = store.enqueue("x")
    body, answered_at = result[0]
    assert body["task"]["rollout_id"] == rid
    assert answered_at - queued_at < 0.25


async def test_vanished_long_poll_agent_never_takes_a_task(served) -> None:
    store, server, _ = served
    host, port = server.url.removeprefix("http://").split(":")
    raw = socket.create_connection((host, int(port)))
    raw.sendall(b"GET /task?wait=30 HTTP/1.1\r\nHost: x\r\n\r\n")
    with anyio.fail_after(2):
        while not store._waiters:  # noqa: ASYNC110  # test side: nothing signals 'parked in the store'
            await anyio.sleep(0.005)
    raw.close()  # the agent dies while parked
    with anyio.fail_after(2):
        while store._waiters:  # noqa: ASYNC110  # test side: nothing signals 'parked in the store'
            await anyio.sleep(0.005)
    rid = store.enqueue("x")
    assert store.state(rid) == "queued"
    task = store.try_claim()
    assert task is not None and task.rollout_id == rid and task.num_claims == 1


BAD_POSTS = [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "empty"),
    (b'{"rollout_id": "R", "final_reward": NaN}', 400, "not valid JSON"),
    (b'{"rollout_id": 5}', 422, "field 'rollout_id'"),
    (b'{"final_reward": 1.0}', 422, "field 'rollout_id': Field required"),
    (b'{"rollout_id": "R", "final_reward": "high"}', 422, "field 'final_reward'"),
    (b'{"rollout_id": "R", "reward": 1.0}', 422, "field 'reward': Extra inputs are not permitted"),
    (b'{"rollout_id": "R", "final_reward": 1e999}', 400, "not valid JSON"),
    (
        b'{"rollout_id": "R", "triplets": [{"prompt": {"token_ids": [1, -2]}, "response": {"token_ids": [3]}}]}',
        422,
        "field 'triplets.0.prompt.token_ids.1'",
    ),
    (
        b'{"rollout_id": "R", "triplets": [{"prompt": {"token_ids": [1]}, "response": {"token_ids": [true]}}]}',
        422,
        "field 'triplets.0.response.token_ids.0'",
    ),
    (b'{"rollout_id": "R", "triplets": [{"prompt": {}, "response": {"token_ids": [1]}}]}', 422, "token_ids"),
    (b'{"rollout_id": "nope", "final_reward": 1.0}', 404, "unknown rollout id 'nope'"),
    (b'{"rollout_id": "R", "attempt_id": "wrong", "final_reward": 1.0}', 404, "unknown attempt id 'wrong'"),
    (b"[1, 2, 3]", 422, "rollout"),
    (
        b'{"rollout_id": "R", "final_reward": 1.0, "metadata": {"termination_reason": "tired"}}',
        422,
        "field 'metadata': Value error, metadata['termination_reason'] must be one of",
    ),
    (b'{"rollout_id": "R", "pad": "' + b"x" * (70 << 10) + b'"}', 413, "exceeds the limit"),
    # issue 50: finite as a Python float, infinite as the float32 the rows keep rewards in
    (
        b'{"rollout_id": "R", "final_reward": 1e39}',
        422,
        "field 'final_reward': Value error, the reward 1e+39: not a finite float32 number",
    ),
    (
        b'{"rollout_id": "R", "triplets": [{"prompt": {"token_ids": [1]}, "response": {"token_ids": [2]}, '
        b'"reward": -3.5e38}]}',
        422,
        "field 'triplets.0.reward': Value error, the reward -3.5e+38: not a finite float32 number",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "message"), BAD_POSTS, ids=[str(i) for i in range(len(BAD_POSTS))]
)
async def test_malformed_rollout_is_refused_with_its_reason_and_changes_nothing(
    served, body, status, message
) -> None:
    store, _, http = served
    rid = store.enqueue("x")
    task = store.try_claim()
    assert task is not None
    before = (store.state(rid), store.record(rid), dict(store._entries), list(store._queue))
    async with http.post("/rollout", data=body.replace(b'"R"', f'"{rid}"'.encode())) as resp:
        assert resp.status == status
        detail = (await _json(resp))["detail"]
    assert message in detail
    assert (store.state(rid), store.record(rid), dict(store._entries), list(store._queue)) == before


@pytest.mark.parametrize("wait", ["abc", "-1", "nan", "inf"])
async def test_bad_wait_parameter_is_a_400_naming_it(served, wait) -> None:
    store, _, http = served
    store.enqueue("x")
    async with http.get(f"/task?wait={wait}") as resp:
        assert resp.status == 400
        assert "'wait'" in (await _json(resp))["detail"]
    assert store._queued_count == 1


async def test_heartbeat_route_extends_lease_and_names_bad_ids(served) -> None:
    store, _, http = served
    rid = store.enqueue("x")
    task = store.try_claim()
    assert task is not None
    async with http.post(
        f"/rollout/{rid}/heartbeat", data=orjson.dumps({"attempt_id": task.attempt_id})
    ) as resp:
        assert resp.status == 200
        assert (await _json(resp))["lease_seconds"] == 30
    async with http.post("/rollout/missing/heartbeat") as resp:
        assert resp.status == 404
        assert "missing" in (await _json(resp))["detail"]


async def test_token_is_required_when_configured_except_for_healthz() -> None:
    store = TaskStore()
    server = TaskServer(store, token="s3cret")
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        async with aiohttp.ClientSession(server.url) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with http.get("/task", headers=headers) as resp:
                    assert resp.status == 401
                    assert "s3cret" not in await resp.text()
            async with http.get("/task", headers={"Authorization": "Bearer s3cret"}) as resp:
                assert resp.status == 200
            async with http.get("/healthz") as resp:
                assert resp.status == 200
        tg.cancel_scope.cancel()


async def test_metrics_count_work_and_reveal_no_task_contents(served) -> None:
    store, _, http = served
    rid = store.enqueue({"secret": "the-answer-is-42"})
    async with http.get("/task") as resp:
        await resp.read()
    async with http.post("/rollout", data=orjson.dumps({"rollout_id": rid, "final_reward": 1})) as resp:
        assert resp.status == 200
    async with http.get("/metrics") as resp:
        text = await resp.text()
    assert "aglverl_tasks_queued_total 1" in text
    assert "aglverl_rollouts_completed_total 1" in text
    assert 'aglverl_http_requests_total{route="rollout",status="200"} 1' in text
    assert "the-answer-is-42" not in text and rid not in text
    async with http.get("/healthz") as resp:
        assert await resp.text() == '{"status":"ok"}'


async def test_shutdown_answers_parked_polls_releases_port_and_leaves_no_task_or_thread() -> None:
    threads_before = set(threading.enumerate())
    tasks_before = asyncio.all_tasks()
    store = TaskStore()
    server = TaskServer(store)
    answers: list[dict] = []
    with anyio.fail_after(10):
        async with aiohttp.ClientSession() as http, anyio.create_task_group() as agents:
            async with anyio.create_task_group() as tg:
                await tg.start(store.serve)
                await tg.start(server.serve)
                url = server.url

                async def park() -> None:
                    async with http.get(f"{url}/task?wait=60") as resp:
                        answers.append(await _json(resp))

                for _ in range(3):
                    agents.start_soon(park)
                while len(store._waiters) < 3:  # noqa: ASYNC110  # test side: nothing signals 'parked in the store'
                    await anyio.sleep(0.005)
                tg.cancel_scope.cancel()  # shut the server down under the parked agents
    assert answers == [{"is_available": False, "task": None}] * 3
    host, port = url.removeprefix("http://").split(":")
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()
    assert asyncio.all_tasks() - tasks_before == set()
    assert set(threading.enumerate()) <= threads_before


async def test_tasks_posted_to_a_server_that_accepts_them_are_queued_in_order_behind_the_token() -> None:
    store = TaskStore(lease_seconds=30)
    server = TaskServer(store, token="s3cret", accept_tasks=True)
    queued: list[tuple[list[str], list]] = []
    server.on_tasks_queued.append(lambda ids, inputs: queued.append((ids, inputs)))
    update = store.add_resources({"prompt": PromptTemplate(template="{q}", engine="f-string")})
    auth = {"Authorization": "Bearer s3cret"}
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        await tg.start(server.serve)
        async with aiohttp.ClientSession(server.url) as http:
            body = orjson.dumps({"inputs": [{"q": "a"}, {"q": "b"}], "mode": "val", "metadata": {"batch": 7}})
            async with http.post("/tasks", data=body) as resp:
                assert resp.status == 401  # the token guards it like every other route
            async with http.post("/tasks", data=body, headers=auth) as resp:
                assert resp.status == 200
                ids = (await _json(resp))["rollout_ids"]
            assert len(ids) == 2 and queued == [(ids, [{"q": "a"}, {"q": "b"}])]
            for rollout_id, q in zip(ids, "ab", strict=True):
                async with http.get("/task", headers=auth) as resp:
                    task = (await _json(resp))["task"]
                assert (task["rollout_id"], task["input"], task["mode"]) == (rollout_id, {"q": q}, "val")
                assert task["metadata"] == {"batch": 7} and task["resources_id"] == update.resources_id
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b'{"inputs": []}', "field 'inputs': List should have at least 1 item"),
        (b'{"tasks": [{"q": 1}]}', "field 'inputs': Field required"),
        (b'{"inputs": [{"q": 1}], "mode": "eval"}', "field 'mode': Input should be 'train', 'val' or 'test'"),
        (b'{"inputs": [{"q": 1}], "metadata": [1]}', "field 'metadata': Input should be a valid dictionary"),
        (b'[{"q": 1}]', "invalid tasks: field 'body'"),
    ],
)
async def test_a_bad_task_batch_is_refused_naming_the_field_and_queues_nothing(
    body: bytes, named: str
) -> None:
    store = TaskStore(lease_seconds=30)
    server = TaskServer(store, accept_tasks=True)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        await tg.start(server.serve)
        async with aiohttp.ClientSession(server.url) as http:
            async with http.post("/tasks", data=body) as resp:
                assert resp.status == 422
                assert named in (await _json(resp))["detail"]
            async with http.get("/task") as resp:
                assert (await _json(resp))["is_available"] is False
        tg.cancel_scope.cancel()


async def test_a_trainers_task_server_does_not_take_tasks_over_http(served) -> None:
    _, _, http = served
    async with http.post("/tasks", data=b'{"inputs": [{"q": 1}]}') as resp:
        assert resp.status == 403
        assert "does not take tasks over HTTP" in (await _json(resp))["detail"]
    async with http.get("/task") as resp:
        assert (await _json(resp))["is_available"] is False
