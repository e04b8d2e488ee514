"""The proxy's HTTP/1.1 server (:mod:`aglverl.proxy.http`) serving agents' calls, over real loopback sockets: raw
bytes written to the proxy, a real :class:`~aglverl.testing.MockVLLM` behind it, the answers read back byte for
byte.

Covered: a request cut anywhere (the head byte by byte, the body in pieces); keep-alive, requests sent one after
another and pipelined (in one write, and while another is being answered, a big one included); ``Connection:
close``; ``HTTP/1.0``, a chunked request body, ``Expect: 100-continue``, percent-escapes in the path, a malformed
header, a body over ``max_body_bytes``, each answered on the same server and the connection after it; the proxy's
error answers, and the answer to each of a table of requests (its status, what was counted and recorded, whether
the connection serves on); streamed answers (chunked framing, ``[DONE]``, the terminator); an agent that leaves
while its call is answered or while it sends its body; a large answer read slowly; shutdown; the idle timeout.
The server's limits and the holes of issue 48 are ``tests/test_http_limits.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from helpers.raw_http import (
    FAST_RETRY,
    LOOPS,
    WAIT,
    Agent,
    assert_answered,
    assert_openai_error,
    chat,
    claim,
    finish,
    proxied,
    request,
    route,
    until,
)

from aglverl.metrics import Registry
from aglverl.proxy import LLMProxy
from aglverl.store import TaskStore
from aglverl.testing import MockVLLM

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------------------------------- 1. cut requests
@LOOPS
async def test_a_request_cut_byte_by_byte_and_in_pieces_is_read_whole_answered_and_recorded() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), body)
        end = data.index(b"\r\n\r\n") + 4
        head, payload = data[:end], data[end:]
        third = len(payload) // 3
        async with Agent.connect(proxy.url) as agent:
            await agent.send(*(head[i : i + 1] for i in range(len(head))), pause=0)
            await agent.send(payload[:third], payload[third : 2 * third], payload[2 * third :], pause=0.002)
            answer = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered(answer, mock, body)
    [(prompt, response)] = mock.expected(body)
    [call] = calls
    assert (call.status, call.prompt_token_ids, call.response_token_ids) == ("ok", prompt, response)
    assert call.path == "/v1/chat/completions" and call.finish_reason == "length"
    [seen] = mock.generation_requests()
    assert orjson.loads(seen.body)["messages"] == body["messages"]


# ---------------------------------------------------------------------------------------------- 2. keep-alive
@LOOPS
async def test_keep_alive_answers_requests_one_after_another_then_two_pipelined_in_one_write_in_order() -> (
    None
):
    bodies = [chat(f"turn {i}") for i in range(5)]
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        answers = []
        async with Agent.connect(proxy.url) as agent:
            for body in bodies[:3]:
                await agent.send(request(route(rid, aid), body))
                answers.append(await agent.answer())
            await agent.send(request(route(rid, aid), bodies[3]) + request(route(rid, aid), bodies[4]))
            answers += [await agent.answer(), await agent.answer()]
            # the connection is still open and serving after all that
            await agent.send(request(route(rid, aid), bodies[0]))
            answers.append(await agent.answer())
        calls = finish(store, rid, aid)
    for answer, body in zip(answers, [*bodies, bodies[0]], strict=True):
        assert_answered(answer, mock, body)  # each answer is its own request's: the order kept
        assert answer.header("connection") is None
    assert [c.status for c in calls] == ["ok"] * 6


@LOOPS
async def test_requests_sent_while_another_is_answered_wait_their_turn_a_big_one_included() -> None:
    """A request that arrives while the connection's call is in the backend is held, its answer sent after the
    first one's; a pipelined body well over the 64 KiB the connection buffers (reading pauses, then resumes)."""
    first, small, big = chat("first"), chat("second"), chat("x" * (300 << 10))
    async with MockVLLM(latency=0.3) as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), first))
            with anyio.fail_after(WAIT):
                await mock.wait_until(lambda m: m.active == 1)  # the first call is in the backend
            await agent.send(request(route(rid, aid), small) + request(route(rid, aid), big))
            answers = [await agent.answer() for _ in range(3)]
        calls = finish(store, rid, aid)
    for answer, body in zip(answers, [first, small, big], strict=True):
        assert_answered(answer, mock, body)
    assert [len(orjson.loads(r.body)["messages"][0]["content"]) for r in mock.generation_requests()] == [
        5,
        6,
        300 << 10,
    ]
    assert [c.status for c in calls] == ["ok"] * 3


