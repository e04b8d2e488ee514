"""Bad input over real HTTP: every kind gets a 4xx naming the problem, and nothing stored changes or is lost.

The property test throws generated sequences of bad requests at a server holding completed, claimed, queued
and already-handed-over rollouts, and compares a full snapshot of the store before and after each one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aglverl.models import LLM, Rollout, Triplet
from aglverl.server import TaskServer
from aglverl.store import TaskStore

pytestmark = pytest.mark.anyio

VOCAB = 1000
LIMIT = 32 << 10
FIELDS = {
    "rollout_id",
    "task",
    "final_reward",
    "triplets",
    "trace",
    "logs",
    "metadata",
    "attempt_id",
    "status",
}


class World:
    """A served store with rollouts in every state, and the ids a test needs to aim at them."""

    def __init__(self, store: TaskStore, http: aiohttp.ClientSession) -> None:
        self.store = store
        self.http = http
        self.completed: list[tuple[str, str]] = []
        self.claimed: list[tuple[str, str]] = []
        self.queued: list[str] = []
        self.forgotten: list[str] = []

    def snapshot(self) -> Any:
        s = self.store
        entries = {
            rid: (
                e.state,
                list(e.attempts),
                e.num_claims,
                e.lease_deadline,
                e.result.model_dump() if e.result else None,
                e.result_attempt,
                e.error,
                {a: [c.prompt_token_ids for c in calls] for a, calls in e.calls.items()},
            )
            for rid, e in s._entries.items()
        }
        resources = {u.resources_id: u.model_dump() for u in s.all_resources()}
        return entries, list(s._queue), s._queued_count, s._claimed_count, resources, list(s._tombstones)


def _triplet(ids: list[int]) -> Triplet:
    return Triplet(prompt={"token_ids": ids}, response={"token_ids": ids})


@asynccontextmanager
async def served_world() -> AsyncIterator[World]:
    store = TaskStore(lease_seconds=3600, vocab_size=VOCAB)
    server = TaskServer(store, max_body_bytes=LIMIT)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        await tg.start(server.serve)
        async with aiohttp.ClientSession(server.url) as http:
            w = World(store, http)
            store.add_resources({"main_llm": LLM(endpoint="http://x/v1", model="m")})
            for i in range(8):
                store.enqueue({"i": i})
            for i in range(6):
                task = store.try_claim()
                assert task is not None and task.attempt_id
                if i < 4:
                    triplets = [_triplet([i, 1])]
                    store.submit_result(
                        Rollout(rollout_id=task.rollout_id, final_reward=i / 4, triplets=triplets)
                    )
                    w.completed.append((task.rollout_id, task.attempt_id))
                else:
                    w.claimed.append((task.rollout_id, task.attempt_id))
            w.queued = list(store._queue)
            gone = w.completed.pop()[0]
            store.forget([gone])
            w.forgotten.append(gone)
            yield w
        tg.cancel_scope.cancel()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with served_world() as w:
        yield w


# ------------------------------------------------------------------ the kinds of bad request
def _post(body: bytes, *, path: str = "/rollout") -> tuple[str, str, bytes]:
    return ("POST", path, body)


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj)


not_json = st.binary(min_size=1, max_size=64).filter(lambda b: _is_bad_json(b))
non_finite = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
not_a_token = st.one_of(
    st.integers(min_value=-(2**63), max_value=-1),
    st.integers(min_value=VOCAB, max_value=2**63 - 1),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.none(),
)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
wrong_type = st.one_of(
    int64, st.floats(allow_nan=False), st.lists(int64, min_size=1, max_size=2), st.booleans()
)
extra_name = st.text(min_size=1, max_size=10).filter(lambda k: k not in FIELDS)


def _is_bad_json(b: bytes) -> bool:
    try:
        value = orjson.loads(b)
    except orjson.JSONDecodeError:
        return True
    return not isinstance(value, dict)


Request = tuple[str, str, bytes]


@st.composite
def bad_request(draw: st.DrawFn) -> Callable[[World], Request]:
    """A bad request, drawn before the world exists: a function of the world's ids (so examples replay)."""
    target, other_target = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    kind = draw(
        st.sampled_from(
            [
                "malformed",
                "non_finite",
                "wrong_type",
                "missing",
                "extra",
                "bad_token",
                "huge",
                "unknown_rollout",
                "wrong_attempt",
                "duplicate",
                "after_step",
                "bad_wait",
                "bad_heartbeat",
            ]
        )
    )
    raw = draw(not_json)
    literal = draw(non_finite)
    field = draw(st.sampled_from(["rollout_id", "final_reward", "triplets", "metadata", "logs"]))
    value = draw(wrong_type.filter(lambda v: not (field == "final_reward" and type(v) in (int, float))))
    extra = draw(extra_name)
    ids = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
    ids.insert(draw(st.integers(0, len(ids))), draw(not_a_token))
    side = draw(st.sampled_from(["prompt", "response"]))
    noise = draw(st.text(max_size=20))
    wait = draw(st.sampled_from(["abc", "-1", "nan", "inf", "", "1e999", "--"]))
    known_heartbeat = draw(st.booleans())

    def build(w: World) -> Request:
        targets = w.claimed + w.completed
        rid, aid = targets[target % len(targets)]
        done_rid, _ = w.completed[target % len(w.completed)]
        other_aid = w.claimed[other_target % len(w.claimed)][1]  # an attempt of another rollout
        triplet = {"prompt": {"token_ids": [1]}, "response": {"token_ids": [1]}, side: {"token_ids": ids}}
        requests: dict[str, Callable[[], Request]] = {
            "malformed": lambda: _post(raw),
            "non_finite": lambda: _post(
                b'{"rollout_id": "' + rid.encode() + b'", "final_reward": ' + literal + b"}"
            ),
            "wrong_type": lambda: _post(_json({"rollout_id": rid, "attempt_id": aid, field: value})),
            "missing": lambda: _post(_json({"final_reward": 1.0, "attempt_id": aid})),
            "extra": lambda: _post(
                _json({"rollout_id": rid, "attempt_id": aid, "final_reward": 1.0, extra: 1})
            ),
            "bad_token": lambda: _post(_json({"rollout_id": rid, "attempt_id": aid, "triplets": [triplet]})),
            "huge": lambda: _post(_json({"rollout_id": rid, "attempt_id": aid, "logs": ["x" * LIMIT]})),
            "unknown_rollout": lambda: _post(_json({"rollout_id": noise + "-unknown", "final_reward": 1.0})),
            "wrong_attempt": lambda: _post(
                _json({"rollout_id": rid, "attempt_id": noise + "-x", "final_reward": 1.0})
            ),
            "duplicate": lambda: _post(
                _json({"rollout_id": done_rid, "attempt_id": other_aid, "final_reward": 0.5})
            ),
            "after_step": lambda: _post(_json({"rollout_id": w.forgotten[0], "final_reward": 1.0})),
            "bad_wait": lambda: ("GET", f"/task?wait={wait}", b""),
            "bad_heartbeat": lambda: _post(
                _json({"attempt_id": "not-" + aid}),
                path=f"/rollout/{rid if known_heartbeat else 'unknown-' + rid}/heartbeat",
            ),
        }
        return requests[kind]()

    return build


