"""The proxy under overload: its event loop's lag measured, new calls answered 429 with ``Retry-After`` in the
agent's API while the lag is over the limit, calls already admitted carried to their end, the real openai and
anthropic SDKs coming back after the delay and getting their answer. The loop is made late the way a burst of
work makes it late: a callback that holds it (``time.sleep`` on the loop)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import anthropic
import anyio
import openai
import orjson
import pytest
from test_translate import claim, finish, proxied

from aglverl.daemon import AgentDaemon, DaemonConfig
from aglverl.metrics import Registry
from aglverl.proxy import LLMProxy, Overload, OverloadPolicy
from aglverl.proxy.call import ProxyError
from aglverl.testing import MockVLLM

pytestmark = pytest.mark.anyio

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
#: The same call in each API the proxy speaks (path after /v1/, body).
CALLS = {
    "chat/completions": CHAT,
    "responses": {"model": "mock", "input": "hi", "max_output_tokens": 4},
    "messages": {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
}


async def stall(overload: Overload, seconds: float) -> None:
    """Hold the loop for ``seconds``, then return once the lag probe has run after it: an event due just after
    the probe's next time, and asyncio runs due timers in the order they are due."""
    measured = anyio.Event()
    asyncio.get_running_loop().call_later(overload.policy.probe_interval * 1.01, measured.set)
    time.sleep(seconds)  # noqa: ASYNC251  # holding the loop is the point: the burst of work on it
    await measured.wait()


def test_the_overload_policy_refuses_values_that_are_not_seconds() -> None:
    for field in ("max_lag", "retry_after", "probe_interval", "window"):
        with pytest.raises(
            ValueError, match=rf"OverloadPolicy\.{field} must be a positive number of seconds"
        ):
            OverloadPolicy(**{field: 0})
    with pytest.raises(ValueError, match=r"OverloadPolicy\.min_in_flight must be an integer >= 0"):
        OverloadPolicy(min_in_flight=-1)


async def test_the_lag_probe_measures_a_stalled_loop_and_forgets_it_over_its_window() -> None:
    overload = Overload(Registry(), OverloadPolicy(max_lag=0.05, probe_interval=0.01, window=0.1))
    overload.start()
    try:
        await stall(overload, 0.5)
        stalled = overload.statistics()
        assert stalled.lag > 0.4 and stalled.late_seconds >= 0.49 and overload.overloaded
        await anyio.sleep(0.5)  # five windows: the moving average forgets in time, not in events
        calm = overload.statistics()
    finally:
        overload.stop()
    assert calm.lag < stalled.lag / 4 and calm.probes > stalled.probes
    assert stalled.overloaded_seconds < calm.overloaded_seconds < 0.5  # counted while it was over the limit


async def test_an_overloaded_proxy_answers_new_calls_429_in_their_api_and_finishes_admitted_ones() -> None:
    async with (
        MockVLLM(latency=1.0) as mock,
        proxied(mock.url, overload=OverloadPolicy(max_lag=0.05)) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        admitted = [claim(proxy, store) for _ in range(8)]
        _, _, base = claim(proxy, store)
        answers: list[int] = []

        async def call(admitted_base: str) -> None:
            async with http.post(f"{admitted_base}/chat/completions", json=CHAT) as response:
                await response.read()
                answers.append(response.status)

        async with anyio.create_task_group() as tg:
            for _, _, admitted_base in admitted:
                tg.start_soon(call, admitted_base)
            with anyio.fail_after(20):
                await mock.wait_until(lambda m: m.active == 8)  # in flight: the policy's min_in_flight
            await stall(proxy.overload, 0.6)  # the lag stays over twice the limit (all refused) for ~0.7 s
            refused: dict[str, tuple[int, Any, Any]] = {}
            for path, body in CALLS.items():
                async with http.post(f"{base}/{path}", json=body) as response:
                    refused[path] = (response.status, response.headers, orjson.loads(await response.read()))
        metrics = proxy.registry.render()  # what the daemon's /metrics renders
        counters = proxy.counters()
        records = [len(finish(store, rid, aid)) for rid, aid, _ in admitted]
    assert answers == [200] * 8 and mock.completed == 8  # admitted before: never dropped
    for status, headers, _ in refused.values():
        assert status == 429 and headers["Retry-After"] == "1"
        assert 500 <= int(headers["retry-after-ms"]) <= 1500  # spread: those turned away come back apart
    assert refused["chat/completions"][2]["error"]["type"] == "RateLimitError"
    assert "overloaded" in refused["chat/completions"][2]["error"]["message"]
    assert refused["responses"][2]["error"]["type"] == "rate_limit_error"
    assert refused["messages"][2] == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": refused["messages"][2]["error"]["message"]},
    }
    assert counters["proxy/calls_shed"] == 3 and counters["proxy/calls_rejected"] == 3
    assert counters["proxy/loop_lag_seconds"] > 0 and counters["proxy/loop_overloaded_seconds"] > 0
    assert "aglverl_proxy_loop_lag_seconds" in metrics and "aglverl_proxy_calls_shed_total 3" in metrics
    assert records == [1] * 8


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_the_sdks_wait_out_retry_after_and_get_their_answer(sdk: str) -> None:
    """The SDKs' own retry (their default two retries): the first try, right after the stall, is turned away
    with a 429; the SDK waits the ``retry-after-ms`` the proxy gave (0.5-1.5 s), and its retry, the loop's lag
    back under the limit by then, is answered."""
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store):
        proxy.reconfigure(overload=OverloadPolicy(max_lag=0.1, window=0.2, min_in_flight=0))
        rid, aid, base = claim(proxy, store)
        # After the stall the lag is over twice the limit for ~0.2 s (the first try refused), under the limit
        # from ~0.36 s (the retry answered).
        if sdk == "openai":
            async with openai.AsyncOpenAI(base_url=base, api_key="unused") as client:
                await stall(proxy.overload, 0.6)
                answer = await client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
            text = answer.choices[0].message.content
        else:
            async with anthropic.AsyncAnthropic(
                base_url=base.removesuffix("/v1"), api_key="unused"
            ) as client_:
                await stall(proxy.overload, 0.6)
                message = await client_.messages.create(**CALLS["messages"])  # type: ignore[call-overload]
            text = "".join(b.text for b in message.content if b.type == "text")
        shed = proxy.overload.statistics().shed
        calls = finish(store, rid, aid)
    assert text and shed == 1 and mock.completed == 1 and len(calls) == 1