# ---------------------------------------------------------------------------------------------- 3. Connection: close
@LOOPS
@pytest.mark.parametrize("kind", ["whole", "stream", "error"])
async def test_connection_close_is_answered_with_connection_close_and_the_connection_is_closed(
    kind: str,
) -> None:
    body = chat(stream=kind == "stream")
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        path = route("rollout-nope" if kind == "error" else rid, aid)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(path, body, headers=["Connection: close"]))
            answer = await agent.answer()
            after = await agent.rest()  # the proxy closes: EOF, nothing after the answer
    assert answer.header("connection") == "close" and after == b""
    if kind == "whole":
        assert_answered(answer, mock, body)
    elif kind == "stream":
        assert answer.status == 200 and answer.events()[-1] == b"[DONE]"
    else:
        assert answer.status == 404
        assert_openai_error(answer.json(), 404, "rollout-nope")


# ---------------------------------------------------------------------------------------------- 4. the rest of HTTP/1.1
def chunked(data: bytes, size: int = 20) -> bytes:
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def test_http_1_0_is_answered_then_closed_or_kept_alive_as_asked() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), body, version="HTTP/1.0"))
            closing = await agent.answer()
            after = await agent.rest()
        async with Agent.connect(proxy.url) as agent:
            await agent.send(
                request(route(rid, aid), body, version="HTTP/1.0", headers=["Connection: keep-alive"])
            )
            kept = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    for answer in (closing, kept, following):
        assert_answered(answer, mock, body)
    assert closing.header("connection") == "close" and after == b""
    assert kept.header("connection") == "keep-alive" and following.header("connection") is None
    assert [c.status for c in calls] == ["ok"] * 3


@LOOPS
async def test_a_streamed_answer_to_an_http_1_0_agent_ends_with_the_connection() -> None:
    """An HTTP/1.0 client reads no chunked framing: the events go as they are, the end is the close."""
    body = chat(max_tokens=3, stream=True)
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), body, version="HTTP/1.0"))
            head = await agent.head()
            rest = await agent.rest()
        calls = finish(store, rid, aid)
    assert head.startswith(b"HTTP/1.1 200 ") and b"Transfer-Encoding" not in head
    assert b"Connection: close" in head and rest.endswith(b"data: [DONE]\n\n")
    assert [c.status for c in calls] == ["ok"]


async def test_a_chunked_request_body_is_read_and_the_connection_goes_on() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            head = request(route(rid, aid), b"", headers=["Transfer-Encoding: chunked"], length=False)
            framed = chunked(orjson.dumps(body))
            await agent.send(head, framed[:33], framed[33:], pause=0.002)
            first = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered(first, mock, body)
    assert_answered(following, mock, body)
    assert [c.status for c in calls] == ["ok"] * 2
    assert all(orjson.loads(r.body) == {**body, "return_token_ids": True} for r in mock.generation_requests())


async def test_expect_100_continue_gets_the_interim_then_the_answer() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), body, headers=["Expect: 100-continue"])
        end = data.index(b"\r\n\r\n") + 4
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[:end])  # the head alone: the body only once the proxy says continue
            interim = await agent.head()
            await agent.send(data[end:])
            first = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert_answered(first, mock, body)
    assert_answered(following, mock, body)
    assert [c.status for c in calls] == ["ok"] * 2


async def test_expect_100_continue_of_a_refused_call_gets_the_refusal_and_no_interim() -> None:
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        _, aid = claim(store)
        data = request(route("rollout-nope", aid), chat(), headers=["Expect: 100-continue"])
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[: data.index(b"\r\n\r\n") + 4])
            refused = await agent.answer()
            assert await agent.rest() == b""
    assert refused.status == 404 and refused.header("connection") == "close"
    assert mock.generation_requests() == []


