"""The proxy's HTTP server against hostile and broken clients: admission before the body, the limits, the framing.

One test per hole issue 48 found on the server side (each fails on 019ee6f, whose own HTTP code and aiohttp's
server shared the socket): a body read and held before any authorization; a ``#fragment`` that took an attributed
call around admission and recording; a head stopped mid-way never closed, a head with bare LF line ends never
answered; 1,000 header lines, a 60 KB line, control bytes accepted and forwarded; a head dribbled a few bytes at a
time rescanned whole at every read (here: refused as soon as its line passes the limit, before it ends); a
``Content-Length`` padded with VT or FF taken; a mixed-case ``Transfer-Encoding`` missed while shedding, the 429
then answering bytes from inside a chunked body. Then the limits that had none before: the head and body
deadlines, the idle close, the cap on connections. Real loopback sockets, a real mock backend.
"""

from __future__ import annotations

import asyncio
import time

import anyio
import orjson
import pytest
from helpers.raw_http import (
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

from aglverl.proxy import LLMProxy, OverloadPolicy
from aglverl.store import TaskStore
from aglverl.testing import MockVLLM

pytestmark = pytest.mark.anyio

AUTH = "Authorization: Bearer s3cret"


def head_of(data: bytes) -> bytes:
    return data[: data.index(b"\r\n\r\n") + 4]


async def refusing_all(proxy: LLMProxy) -> None:
    """Make the proxy shed every new call: its loop held late over twice the limit (then the lag probe ran)."""
    proxy.reconfigure(overload=OverloadPolicy(max_lag=0.05, min_in_flight=0))
    measured = anyio.Event()
    asyncio.get_running_loop().call_later(proxy.overload.policy.probe_interval * 1.01, measured.set)
    time.sleep(0.6)  # noqa: ASYNC251  # holding the loop is the point: a burst of work on it
    await measured.wait()
    assert proxy.overload.shedding


async def dribble(agent: Agent, upto: int = 16 << 10) -> None:
    """Send a line's bytes 128 at a time (a millisecond apart), never ending it, until the proxy has closed the
    connection or ``upto`` bytes went."""
    sent = 0
    while sent < upto and not agent.reader.at_eof():
        await agent.send(b"z" * 128)
        sent += 128
        await asyncio.sleep(0.001)


# ---------------------------------------------------------------------------------------------- admission first
@LOOPS
@pytest.mark.parametrize("wrong", ["no-token", "unknown-attempt"])
async def test_a_refused_call_is_answered_before_its_body_is_sent_and_its_body_is_never_read(
    wrong: str,
) -> None:
    """A call without the token, or of an unknown attempt, declaring a 16 MiB body (under ``max_body_bytes``):
    its refusal comes once its head and a first piece of the body are in, the connection is then closed, and
    nothing reached the backend. (019ee6f answered only once the whole body had come, and held it.)"""
    async with MockVLLM() as mock, proxied(mock, token="s3cret") as (proxy, store):
        rid, aid = claim(store)
        path = route(rid, aid) if wrong == "no-token" else route(rid, "attempt-nope")
        auth = [] if wrong == "no-token" else [AUTH]
        head = request(path, b"", headers=auth, length=False).replace(
            b"\r\n\r\n", b"\r\nContent-Length: %d\r\n\r\n" % (16 << 20)
        )
        async with Agent.connect(proxy.url) as agent:
            await agent.send(head + b"x" * (64 << 10))
            refused = await agent.answer()
            assert await agent.rest() == b""
        counted = proxy.counters()["proxy/calls_rejected"]
    status, word = (401, "token") if wrong == "no-token" else (404, "attempt-nope")
    assert refused.status == status and refused.header("connection") == "close"
    assert_openai_error(refused.json(), status, word)
    assert counted == 1 and mock.generation_requests() == []


@LOOPS
async def test_a_fragment_on_an_attributed_path_is_admitted_checked_and_recorded_like_any_call() -> None:
    """``.../v1/chat/completions#x`` is the chat call it names: its sampling checked against the trainer's
    (a temperature the trainer does not sample at is refused), and a good one recorded with its ids. (019ee6f
    relayed both as unrecorded pass-throughs.)"""
    async with MockVLLM() as mock:
        async with proxied(mock, sampling_of=lambda rollout_id: {"temperature": 1.0}) as (proxy, store):
            rid, aid = claim(store)
            async with Agent.connect(proxy.url) as agent:
                await agent.send(request(route(rid, aid, "chat/completions#x"), chat(temperature=0.3)))
                refused = await agent.answer()
                await agent.send(request(route(rid, aid, "chat/completions#x"), chat()))
                answered = await agent.answer()
            calls = finish(store, rid, aid)
    assert refused.status == 400
    assert_openai_error(refused.json(), 400, "temperature=0.3")
    assert_answered(answered, mock, chat(temperature=1.0))
    [(prompt, response)] = mock.expected(chat(temperature=1.0))
    [call] = calls
    assert (call.status, call.path, call.prompt_token_ids, call.response_token_ids) == (
        "ok",
        "/v1/chat/completions",
        prompt,
        response,
    )
    [seen] = mock.generation_requests()
    assert seen.path == "/v1/chat/completions" and orjson.loads(seen.body)["return_token_ids"] is True


# ---------------------------------------------------------------------------------------------- heads
@LOOPS
async def test_a_head_that_stops_midway_gets_408_and_the_connection_closes() -> None:
    async with MockVLLM() as mock, proxied(mock, head_timeout=0.3) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), chat())
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[:40])
            timed_out = await agent.answer()
            assert await agent.rest() == b""
    assert timed_out.status == 408 and timed_out.header("connection") == "close"
    assert_openai_error(timed_out.json(), 408, "head", "0.3")
    assert mock.generation_requests() == []


