"""How far one LLM proxy process carries: the load at which its added latency p99 passes 5 ms.

Run: ``python benchmarks/proxy_capacity.py [--quick] [--max-seconds S]``. Prints ONE JSON object on stdout.

Three processes on loopback, so each CPU figure belongs to one program:

- the backend: a :class:`~aglverl.testing.MockVLLM` (vLLM-shaped answers: 256 completion tokens with their ids
  and, when asked, log-probs; streams one token per SSE event, ``chunk_latency`` apart, like an engine
  generating at ``1 / chunk_latency`` tokens/s per sequence). It does no model work, so the proxy's machine
  pays only for its bytes;
- one :class:`~aglverl.proxy.LLMProxy` with ``request_logprobs`` (every call recorded with its ids and
  log-probs, as a trainer's are), its own store holding the claimed rollouts, and a pyinstrument profiler it
  starts and stops on command;
- this process: an open-loop load generator (aiohttp).

Two sweeps, each raising the offered load level by level until the proxy's added latency p99 passes
``LIMIT_MS`` (or the proxy falls behind: under 90 % of the offered rate achieved), each level run twice, first
straight to the mock and then through the proxy, the same load, so that added latency is
``p99(through the proxy) - p99(direct)``:

- ``json``: chat completions arriving at a fixed rate (calls/s), answered with one JSON body of 256 tokens,
  their ids and log-probs. Latency: request to the last byte.
- ``stream``: streamed chat completions, one token per SSE event, arriving at a fixed rate (streams/s); the
  load is the events relayed per second. Latency: request to the last byte (``[DONE]``), whose added part is
  the proxy's delay on the stream's last event (each event is relayed as it comes; delays do not add up).

Direct and proxied loads run at the same time (the mock serves both), so that both see the same machine state
(other jobs come and go). The sustained figure of a sweep is its last level under the limit;
``cpu_bound_per_s`` is what one core would carry at the proxy's measured CPU cost per call (or event), with
no latency bound: the ceiling a less busy machine approaches. At that level the proxy is then run once
more with its profiler on: where its CPU goes (self time per function and per package, idle time apart).
Every figure is of the machine it ran on: the CPUs are shared with the load generator, the mock, and other
jobs (``machine.loadavg_1_5_15`` says how busy it was); the proxy's own CPU per call is the figure that
carries to another machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
from _common import (
    JsonChild,
    child_args,
    emit,
    machine_info,
    percentile,
    stdin_commands,
    summary_ms,
)
from proxy import call as _json_call  # benchmarks/proxy.py: one JSON call, its latency

#: The added latency p99 (ms) that ends a sweep.
LIMIT_MS = 5.0
COMPLETION_TOKENS = 256
#: Seconds between a stream's events: 4 ms is 250 tokens/s per sequence, a fast engine's decode.
CHUNK_LATENCY = 0.004
ROLLOUTS = 512
JSON_RATES = (25, 50, 100, 150, 200, 300, 400, 600, 800)  # calls/s
STREAM_RATES = (2, 4, 8, 16, 24, 32, 48, 64)  # streams/s (x 256 events each)
BODY = {
    "model": "mock",
    "messages": [{"role": "user", "content": "Tell me a long story, please."}],
    "max_tokens": COMPLETION_TOKENS,
}
HEADERS = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------------------------------- children
async def _run_mock(cfg: dict[str, Any]) -> None:
    from aglverl.testing import MockVLLM

    async with MockVLLM(
        completion_tokens=COMPLETION_TOKENS, chunk_latency=cfg["chunk_latency"], record_requests=False
    ) as mock:
        emit({"url": mock.url, "pid": os.getpid()})
        async for _ in stdin_commands():
            emit({"completed": mock.completed})


async def _run_proxy(cfg: dict[str, Any]) -> None:
    from proxy import serving_proxy  # benchmarks/proxy.py: a proxy with its store and claimed rollouts
    from pyinstrument import Profiler
    from pyinstrument.stack_sampler import get_stack_sampler

    async with serving_proxy(cfg["backend"], ROLLOUTS, request_logprobs=True) as (url, bases):
        emit({"url": url, "bases": bases, "pid": os.getpid()})
        profiler: Profiler | None = None
        async for cmd in stdin_commands():
            if cmd.get("profile") == "start":
                # Sampled on the loop thread's CPU clock: a process the shared machine preempts would
                # otherwise charge the wait to whatever it was running (mostly system calls).
                get_stack_sampler().timer_func = time.thread_time
                profiler = Profiler(interval=0.0005, async_mode="disabled")
                profiler.start()
                emit({"profiling": True})
            elif cmd.get("profile") == "stop" and profiler is not None:
                profiler.stop()
                emit(_profile_summary(profiler))
                profiler = None
            else:
                emit({"error": f"unknown command {cmd!r}"})


#: Where a sample's self time is idle: the event loop waiting in epoll for something to do (on the CPU clock,
#: only the system call's own cost).
_IDLE = {("select", "selectors.py"), ("poll", "selectors.py")}


def _package(path: str) -> str:
    """The package a frame's file belongs to, as a profile bucket."""
    if "/aglverl/proxy/" in path:
        return "aglverl.proxy." + Path(path).stem
    if "/aglverl/" in path:
        return "aglverl." + Path(path).stem
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if "<built-in>" in path or not path:
        return "builtins"
    return "stdlib." + Path(path).stem