async def test_a_late_loop_with_few_calls_in_flight_or_refusing_off_sheds_nothing() -> None:
    """The default ``min_in_flight``: a loop made late with no call in flight (a stall of the process, other
    work on its loop) has nothing to shed; ``refuse=False`` admits everything and still reports the lag of a
    loop held while a call is in flight."""
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store), aiohttp.ClientSession() as http:
        proxy.reconfigure(overload=OverloadPolicy(max_lag=0.05))
        _, _, base = claim(proxy, store)
        await stall(proxy.overload, 0.3)
        async with http.post(f"{base}/chat/completions", json=CHAT) as response:
            quiet = response.status
        proxy.reconfigure(overload=OverloadPolicy(max_lag=0.05, min_in_flight=0, refuse=False))
        mock.latency = 1.0  # the next call stays in flight while the loop is held
        async with anyio.create_task_group() as tg:
            statuses: list[int] = []

            async def post() -> None:
                async with http.post(f"{base}/chat/completions", json=CHAT) as response:
                    statuses.append(response.status)

            tg.start_soon(post)
            await mock.wait_until(lambda m: m.active == 1)
            await stall(proxy.overload, 0.3)
        statistics = proxy.overload.statistics()
    assert (quiet, *statuses) == (200, 200) and statistics.shed == 0 and statistics.overloaded_seconds > 0


async def test_the_probe_rests_while_no_call_is_in_flight_and_a_call_wakes_it() -> None:
    """An idle proxy's loop is not woken by the probe: once a probe finds no call in flight none follows, a
    stall then is not measured, and the next call's admission starts the probe again, the lag decayed over
    the rest as if the idle loop had been on time."""
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store), aiohttp.ClientSession() as http:
        overload = proxy.overload
        proxy.reconfigure(overload=OverloadPolicy(max_lag=0.05, probe_interval=0.01))
        overload.start()  # its next probe at the new interval
        _, _, base = claim(proxy, store)
        async with http.post(f"{base}/chat/completions", json=CHAT) as response:
            assert response.status == 200
        for _ in range(3):  # the call's end has run, and a probe since, with nothing in flight: it rests
            await stall(overload, 0.0)
        resting = overload.statistics()
        await stall(overload, 0.3)
        await anyio.sleep(0.05)
        assert overload.statistics().probes == resting.probes and overload.lag < 0.05
        async with http.post(f"{base}/chat/completions", json=CHAT) as response:
            assert response.status == 200
        await stall(overload, 0.0)
        assert overload.statistics().probes > resting.probes