@LOOPS
async def test_a_head_with_bare_lf_line_ends_gets_400() -> None:
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), chat()).replace(b"\r\n", b"\n")
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data)
            refused = await agent.answer()
            assert refused.status == 400
            assert await agent.rest() == b""
    assert_openai_error(refused.json(), 400, "malformed HTTP/1.1 request")
    assert mock.generation_requests() == []


@LOOPS
@pytest.mark.parametrize(
    ("extra", "status", "words"),
    [
        ([f"X-Filler-{i}: {i}" for i in range(1000)], 431, ("128 header lines",)),
        (["X-Long: " + "y" * 60_000], 431, ("X-Long", "8190 bytes")),
        (["X-Control: a\x01b"], 400, ("Invalid header value char",)),
        (["X-Control: a\x7fb"], 400, ("Invalid header value char",)),
        (["X-Nul: a\x00b"], 400, ("Invalid header value char",)),
    ],
    ids=["1000-lines", "60kb-line", "soh", "del", "nul"],
)
async def test_a_head_past_the_limits_or_with_control_bytes_is_refused_and_never_forwarded(
    extra: list[str], status: int, words: tuple[str, ...]
) -> None:
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), chat(), headers=extra))
            refused = await agent.answer()
            assert mock.requests == []  # nothing of it forwarded
            assert refused.status == status and refused.header("connection") == "close"
            assert await agent.rest() == b""
        counted = proxy.counters()
    assert_openai_error(refused.json(), status, *words)
    assert counted["proxy/calls_ok"] == 0


@LOOPS
@pytest.mark.parametrize("where", ["header", "target"])
async def test_a_head_line_dribbled_past_the_limit_is_refused_before_the_head_ends(where: str) -> None:
    """A header line (or the request target) sent 128 bytes at a time, never ended: once it has passed
    ``max_line_bytes`` (8,190) the answer comes (431, or 414 for a target) without the rest of the head. (019ee6f
    waited for the head's end, rescanning the whole head at each read.)"""
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        if where == "header":
            start = f"POST {route(rid, aid)} HTTP/1.1\r\nHost: a\r\nX-Slow: ".encode()
        else:
            start = f"GET {route(rid, aid, 'models')}?q=".encode()
        async with Agent.connect(proxy.url) as agent:
            await agent.send(start)
            await dribble(agent)
            refused = await agent.answer()
            assert await agent.rest() == b""
    status = 431 if where == "header" else 414
    assert refused.status == status
    assert_openai_error(refused.json(), status, "8190 bytes")
    assert mock.requests == []


@LOOPS
async def test_a_trailer_line_dribbled_past_the_limit_is_refused_before_it_ends() -> None:
    """After a chunked body's last chunk, a trailer line sent 128 bytes at a time, never ended: refused (431) once
    it passed ``max_line_bytes``, as a head line is (llhttp reports a trailer line only once whole)."""
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        head = request(route(rid, aid), b"", headers=["Transfer-Encoding: chunked"], length=False)
        body = orjson.dumps(chat())
        async with Agent.connect(proxy.url) as agent:
            await agent.send(head + b"%x\r\n%b\r\n0\r\nX-Trailer: " % (len(body), body))
            await dribble(agent)
            refused = await agent.answer()
            assert await agent.rest() == b""
    assert refused.status == 431
    assert_openai_error(refused.json(), 431, "8190 bytes")
    assert mock.generation_requests() == []


# ---------------------------------------------------------------------------------------------- framing
@LOOPS
@pytest.mark.parametrize("padded", ["\x0b2", "2\x0b", "\x0c2", "2\x0c"], ids=["vt-2", "2-vt", "ff-2", "2-ff"])
async def test_a_content_length_padded_with_vt_or_ff_is_refused(padded: str) -> None:
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = f"POST {route(rid, aid)} HTTP/1.1\r\nHost: a\r\nContent-Length: {padded}\r\n\r\n{{}}".encode()
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data)
            refused = await agent.answer()
            assert refused.status == 400
            assert await agent.rest() == b""
    assert_openai_error(refused.json(), 400, "Content-Length")
    assert mock.requests == []


