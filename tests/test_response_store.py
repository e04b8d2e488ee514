"""The Responses API's stored responses (``aglverl.proxy.api.response_store``): per attempt, least recently used
dropped past the bounds (a response counting the conversation it holds), ids that are gone remembered with why,
freed when the attempt ends or its rollout is forgotten."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest

from aglverl.proxy import ProxyConfig
from aglverl.proxy.api.response_store import UNATTRIBUTED, ResponseStore, StoredResponse

A1, A2, B1 = ("r1", "a1"), ("r1", "a2"), ("r2", "a1")


def response(
    response_id: str, text: str = "hi", previous: StoredResponse | None = None, pad: int = 0
) -> StoredResponse:
    """A stored response answering ``text`` to a one-message input (``pad`` bytes more of input)."""
    output = ({"id": f"msg_{response_id}", "type": "message", "role": "assistant", "content": text},)
    input_ = ({"id": f"in_{response_id}", "role": "user", "content": "q" + "x" * pad},)
    body = orjson.dumps({"id": response_id, "object": "response", "output": output})
    items = len(orjson.dumps(input_)) + len(orjson.dumps(output))
    return StoredResponse(response_id, body, input_, output, previous, items)


def store(**bounds: Any) -> ResponseStore:
    return ResponseStore(ProxyConfig(**bounds))


def test_an_attempt_sees_only_its_own_responses() -> None:
    kept = store()
    assert kept.put(A1, response("resp_1"))
    assert kept.get(A1, "resp_1") is not None
    for other in (A2, B1, UNATTRIBUTED):
        assert kept.get(other, "resp_1") is None and kept.why_gone(other, "resp_1") is None
    assert kept.put(UNATTRIBUTED, response("resp_2"))
    assert kept.get(UNATTRIBUTED, "resp_2") is not None and kept.get(A1, "resp_2") is None
    assert len(kept) == 2 and kept.attempts == 2


def test_a_continued_response_holds_its_conversation_and_counts_all_of_it() -> None:
    first = response("resp_1", "one")
    second = response("resp_2", "two", previous=first)
    third = response("resp_3", "three", previous=second)
    assert [r.id for r in third.chain()] == ["resp_1", "resp_2", "resp_3"]
    assert [i["id"] for i in third.context()] == [
        "in_resp_1",
        "msg_resp_1",
        "in_resp_2",
        "msg_resp_2",
        "in_resp_3",
    ]
    assert [i["id"] for i in third.conversation()][-1] == "msg_resp_3"
    assert third.size == first.size + (second.size - first.size) + (third.size - second.size)
    assert third.size == sum(len(r.body) + r.items_bytes for r in (first, second, third))
    kept = store()
    for r in (first, second, third):
        kept.put(A1, r)
    assert kept.held_bytes(A1) == first.size + second.size + third.size


def test_the_least_recently_used_responses_go_past_the_count_and_say_why() -> None:
    kept = store(responses_per_attempt=2)
    for i in range(3):
        kept.put(A1, response(f"resp_{i}"))
        if i == 1:
            assert kept.get(A1, "resp_0") is not None  # used: resp_1 is now the least recently used
    assert [kept.get(A1, f"resp_{i}", touch=False) is not None for i in range(3)] == [True, False, True]
    why = kept.why_gone(A1, "resp_1")
    assert why is not None and "at most 2 responses" in why and "responses_per_attempt" in why
    assert kept.get(A2, "resp_0") is None  # the bound is per attempt: another attempt is untouched


def test_the_least_recently_used_responses_go_past_the_bytes() -> None:
    one = response("resp_x").size
    kept = store(response_bytes_per_attempt=2 * one + one // 2)
    for i in range(3):
        assert kept.put(A1, response(f"resp_{i}"))
    assert [kept.get(A1, f"resp_{i}", touch=False) is not None for i in range(3)] == [False, True, True]
    assert kept.held_bytes(A1) == 2 * one
    assert "response_bytes_per_attempt" in (kept.why_gone(A1, "resp_0") or "")


def test_a_response_larger_than_the_bound_alone_is_not_kept_and_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    small = response("resp_small")
    kept = store(response_bytes_per_attempt=small.size + 10)
    assert kept.put(A1, small)
    with caplog.at_level(logging.WARNING, logger="aglverl.proxy.api.response_store"):
        assert not kept.put(A1, response("resp_big", pad=100))
        assert not kept.put(A1, response("resp_big2", pad=100))
    assert kept.get(A1, "resp_big") is None and kept.get(A1, "resp_small") is not None  # nothing else dropped
    assert "at most" in (kept.why_gone(A1, "resp_big") or "")
    [record] = caplog.records
    assert "response_bytes_per_attempt" in record.getMessage()
    nothing = store(responses_per_attempt=0)
    assert not nothing.put(A1, small) and len(nothing) == 0


def test_a_deleted_response_is_gone_but_what_continued_it_keeps_its_conversation() -> None:
    kept = store()
    first = response("resp_1")
    kept.put(A1, first)
    kept.put(A1, response("resp_2", previous=first))
    assert kept.delete(A1, "resp_1") and not kept.delete(A1, "resp_1") and not kept.delete(A2, "resp_2")
    assert kept.get(A1, "resp_1") is None and kept.why_gone(A1, "resp_1") == "it was deleted"
    later = kept.get(A1, "resp_2")
    assert later is not None and [r.id for r in later.chain()] == ["resp_1", "resp_2"]


def test_an_ended_attempt_or_a_forgotten_rollout_frees_what_it_kept() -> None:
    kept = store()
    for key in (A1, A2, B1, UNATTRIBUTED):
        kept.put(key, response(f"resp_{key}"))
    kept.end("r1", "a1")
    assert kept.get(A1, "resp_('r1', 'a1')") is None and kept.get(A2, "resp_('r1', 'a2')") is not None
    kept.end("r1")  # every attempt of the rollout
    kept.forget(["r2"])
    assert len(kept) == 1 and kept.attempts == 1  # the unattributed calls' responses only
    assert kept.why_gone(A1, "resp_('r1', 'a1')") is None


@pytest.mark.parametrize("bad", [-1, 1.5, "8"])
def test_the_bounds_are_integers_at_least_zero(bad: Any) -> None:
    for name in ("responses_per_attempt", "response_bytes_per_attempt"):
        with pytest.raises(ValueError, match=name):
            ProxyConfig(**{name: bad})