async def test_a_percent_escaped_rollout_id_reaches_its_rollout() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        # rollout-... as %72o%6C%6Cout%2D...: the same id, percent-escaped
        escaped = "".join(f"%{ord(c):02X}" if c in "rl-" else c for c in rid)
        assert escaped != rid
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(escaped, aid), body))
            first = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered(first, mock, body)
    assert_answered(following, mock, body)
    assert [(c.rollout_id, c.status) for c in calls] == [(rid, "ok")] * 2


async def test_a_malformed_header_line_gets_a_400_naming_the_parsers_reason_and_the_connection_closes() -> (
    None
):
    body = orjson.dumps(chat())
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            data = request(route(rid, aid), body, headers=["X-Broken header without a colon"])
            await agent.send(data)
            answer = await agent.answer()
            assert await agent.rest() == b""  # a connection whose request cannot be parsed is closed
        async with Agent.connect(proxy.url) as agent:  # and the proxy serves on
            await agent.send(request(route(rid, aid), chat()))
            following = await agent.answer()
    assert answer.status == 400 and answer.header("connection") == "close"
    assert_openai_error(answer.json(), 400, "malformed HTTP/1.1 request", "header")
    assert_answered(following, mock, chat())
    assert len(mock.generation_requests()) == 1


async def test_a_body_over_max_body_bytes_gets_413_naming_the_limit_before_it_is_sent() -> None:
    big, body = chat("x" * 2000), chat()
    async with MockVLLM() as mock, proxied(mock, max_body_bytes=1000) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), big)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[: data.index(b"\r\n\r\n") + 4])  # the head alone
            refused = await agent.answer()
            assert await agent.rest() == b""  # closed: the body is never read
        async with Agent.connect(proxy.url) as agent:  # a body within the limit is read
            await agent.send(request(route(rid, aid), body))
            answered = await agent.answer()
        calls = finish(store, rid, aid)
    assert refused.status == 413 and refused.header("connection") == "close"
    assert_openai_error(refused.json(), 413, "2", "1000 bytes")
    assert_answered(answered, mock, body)
    assert len(mock.generation_requests()) == 1 and [c.status for c in calls] == ["ok"]


async def test_a_chunked_body_growing_past_max_body_bytes_gets_413_and_the_connection_closes() -> None:
    async with MockVLLM() as mock, proxied(mock, max_body_bytes=1000) as (proxy, store):
        rid, aid = claim(store)
        head = request(route(rid, aid), b"", headers=["Transfer-Encoding: chunked"], length=False)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(head, b"%x\r\n%b\r\n" % (1200, b"x" * 1200))  # past the limit, not ended
            refused = await agent.answer()
            assert await agent.rest() == b""
    assert refused.status == 413 and refused.header("connection") == "close"
    assert_openai_error(refused.json(), 413, "1000 bytes")
    assert mock.generation_requests() == [] and proxy.m_calls.value("rejected") == 1


async def test_requests_of_every_framing_pipelined_in_one_write_are_answered_in_order() -> None:
    """A ``Content-Length`` request, a chunked one, an ``HTTP/1.0`` keep-alive one and another, in one write."""
    bodies = [chat(f"turn {i}") for i in range(4)]
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        second = request(route(rid, aid), b"", headers=["Transfer-Encoding: chunked"], length=False)
        second += chunked(orjson.dumps(bodies[1]))
        third = request(route(rid, aid), bodies[2], version="HTTP/1.0", headers=["Connection: keep-alive"])
        async with Agent.connect(proxy.url) as agent:
            await agent.send(
                request(route(rid, aid), bodies[0]) + second + third + request(route(rid, aid), bodies[3])
            )
            answers = [await agent.answer() for _ in range(4)]
        calls = finish(store, rid, aid)
    for answer, body in zip(answers, bodies, strict=True):
        assert_answered(answer, mock, body)
    assert [c.status for c in calls] == ["ok"] * 4