@LOOPS
async def test_a_mixed_case_transfer_encoding_refused_while_shedding_is_framed_as_chunked() -> None:
    """While the proxy sheds, a new call with ``tRaNsFeR-eNcOdInG: ChUnKeD`` and its whole chunked body, then a
    call of a rollout under way, in one write: the first gets its 429, the second its answer, and nothing of
    the chunked body is taken for a request. (019ee6f missed the header while shedding, answered the 429 and
    then the body's chunk lines as a request: the connection desynchronised.)"""
    body = orjson.dumps(chat())
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        under_way, under_way_aid = claim(store)
        new, new_aid = claim(store)
        async with Agent.connect(proxy.url) as agent:  # a first call puts its attempt under way
            await agent.send(request(route(under_way, under_way_aid), chat()))
            assert (await agent.answer()).status == 200
        await refusing_all(proxy)
        head = request(route(new, new_aid), b"", headers=["tRaNsFeR-eNcOdInG: ChUnKeD"], length=False)
        chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(head + chunked + request(route(under_way, under_way_aid), chat()))
            refused = await agent.answer()
            answered = await agent.answer()
            proxy.reconfigure(overload=OverloadPolicy())
            answers_after = await agent.answer_after(request(route(under_way, under_way_aid), chat()))
        calls = finish(store, under_way, under_way_aid)
    assert refused.status == 429 and refused.header("retry-after") == "1"
    assert_answered(answered, mock, chat())
    assert answers_after is not None and answers_after.status == 200
    assert len(mock.generation_requests()) == 3 and [c.status for c in calls] == ["ok"] * 3


# ---------------------------------------------------------------------------------------------- deadlines, cap
@LOOPS
async def test_a_body_that_stops_arriving_gets_408_and_nothing_is_forwarded() -> None:
    async with MockVLLM() as mock, proxied(mock, head_timeout=0.3) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), chat())
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[:-5])  # the head and all but the body's last bytes
            timed_out = await agent.answer()
            assert await agent.rest() == b""
        counted = proxy.counters()
    assert timed_out.status == 408 and timed_out.header("connection") == "close"
    assert_openai_error(timed_out.json(), 408, "body", "0.3")
    assert mock.generation_requests() == [] and counted["proxy/calls_rejected"] == 1


@LOOPS
async def test_an_idle_connection_is_closed_after_the_idle_timeout_without_an_answer() -> None:
    async with MockVLLM() as mock, proxied(mock, idle_timeout=0.3) as (proxy, _):
        async with Agent.connect(proxy.url) as agent:
            with anyio.fail_after(WAIT):
                started = time.monotonic()
                assert await agent.rest() == b""
                waited = time.monotonic() - started
    assert waited >= 0.25


@LOOPS
@pytest.mark.parametrize("last", ["refused", "answered"])
async def test_a_kept_connection_waits_for_its_next_request_the_idle_timeout_whatever_its_last_answer(
    last: str,
) -> None:
    """After an answer the connection is kept, and idle: closed, unanswered, after ``idle_timeout``, never on the
    shorter head deadline, and never left open for good (a refusal at the head included)."""
    async with MockVLLM() as mock, proxied(mock, idle_timeout=0.4, head_timeout=0.1) as (proxy, store):
        rid, aid = claim(store)
        path = route("rollout-nope", aid) if last == "refused" else route(rid, aid)
        async with Agent.connect(proxy.url) as agent:
            answer = await agent.answer_after(request(path, chat()))
            answered = time.monotonic()
            assert await agent.rest() == b""  # nothing more is written: no 408
            waited = time.monotonic() - answered
    assert answer is not None and answer.status == (404 if last == "refused" else 200)
    assert answer.header("connection") is None
    assert waited >= 0.3


@LOOPS
async def test_a_connection_past_the_cap_gets_503_with_retry_after_and_a_later_one_is_served() -> None:
    async with MockVLLM() as mock, proxied(mock, max_connections=2) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as first, Agent.connect(proxy.url) as second:
            answers = [await first.answer_after(request(route(rid, aid), chat()))]
            async with Agent.connect(proxy.url) as third:
                await third.send(request(route(rid, aid), chat()))
                refused = await third.answer()
                assert await third.rest() == b""
            answers.append(await second.answer_after(request(route(rid, aid), chat())))
        await until(lambda: proxy.connections == 0)
        async with Agent.connect(proxy.url) as later:  # the first two closed: room again
            answers.append(await later.answer_after(request(route(rid, aid), chat())))
        metrics = proxy.registry.render()
    assert refused.status == 503 and refused.header("retry-after") == "1"
    assert_openai_error(refused.json(), 503, "max_connections", "2")
    for answer in answers:
        assert answer is not None
        assert_answered(answer, mock, chat())
    assert len(mock.generation_requests()) == 3
    assert 'aglverl_proxy_http_refused_total{status="503"} 1' in metrics


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_connections", 0),
        ("max_header_lines", -1),
        ("max_line_bytes", 1.5),
        ("head_timeout", 0),
        ("idle_timeout", float("nan")),
        ("max_body_bytes", True),
    ],
)
def test_a_limit_that_is_not_one_is_refused_when_the_config_is_made_naming_it(
    setting: str, value: object
) -> None:
    with pytest.raises(ValueError, match=setting):
        LLMProxy(TaskStore(), **{setting: value})  # type: ignore[arg-type]