def _profile_summary(profiler: Any) -> dict[str, Any]:
    """CPU self time per function and per package (the loop's epoll waits counted apart)."""
    session = profiler.last_session
    root = session.root_frame()
    by_function: Counter[str] = Counter()
    by_package: Counter[str] = Counter()
    idle = 0.0

    def walk(frame: Any) -> None:
        nonlocal idle
        self_time = frame.total_self_time
        path = frame.file_path or ""
        if (frame.function, Path(path).name) in _IDLE:
            idle += frame.time  # the wait and anything below it
            return
        if self_time > 0:
            by_function[f"{frame.function} ({_package(path)}:{frame.line_no})"] += self_time
            by_package[_package(path)] += self_time
        for child in frame.children:
            if not child.is_synthetic:
                walk(child)

    if root is not None:
        walk(root)
    busy = sum(by_package.values())
    share = lambda t: round(100 * t / busy, 1) if busy else 0.0  # noqa: E731
    return {
        "cpu_seconds_sampled": round(busy, 3),
        "cpu_seconds_in_epoll": round(idle, 3),
        "cpu_percent_by_package": {k: share(v) for k, v in by_package.most_common(14)},
        "cpu_percent_top_functions": {k: share(v) for k, v in by_function.most_common(20)},
    }


def _child_main(role: str, cfg: dict[str, Any]) -> None:
    anyio.run(_run_mock if role == "mock" else _run_proxy, cfg)


# ---------------------------------------------------------------------------------------------- load
async def _stream_call(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    started = time.perf_counter()
    async with session.post(url, data=body, headers=HEADERS) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")
        tail = b""
        async for chunk in response.content.iter_any():
            tail = chunk
        if not tail.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"{url}: stream ended without [DONE]")
    return time.perf_counter() - started


async def open_loop(
    rate: float, seconds: float, one: Callable[[int], Awaitable[float]]
) -> tuple[list[float], float, int]:
    """Start ``one(i)`` at ``rate`` per second for ``seconds``, whatever is still running; wait for all.

    Returns the latencies, the achieved start rate, and the calls that failed.
    """
    latencies: list[float] = []
    failures = 0

    async def run(i: int) -> None:
        nonlocal failures
        try:
            latencies.append(await one(i))
        except (aiohttp.ClientError, RuntimeError, TimeoutError):
            failures += 1

    count = max(1, round(rate * seconds))
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(count):
            due = started + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(run, i)
        achieved = count / (time.perf_counter() - started + 1 / rate)  # the last start's interval counts
    return latencies, achieved, failures


async def _load(
    runs: dict[str, Any], name: str, rate: float, seconds: float, one: Callable[[int], Awaitable[float]]
) -> None:
    runs[name] = await open_loop(rate, seconds, one)


async def sweep(
    kind: str,
    rates: tuple[int, ...],
    seconds: float,
    direct_url: str,
    proxied_urls: list[str],
    proxy: JsonChild,
    session: aiohttp.ClientSession,
    deadline: float,
) -> dict[str, Any]:
    stream = kind == "stream"
    body = orjson.dumps({**BODY, "stream": True} if stream else BODY)
    call = _stream_call if stream else _json_call
    per_call = COMPLETION_TOKENS if stream else 1  # events per stream, calls per call
    levels: list[dict[str, Any]] = []
    sustained: dict[str, Any] | None = None
    ended = "every level passed"
    for rate in rates:
        if time.monotonic() > deadline:
            ended = "time bound reached"
            break
        runs: dict[str, tuple[list[float], float, int]] = {}
        cpu0, t0 = proxy.cpu_seconds(), time.perf_counter()
        async with anyio.create_task_group() as tg:  # both at once: the same machine state for both
            tg.start_soon(_load, runs, "direct", rate, seconds, lambda i: call(session, direct_url, body))
            tg.start_soon(
                _load,
                runs,
                "proxied",
                rate,
                seconds,
                lambda i: call(session, proxied_urls[i % len(proxied_urls)], body),
            )
        cpu, wall = proxy.cpu_seconds() - cpu0, time.perf_counter() - t0
        (direct, _, direct_failed), (proxied, achieved, proxied_failed) = runs["direct"], runs["proxied"]
        added = {q: round((percentile(proxied, q) - percentile(direct, q)) * 1e3, 3) for q in (50, 99)}
        level = {
            "offered_per_s": rate * per_call,
            "achieved_per_s": round(achieved * per_call, 1),
            "direct_ms": summary_ms(direct),
            "proxied_ms": summary_ms(proxied),
            "added_ms": {"p50": added[50], "p99": added[99]},
            "failed": direct_failed + proxied_failed,
            "proxy_cpu_percent": round(100 * cpu / wall, 1),
            "proxy_cpu_us_per_" + ("event" if stream else "call"): round(
                cpu / max(1, len(proxied) * per_call) * 1e6, 1
            ),
        }
        levels.append(level)
        behind = achieved < 0.9 * rate
        if added[99] > LIMIT_MS or behind or level["failed"]:
            ended = (
                f"added p99 {added[99]} ms > {LIMIT_MS} ms"
                if added[99] > LIMIT_MS
                else "failed calls"
                if level["failed"]
                else "the load generator fell behind"
            )
            break
        sustained = level
    cpu_key = "proxy_cpu_us_per_" + ("event" if stream else "call")
    cheapest = min((level[cpu_key] for level in levels), default=None)
    return {
        "unit": "events/s (one token each)" if stream else "calls/s (256 tokens, ids and log-probs each)",
        "cpu_bound_per_s": round(1e6 / cheapest) if cheapest else None,
        "levels": levels,
        "ended_because": ended,
        "sustained_per_s": sustained["offered_per_s"] if sustained else None,
        "sustained_level": sustained,
    }


