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
    work on its loop) has nothing to shed; ``refuse=False`` admits everything and still reports the lag."""
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store), aiohttp.ClientSession() as http:
        proxy.reconfigure(overload=OverloadPolicy(max_lag=0.05))
        _, _, base = claim(proxy, store)
        await stall(proxy.overload, 0.3)
        async with http.post(f"{base}/chat/completions", json=CHAT) as response:
            quiet = response.status
        proxy.reconfigure(overload=OverloadPolicy(max_lag=0.05, min_in_flight=0, refuse=False))
        await stall(proxy.overload, 0.3)
        async with http.post(f"{base}/chat/completions", json=CHAT) as response:
            off = response.status
        statistics = proxy.overload.statistics()
    assert (quiet, off) == (200, 200) and statistics.shed == 0 and statistics.overloaded_seconds > 0


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