# ---------------------------------------------------------------------------------------------- 5. errors
async def test_an_unknown_rollout_or_attempt_is_404_and_a_finished_rollout_409_naming_the_id() -> None:
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        answers = []
        async with Agent.connect(proxy.url) as agent:
            for path in (route("rollout-nope", aid), route(rid, "attempt-nope")):
                await agent.send(request(path, chat()))
                answers.append(await agent.answer())
            finish(store, rid, aid)
            await agent.send(request(route(rid, aid), chat()))
            answers.append(await agent.answer())
            await agent.send(request(route(rid, aid), chat()))  # the connection still serves after errors
            answers.append(await agent.answer())
    for answer, (status, word) in zip(
        answers, [(404, "rollout-nope"), (404, "attempt-nope"), (409, rid), (409, rid)], strict=True
    ):
        assert answer.status == status and answer.header("content-type") == "application/json"
        assert answer.header("content-length") == str(len(answer.body))
        assert_openai_error(answer.json(), status, word)
    assert mock.generation_requests() == [] and proxy.m_calls.value("rejected") == 4


# ---------------------------------------------------------------------------------------------- 6. streams
@LOOPS
async def test_a_streamed_answer_is_chunked_ends_with_done_and_the_terminator_and_is_recorded() -> None:
    body = chat(max_tokens=6, stream=True, stream_options={"include_usage": True})
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), body))
            answer = await agent.answer()
            await agent.send(request(route(rid, aid), chat()))  # the connection goes on after a stream
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert answer.status == 200 and (answer.header("content-type") or "").startswith("text/event-stream")
    assert answer.header("transfer-encoding") == "chunked" and answer.header("content-length") is None
    assert answer.raw.endswith(b"0\r\n\r\n") and answer.body.endswith(b"data: [DONE]\n\n")
    events = answer.events()
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    [(prompt, response)] = mock.expected(body)
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == response
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert_answered(following, mock, chat())
    first, second = calls
    assert (first.status, first.prompt_token_ids, first.response_token_ids) == ("ok", prompt, response)
    assert second.status == "ok"


# ---------------------------------------------------------------------------------------------- 7-8. agents leaving
@LOOPS
@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "before-the-answer"])
async def test_an_agent_leaving_while_its_call_is_answered_cancels_it_and_the_proxy_serves_on(
    stream: bool,
) -> None:
    async with MockVLLM(completion_tokens=200, chunk_latency=0.02) as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        if not stream:
            mock.stall_next()  # an answer that never comes
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), chat(max_tokens=200, stream=stream)))
            if stream:
                first = await agent.first_event()
                assert first.startswith(b"HTTP/1.1 200 ") and b"data: " in first
            else:
                with anyio.fail_after(WAIT):
                    await mock.wait_until(lambda m: m.active == 1)
        # the agent closed its socket
        with anyio.fail_after(WAIT):
            await mock.wait_until(lambda m: m.cancelled == 1)  # the upstream request was cancelled
        await until(lambda: proxy.m_calls.value("cancelled") == 1 and proxy.in_flight == 0)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), chat()))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered(following, mock, chat())
    assert [(c.status, c.error) for c in calls] == [("failed", "agent disconnected"), ("ok", None)]
    assert calls[0].response_token_ids is None


@LOOPS
@pytest.mark.parametrize("where", ["head", "body"])
async def test_an_agent_leaving_while_it_sends_its_request_leaves_nothing_recorded(where: str) -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), body)
        end = data.index(b"\r\n\r\n")
        cut = end - 10 if where == "head" else end + 4 + len(orjson.dumps(body)) // 2
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[:cut])
            agent.writer.write_eof()  # the agent is done sending: the proxy, on its end, closes
            assert await agent.rest() == b""  # no answer to half a request, and the proxy saw the end
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data)
            following = await agent.answer()
        counters = proxy.counters()
        calls = finish(store, rid, aid)
    assert_answered(following, mock, body)
    assert len(mock.generation_requests()) == 1 and len(calls) == 1 and calls[0].status == "ok"
    assert counters["proxy/calls_ok"] == 1
    assert counters["proxy/calls_cancelled"] == counters["proxy/calls_rejected"] == 0


# ---------------------------------------------------------------------------------------------- 9. a table of requests
AUTH = "Authorization: Bearer s3cret"
Ids = dict[str, str]