async def profile_at(
    kind: str,
    rate: float,
    seconds: float,
    proxied_urls: list[str],
    proxy: JsonChild,
    session: aiohttp.ClientSession,
) -> dict[str, Any]:
    stream = kind == "stream"
    body = orjson.dumps({**BODY, "stream": True} if stream else BODY)
    call = _stream_call if stream else _json_call
    await proxy.request({"profile": "start"})
    await open_loop(rate, seconds, lambda i: call(session, proxied_urls[i % len(proxied_urls)], body))
    return {
        "rate_per_s": rate * (COMPLETION_TOKENS if stream else 1),
        **await proxy.request({"profile": "stop"}),
    }


async def measure(quick: bool, max_seconds: float) -> dict[str, Any]:
    seconds = 2.0 if quick else 4.0
    deadline = time.monotonic() + max_seconds
    mock = await JsonChild.start(child_args(__file__, "mock", {"chunk_latency": CHUNK_LATENCY}))
    try:
        proxy = await JsonChild.start(child_args(__file__, "proxy", {"backend": mock.info["url"]}))
        try:
            direct_url = f"{mock.info['url']}/v1/chat/completions"
            proxied_urls = [f"{b}/chat/completions" for b in proxy.info["bases"]]
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                for url in itertools.islice(itertools.cycle([direct_url, *proxied_urls[:4]]), 50):  # warm-up
                    await _json_call(session, url, orjson.dumps(BODY))
                json_rates = JSON_RATES[::2] if quick else JSON_RATES
                stream_rates = STREAM_RATES[::2] if quick else STREAM_RATES
                mock_cpu0, proxy_cpu0 = mock.cpu_seconds(), proxy.cpu_seconds()
                results: dict[str, Any] = {}
                # Each sweep gets half of what is left of the time bound, less the profile run.
                half = time.monotonic() + (deadline - time.monotonic()) / 2 - seconds
                results["json"] = await sweep(
                    "json", json_rates, seconds, direct_url, proxied_urls, proxy, session, half
                )
                results["stream"] = await sweep(
                    "stream",
                    stream_rates,
                    seconds,
                    direct_url,
                    proxied_urls,
                    proxy,
                    session,
                    deadline - seconds,
                )
                profiles = {}
                for kind, rates in (("json", json_rates), ("stream", stream_rates)):
                    sustained = results[kind]["sustained_level"]
                    rate = (
                        sustained["offered_per_s"] / (COMPLETION_TOKENS if kind == "stream" else 1)
                        if sustained
                        else rates[0]
                    )
                    profiles[kind] = await profile_at(kind, rate, seconds, proxied_urls, proxy, session)
                results["proxy_cpu_profile_at_sustained_load"] = profiles
                results["cpu_seconds_whole_run"] = {
                    "mock": round(mock.cpu_seconds() - mock_cpu0, 2),
                    "proxy": round(proxy.cpu_seconds() - proxy_cpu0, 2),
                }
        finally:
            await proxy.stop()
    finally:
        await mock.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter levels, every other rate (a smoke run)")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="bound on the sweeps' time")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child_main(args.child[0], orjson.loads(args.child[1]))
        return
    started = time.monotonic()
    machine_before = machine_info()
    results = anyio.run(measure, args.quick, args.max_seconds)
    out = {
        "benchmark": "one LLMProxy process: sustained load at added latency p99 <= 5 ms (loopback, MockVLLM)",
        "limit_added_p99_ms": LIMIT_MS,
        "completion_tokens": COMPLETION_TOKENS,
        "stream_chunk_latency_s": CHUNK_LATENCY,
        "proxy": {"request_logprobs": True, "route": "attributed (recorded)", "event_loop": "asyncio"},
        "machine": {
            **machine_before,
            "loadavg_after": list(os.getloadavg()),
            "shared": "the CPUs also run the mock, this load generator and other jobs (a shared VM)",
        },
        **results,
        "run_seconds": round(time.monotonic() - started, 1),
    }
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")


if __name__ == "__main__":
    main()