def test_past_the_limit_a_share_of_new_calls_is_turned_away_that_grows_with_the_excess() -> None:
    overload = Overload(Registry(), OverloadPolicy(max_lag=0.1, min_in_flight=8))

    def turned_away(lag: float, in_flight: int = 8, calls: int = 2000) -> int:
        overload.lag = lag
        refused = 0
        for _ in range(calls):
            try:
                overload.check(in_flight)
            except ProxyError as exc:
                assert exc.status == 429
                refused += 1
        return refused

    assert turned_away(0.1) == 0 and turned_away(0.3, in_flight=7) == 0  # at the limit; too few in flight
    assert 800 <= turned_away(0.15) <= 1200  # half of them, give or take 9 standard deviations
    assert turned_away(0.2) == turned_away(0.5) == 2000  # all of them from twice the limit


def test_the_policy_is_a_proxy_setting_from_the_daemons_keywords_to_every_part() -> None:
    """``AgentDaemon(overload=...)`` is the proxy's ``overload`` setting (a shard gets it in its config, whole);
    reconfiguring the proxy hands the new policy to the probe and the check."""
    policy = OverloadPolicy(max_lag=0.25, min_in_flight=2)
    config = DaemonConfig.from_keywords(overload=policy, pause_timeout=30)
    assert config.proxy.overload is policy and config.proxy.pause_timeout == 30
    daemon = AgentDaemon(overload=policy)
    assert daemon.proxy.overload.policy is policy
    assert isinstance(daemon.proxy, LLMProxy)
    calmer = OverloadPolicy(max_lag=1.0)
    assert daemon.proxy.reconfigure(overload=calmer).overload is calmer
    assert daemon.proxy.overload.policy is calmer
    with pytest.raises(ValueError, match="max_lag"):
        OverloadPolicy(max_lag=0)


# ---------------------------------------------------------------------------------------------- cheaply, never mid-conversation
async def refusing_all(proxy: LLMProxy) -> None:
    """Make the proxy shed every new call: its lag held over twice the limit for a while (~0.7 s)."""
    proxy.reconfigure(overload=OverloadPolicy(max_lag=0.05, min_in_flight=0))
    await stall(proxy.overload, 0.6)
    assert proxy.overload.shedding


async def post(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> tuple[int, Any]:
    async with http.post(url, json=CHAT, **kwargs) as response:
        return response.status, orjson.loads(await response.read())


@pytest.mark.parametrize("where", ["socket", "handler"])
async def test_a_later_call_of_a_rollout_under_way_is_never_refused_a_new_rollouts_first_call_is(
    where: str,
) -> None:
    """The review's defect: turn 2 of a conversation got 429s while the loop was late, and its earlier turns were
    wasted. A call of an attempt that already had a call let in is never turned away, on either path a call
    can be refused on: at the socket (before aiohttp reads it), or in the handler (a request the socket does not
    judge: here one that says ``Expect: 100-continue``)."""
    headers = {"Expect": "100-continue"} if where == "handler" else {}
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store), aiohttp.ClientSession() as http:
        _, _, under_way = claim(proxy, store)
        _, _, new = claim(proxy, store)
        first = await post(http, f"{under_way}/chat/completions", headers=headers)
        await refusing_all(proxy)
        later = [await post(http, f"{under_way}/chat/completions", headers=headers) for _ in range(3)]
        refused = await post(http, f"{new}/chat/completions", headers=headers)
        statistics = proxy.overload.statistics()
    assert first[0] == 200 and [status for status, _ in later] == [200, 200, 200]
    assert refused[0] == 429 and "overloaded" in refused[1]["error"]["message"]
    assert statistics.shed == 1


async def test_an_sdk_conversation_goes_on_while_the_proxy_sheds_new_calls() -> None:
    """The openai SDK without retries: a conversation whose first turn was let in runs its later turns through
    an overloaded proxy; the first turn of another one is turned away with a 429 (``RateLimitError``)."""
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        _, _, other = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        async with openai.AsyncOpenAI(base_url=base, api_key="-", max_retries=0) as client:
            answer = await client.chat.completions.create(model="mock", messages=messages, max_tokens=4)
            await refusing_all(proxy)
            for turn in range(3):
                messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
                messages += [{"role": "user", "content": f"more {turn}"}]
                answer = await client.chat.completions.create(model="mock", messages=messages, max_tokens=4)
        async with openai.AsyncOpenAI(base_url=other, api_key="-", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="mock", messages=messages[:1], max_tokens=4)
        calls = finish(store, rid, aid)
    assert len(calls) == 4 and all(c.status == "ok" for c in calls)