def call_to(tail: str, body: Any = None, *, method: str = "POST", headers: Sequence[str] = (AUTH,)) -> Any:
    """A case: the request to ``tail`` after the claimed attempt's ``/v1/`` (``{name}`` in a ``tail`` that starts
    with ``/``: a whole path with the ids below)."""

    def make(ids: Ids) -> bytes:
        path = tail.format(**ids) if tail.startswith("/") else route(ids["rid"], ids["aid"], tail)
        return request(path, body, method=method, headers=headers)

    return make


def raw_head(target: str, *lines: str) -> Any:
    """A case: a ``POST`` to ``target`` (after the claimed attempt's ``/v1/``, sent as written, latin-1) with
    exactly these header ``lines`` and a ``{}`` body."""

    def make(ids: Ids) -> bytes:
        head = [f"POST {route(ids['rid'], ids['aid'], target)} HTTP/1.1", *lines, "Content-Length: 2"]
        return ("\r\n".join(head) + "\r\n\r\n{}").encode("latin-1")

    return make


STREAM = {"stream": True, "stream_options": {"include_usage": True}}
#: Requests and what each gets (``{rid}``/``{aid}``: the claimed attempt's ids, ``{done}``/``{done_aid}``: a finished
#: rollout's).
CASES: dict[str, Any] = {
    "chat": call_to("chat/completions", chat(logprobs=True, n=2)),
    "chat-stream": call_to("chat/completions", chat(logprobs=True, **STREAM)),
    "completions": call_to("completions", {"model": "mock", "prompt": ["ab", "cd"], "max_tokens": 3}),
    "responses": call_to("responses", {"model": "mock", "input": "hi", "max_output_tokens": 4}),
    "responses-stream": call_to(
        "responses", {"model": "mock", "input": "hi", "max_output_tokens": 4, "stream": True}
    ),
    "messages": call_to(
        "messages", {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    ),
    "messages-stream": call_to(
        "messages",
        {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
    "models": call_to("models", method="GET"),
    "v1-root": call_to("", method="GET"),
    "query": call_to("chat/completions?x=1", chat()),
    "double-slash": call_to("/chat/completions", chat()),
    "empty-body": call_to("chat/completions", b""),
    "no-token": call_to("chat/completions", chat(), headers=()),
    "not-json": call_to("chat/completions", b'{"model": "mock",'),
    "not-object": call_to("completions", b"[1, 2]"),
    "unknown-rollout": call_to("/rollout/rollout-nope/attempt/{aid}/v1/chat/completions", chat()),
    "finished-rollout": call_to("/rollout/{done}/attempt/{done_aid}/v1/chat/completions", chat()),
    "dot-segment": call_to("/rollout/{rid}/attempt/{aid}/v1/../health", method="GET"),
    "no-route": call_to("/rollout/{rid}/attempt/{aid}/v2/chat/completions", chat()),
    "head": call_to("models", method="HEAD"),
    # heads HTTP/1.1 refuses (RFC 9112, 3.2: no Host, or two) and a duplicated single-valued header
    "no-host": raw_head("chat/completions", AUTH, "Content-Type: application/json"),
    "two-hosts": raw_head("chat/completions", "Host: a", "Host: b", AUTH, "Content-Type: application/json"),
    "two-content-types": raw_head(
        "chat/completions", "Host: a", AUTH, "Content-Type: application/json", "Content-Type: text/plain"
    ),
    # request targets with bytes a request-target cannot hold (RFC 9112, 3.2; RFC 3986)
    "lf-in-target": raw_head("chat/completions\nX-Injected:1", "Host: a", AUTH),
    "ctl-in-target": raw_head("chat/completions\x01", "Host: a", AUTH),
    "tab-in-target": raw_head("chat/\tcompletions", "Host: a", AUTH),
    "utf8-in-target": raw_head("chat/completions\xc3\xa9", "Host: a", AUTH),
    # what a URL parser's path is: a fragment and escapes do not change the route
    "fragment": call_to("chat/completions#x", chat()),
    "escaped-slash": call_to("chat%2Fcompletions", chat()),
    "escaped-dots": call_to("/rollout/{rid}/attempt/{aid}/v1/%2e%2e/health", method="GET"),
}


#: What each case gets: its status, the calls counted (the ``proxy/calls_*`` counters that moved), the status of
#: a next call on the same connection (``None``: the connection was closed after the answer) and the statuses of
#: the calls recorded for the attempt (the case's rows, then the next call's).
EXPECTED: dict[str, tuple[int, dict[str, float], int | None, list[str]]] = {
    "chat": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok", "ok"]),
    "chat-stream": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "completions": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok", "ok"]),
    "ctl-in-target": (400, {}, None, []),
    "dot-segment": (400, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "double-slash": (404, {}, 200, ["ok"]),
    "empty-body": (400, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "escaped-dots": (400, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "escaped-slash": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "finished-rollout": (409, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "fragment": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "head": (200, {"proxy/calls_ok": 1.0}, 200, ["ok"]),
    "lf-in-target": (400, {}, None, []),
    "messages": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "messages-stream": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "models": (200, {"proxy/calls_ok": 1.0}, 200, ["ok"]),
    "no-host": (400, {}, None, []),
    "no-route": (404, {}, 200, ["ok"]),
    "no-token": (401, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "not-json": (400, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "not-object": (400, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "query": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "responses": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "responses-stream": (200, {"proxy/calls_ok": 1.0}, 200, ["ok", "ok"]),
    "tab-in-target": (400, {}, None, []),
    "two-content-types": (400, {}, None, []),
    "two-hosts": (400, {}, None, []),
    "unknown-rollout": (404, {"proxy/calls_rejected": 1.0}, 200, ["ok"]),
    "utf8-in-target": (400, {}, None, []),
    "v1-root": (404, {"proxy/calls_upstream_error": 1.0}, 200, ["ok"]),
}


def test_every_case_has_its_expectation() -> None:
    assert set(CASES) == set(EXPECTED)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_each_request_gets_its_status_its_count_its_records_and_the_connection_it_should(
    case: str,
) -> None:
    """A proxy with a token, one request of the table on a fresh connection, then a next call on the same one:
    what was answered, counted and recorded, and whether the connection served on. An answer that refuses
    closes the connection when the proxy could not read the request (its ``Connection: close`` says so); an
    error of the proxy's own is OpenAI-shaped (or in a translated call's API) and names what was wrong."""
    async with MockVLLM() as mock, proxied(mock, token="s3cret") as (proxy, store):
        rid, aid = claim(store)
        done, done_aid = claim(store)
        finish(store, done, done_aid)
        ids = {"rid": rid, "aid": aid, "done": done, "done_aid": done_aid}
        async with Agent.connect(proxy.url) as agent:
            await agent.send(CASES[case](ids))
            answer = await agent.answer(to_head=case == "head")
            counted = {k: v for k, v in proxy.counters().items() if k.startswith("proxy/calls_") and v}
            following = await agent.answer_after(request(route(rid, aid), chat(), headers=[AUTH]))
        calls = finish(store, rid, aid)
    serves_on = None if following is None else following.status
    assert (answer.status, counted, serves_on, [c.status for c in calls]) == EXPECTED[case], answer
    assert (answer.header("connection") == "close") == (serves_on is None)
    if answer.status >= 400 and (answer.header("content-type") or "").startswith("application/json"):
        error = answer.json()["error"]
        assert error["message"] and error.get("code", answer.status) in (answer.status, None)
    if case in ("fragment", "escaped-slash"):  # recorded as the chat call it is, with its ids
        [(prompt, response)] = mock.expected(chat())
        assert (calls[0].path, calls[0].prompt_token_ids, calls[0].response_token_ids) == (
            "/v1/chat/completions",
            prompt,
            response,
        )


# ---------------------------------------------------------------------------------------------- 10. slow readers
@LOOPS
@pytest.mark.parametrize(("stream", "tokens"), [(False, 50_000), (True, 20_000)], ids=["whole", "stream"])
async def test_a_large_answer_read_slowly_arrives_whole_and_correct(stream: bool, tokens: int) -> None:
    """A few MB of answer (tokens with their logprobs), read by an agent with a small receive window a piece at a
    time with a pause after each: more than the loopback socket's buffers hold (Linux's send buffer grows to 4 MiB
    at most), so the proxy's writes wait on the agent's reading; it all arrives, as the backend sent it."""
    body = chat(max_tokens=tokens, logprobs=True, stream=stream)
    async with MockVLLM(completion_tokens=tokens) as mock, proxied(mock) as (proxy, store):
        async with aiohttp.ClientSession() as http:  # the same call straight to the backend, for reference
            async with http.post(
                f"{mock.url}/v1/chat/completions", json={**body, "return_token_ids": True}
            ) as r:
                direct = await r.read()
        rid, aid = claim(store)
        async with Agent.connect(proxy.url, piece=16 << 10, pause=0.001, rcvbuf=4096) as agent:
            await agent.send(request(route(rid, aid), body))
            answer = await agent.answer(seconds=30)
            await agent.send(request(route(rid, aid), chat()))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert answer.status == 200 and len(answer.body) > 4 << 20

    def volatile_free(payload: bytes) -> Any:
        value = orjson.loads(payload)
        value.pop("id", None)
        value.pop("created", None)
        return value

    if stream:
        direct_events = [e.removeprefix(b"data: ") for e in direct.split(b"\n\n") if e.strip()]
        assert answer.events()[-1] == direct_events[-1] == b"[DONE]"
        assert [volatile_free(e) for e in answer.events()[:-1]] == [
            volatile_free(e) for e in direct_events[:-1]
        ]
    else:
        assert answer.header("content-length") == str(len(answer.body))
        assert volatile_free(answer.body) == volatile_free(direct)
    assert_answered(following, mock, chat())
    [(prompt, response)] = mock.expected(body)
    first = calls[0]
    assert (first.status, first.prompt_token_ids, first.response_token_ids) == ("ok", prompt, response)
    assert first.logprobs is not None and len(first.logprobs) == tokens


# ---------------------------------------------------------------------------------------------- shutdown
async def test_shutdown_cancels_a_call_read_here_after_its_grace_and_closes_every_connection() -> None:
    async with MockVLLM() as mock:
        store = TaskStore()
        proxy = LLMProxy(
            store, backends=[mock.url], registry=Registry(), retry=FAST_RETRY, shutdown_grace=0.2
        )
        rid, aid = claim(store)
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            async with Agent.connect(proxy.url) as idle, Agent.connect(proxy.url) as waiting:
                await idle.send(request(route(rid, aid), chat()))
                answered = await idle.answer()  # then idle, kept alive
                mock.stall_next()
                await waiting.send(request(route(rid, aid), chat()))
                with anyio.fail_after(WAIT):
                    await mock.wait_until(lambda m: m.active == 1)
                tg.cancel_scope.cancel()  # the proxy shuts down
                with anyio.CancelScope(shield=True):
                    left = (await idle.rest(), await waiting.rest())
        with anyio.fail_after(WAIT):
            await mock.wait_until(lambda m: m.cancelled == 1)
        calls = finish(store, rid, aid)
    assert_answered(answered, mock, chat())
    assert left == (b"", b"")  # both closed; the waiting one got no answer
    assert [(c.status, c.error) for c in calls] == [("ok", None), ("failed", "proxy shutting down")]


async def test_a_connection_stays_open_in_use_past_the_idle_timeout_and_closes_once_idle() -> None:
    """The idle deadline runs from a connection's last answer: one in use for three times the idle timeout
    serves every call, and closes once idle that long."""
    idle = 0.4
    body = chat()
    async with MockVLLM() as mock, proxied(mock, idle_timeout=idle) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            started = time.monotonic()
            answers = []
            while time.monotonic() - started < 3 * idle:  # in use for three times the idle timeout
                answers.append(await agent.answer_after(request(route(rid, aid), body)))
                await anyio.sleep(idle / 4)
            assert len(answers) >= 4 and None not in answers, answers
            for answer in answers:
                assert answer is not None
                assert_answered(answer, mock, body)
            assert await agent.rest() == b""  # idle: closed by the proxy within WAIT