async def _send(w: World, request: tuple[str, str, bytes]) -> tuple[int, Any]:
    method, path, body = request
    async with w.http.request(method, path, data=body or None) as resp:
        payload = await resp.read()
        return resp.status, orjson.loads(payload)


@settings(max_examples=40, deadline=None)
@given(sequences=st.lists(st.lists(bad_request(), min_size=1, max_size=6), min_size=1, max_size=3))
def test_no_sequence_of_bad_requests_changes_or_loses_anything(
    sequences: list[list[Callable[[World], Request]]],
) -> None:
    """Each example runs a fresh server on its own event loop (hypothesis drives the loop, not pytest)."""

    async def scenario() -> None:
        async with served_world() as w:
            for sequence in sequences:
                before = w.snapshot()
                for build in sequence:
                    request = build(w)
                    status, body = await _send(w, request)
                    assert 400 <= status < 500, (request[2].decode(errors="replace"), status, body)
                    assert isinstance(body.get("detail"), str) and body["detail"], (request, body)
                assert w.snapshot() == before

    anyio.run(scenario)


async def test_bad_requests_name_their_problem(world: World) -> None:
    rid, _aid = world.claimed[0]
    done_rid, done_aid = world.completed[0]
    cases = {
        _post(b'{"rollout_id": '): (400, "not valid JSON"),
        _post(_json({"rollout_id": rid, "final_reward": "x"})): (422, "field 'final_reward'"),
        _post(_json({"rollout_id": rid, "final_reward": True})): (422, "not a boolean"),
        _post(_json({"final_reward": 1})): (422, "field 'rollout_id': Field required"),
        _post(_json({"rollout_id": rid, "bogus": 1})): (422, "field 'bogus': Extra inputs are not permitted"),
        _post(b'{"rollout_id": "' + rid.encode() + b'", "final_reward": NaN}'): (400, "not valid JSON"),
        _post(
            _json(
                {
                    "rollout_id": rid,
                    "triplets": [{"prompt": {"token_ids": [VOCAB]}, "response": {"token_ids": [1]}}],
                }
            )
        ): (422, f"id {VOCAB} >= vocabulary size {VOCAB}"),
        _post(_json({"rollout_id": rid, "logs": ["x" * LIMIT]})): (413, "exceeds the limit"),
        _post(_json({"rollout_id": "nope", "final_reward": 1})): (404, "unknown rollout id 'nope'"),
        _post(_json({"rollout_id": rid, "attempt_id": "zz", "final_reward": 1})): (
            404,
            "unknown attempt id 'zz'",
        ),
        _post(
            _json({"rollout_id": done_rid, "attempt_id": done_aid, "final_reward": 0, "status": "failed"})
        ): (
            409,
            "already completed",
        ),
        _post(_json({"rollout_id": world.forgotten[0], "final_reward": 1})): (409, "already ended"),
    }
    before = world.snapshot()
    for request, (status, message) in cases.items():
        got_status, body = await _send(world, request)
        assert (got_status, message in body["detail"]) == (status, True), (request[1], body)
    assert world.snapshot() == before
    # The winning attempt resending its own result (a retried POST) is acknowledged, and changes nothing.
    done = world.store.record(done_rid).result
    assert done is not None and math.isfinite(done.final_reward or 0)
    resend = done.model_copy(update={"attempt_id": done_aid})
    status, body = await _send(world, _post(orjson.dumps(resend.model_dump())))
    assert status == 200 and "resend ignored" in body["message"]
    assert world.snapshot() == before