async def raw_exchange(url: str, writes: list[bytes], answers: int) -> list[bytes]:
    """``writes`` sent on one connection, a short pause between them (each its own read on the other side);
    the heads and bodies of ``answers`` responses read back."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for data in writes:
            writer.write(data)
            await writer.drain()
            await anyio.sleep(0.02)
        out = []
        with anyio.fail_after(20):
            for _ in range(answers):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                out.append(head + await reader.readexactly(length))
        return out
    finally:
        writer.close()


def raw_request(base: str, body: bytes) -> bytes:
    path = base.split("/", 3)[3]
    head = f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


#: The two event loops the proxy runs on (the CLI's and shards' uvloop, an embedding application's asyncio).
LOOPS = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)


@LOOPS
async def test_a_new_call_is_refused_at_the_socket_as_soon_as_its_head_is_in() -> None:
    """The 429 comes before the agent has sent its body (the decision needs none of it), and the connection is
    closed without reading the body; a call of a rollout under way, on a new connection, is answered."""
    body = orjson.dumps(CHAT)
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store), aiohttp.ClientSession() as http:
        _, _, under_way = claim(proxy, store)
        _, _, new = claim(proxy, store)
        assert (await post(http, f"{under_way}/chat/completions"))[0] == 200
        await refusing_all(proxy)
        new_request = raw_request(new, body)
        cut = new_request.index(b"\r\n\r\n") + 4
        host, port = proxy.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(new_request[:cut])  # the head alone
            with anyio.fail_after(5):
                refused = await reader.readuntil(b"\r\n\r\n")
                length = int(refused.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                assert await reader.read() == b""  # closed: the body is never read
        finally:
            writer.close()
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(raw_request(under_way, body))
            with anyio.fail_after(20):
                answered = await reader.readuntil(b"\r\n\r\n")
        finally:
            writer.close()
        rejected = proxy.counters()["proxy/calls_rejected"]
    assert refused.startswith(b"HTTP/1.1 429 ") and b"Retry-After: 1" in refused
    assert b"Connection: close" in refused
    assert answered.startswith(b"HTTP/1.1 200 ")
    assert rejected == 1 and len([r for r in mock.requests if r.path == "/v1/chat/completions"]) == 2


@LOOPS
@pytest.mark.parametrize("shedding", [False, True])
async def test_requests_cut_anywhere_reach_the_proxy_whole_whether_it_sheds_or_not(shedding: bool) -> None:
    """What the socket's reading hands on is the requests as they came, however they are cut: a head in pieces,
    a body in pieces, two requests in one read (pipelined), a request's end and the next one's start."""
    body = orjson.dumps(CHAT)
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store), aiohttp.ClientSession() as http:
        _, _, base = claim(proxy, store)
        assert (await post(http, f"{base}/chat/completions"))[0] == 200  # under way: let in while shedding
        if shedding:
            await refusing_all(proxy)
        one = raw_request(base, body)
        cuts = [  # (the writes, the requests in them)
            ([one[:7], one[7:40], one[40:]], 1),
            ([one[: len(one) - 5], one[len(one) - 5 :] + one[:20], one[20:]], 2),
            ([one + one], 2),
        ]
        answers = [await raw_exchange(proxy.url, writes, count) for writes, count in cuts]
    statuses = [a.split(b" ", 2)[1] for group in answers for a in group]
    assert statuses == [b"200"] * len(statuses) and len(statuses) == 5
    assert len([r for r in mock.requests if r.path == "/v1/chat/completions"]) == 6


async def test_agent_lightnings_hop_applies_the_proxys_decision_before_it_reads_a_body() -> None:
    """Agent Lightning's agents call through the task server's hop, then the proxy: a new rollout's first call
    is turned away at the hop (once: the proxy never sees it), the later calls of a rollout under way never."""
    async with (
        MockVLLM() as mock,
        AgentDaemon(backends=[mock.url], model="mock") as daemon,
        aiohttp.ClientSession() as http,
    ):
        for rollout_id in ("a", "b"):
            async with http.post(
                f"{daemon.server_url}/api/rollouts", json=[{"input": {}, "rollout_id": rollout_id}]
            ) as r:
                assert r.status == 201
        hop = f"{daemon.server_url}/proxy/rollout/{{}}/attempt/0/mode/train/openai/v1/chat/completions"
        first = await post(http, hop.format("a"))
        proxy = daemon.proxy
        assert isinstance(proxy, LLMProxy)
        await refusing_all(proxy)
        later = await post(http, hop.format("a"))
        refused = await post(http, hop.format("b"))
        counters = proxy.counters()
    assert (first[0], later[0], refused[0]) == (200, 200, 429)
    assert refused[1]["error"]["type"] == "RateLimitError"
    assert counters["proxy/calls_shed"] == 1 and counters["proxy/calls_rejected"] == 0  # never reached it
