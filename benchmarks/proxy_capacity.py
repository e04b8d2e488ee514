"""How far one LLM proxy process carries: the load at which its added latency p99 passes 5 ms.

Run: ``python benchmarks/proxy_capacity.py [--quick] [--max-seconds S] [--shards 1,2] [--loop uvloop]
[--against DIR] [--compare-only]``. Prints ONE JSON object on stdout.

Processes on loopback, so each CPU figure belongs to one program:

- the backend: a :class:`~aglverl.testing.MockVLLM` (vLLM-shaped answers: 256 completion tokens with their ids
  and, when asked, log-probs; streams one token per SSE event, ``chunk_latency`` apart, like an engine
  generating at ``1 / chunk_latency`` tokens/s per sequence). It does no model work, so the proxy's machine
  pays only for its bytes;
- ``N`` :class:`~aglverl.proxy.LLMProxy` processes (``--shards``: each its own process and event loop, with
  ``request_logprobs`` (every call recorded with its ids and log-probs, as a trainer's are), its own store
  holding its claimed rollouts, and a pyinstrument profiler it starts and stops on command); the agents are
  split over them, a rollout always on the same one (as a rollout is pinned to a shard);
- this process: an open-loop load generator (aiohttp).

Two sweeps per shard count, each raising the offered load level by level until the proxies' added latency p99
passes ``LIMIT_MS`` (or they fall behind: under 90 % of the offered rate achieved), each level run twice at
once, straight to the mock and through the proxies, the same load, so that added latency is
``p99(through the proxies) - p99(direct)``:

- ``json``: chat completions arriving at a fixed rate (calls/s), answered with one JSON body of 256 tokens,
  their ids and log-probs. Latency: request to the last byte.
- ``stream``: streamed chat completions, one token per SSE event, arriving at a fixed rate (streams/s); the
  load is the events relayed per second. Latency: request to the last byte (``[DONE]``), whose added part is
  the proxy's delay on the stream's last event (each event is relayed as it comes; delays do not add up).

The sustained figure of a sweep is its last level under the limit; ``cpu_bound_per_s`` is what one core would
carry at the proxies' measured CPU cost per call (or event: all shards' CPU over all their work), with no
latency bound: the ceiling a less busy machine approaches. At the one-shard sustained level the proxy is then
run once more with its profiler on: where its CPU goes (self time per function and per package, idle time
apart).

``--against DIR`` adds ``versus``: this tree's proxy against the one in ``DIR`` (``git archive <rev> aglverl |
tar -x -C DIR``), one process each, driven at the same time with the same load (``COMPARE_RATES``, or
``--compare-rates``), in blocks; per block each one's CPU per call and per event, then the median over blocks.
Both see the same machine state, so the ratio holds even on a shared machine. Beside them, at the same time, the
floor: a bare aiohttp hop (``benchmarks/proxy.py``'s, asking the backend for the same ids and log-probs, parsing
and recording nothing), what any aiohttp relay costs on this machine. The processes run on uvloop where it is
installed (``--loop asyncio`` or ``AGLVERL_LOOP=asyncio``: asyncio's); with uvloop, ``versus`` drives the three
on asyncio and the three on uvloop, in turn within each block, and reports each loop's group. ``--compare-only`` runs
``versus`` alone. CPU is read to the nanosecond (``/proc/<pid>/task/*/schedstat``).

Every figure is of the machine it ran on: the CPUs are shared with the load generator, the mock, and other
jobs (``machine.loadavg_1_5_15`` says how busy it was); the proxy's own CPU per unit is the figure that
carries to another machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
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
    loop_name,
    machine_info,
    percentile,
    run_loop,
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
#: ``--against``: the load each version gets at once (calls/s, streams/s), and how many blocks of it.
COMPARE_RATES = (100, 16)
COMPARE_BLOCKS = 5
BODY = {
    "model": "mock",
    "messages": [{"role": "user", "content": "Tell me a long story, please."}],
    "max_tokens": COMPLETION_TOKENS,
}
HEADERS = {"Content-Type": "application/json"}
#: Why calls failed, over the run (what a sweep or a comparison that stops on failures names).
FAILURES: Counter[str] = Counter()


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

    import aglverl.proxy

    rollouts = cfg.get("rollouts") or ROLLOUTS
    async with serving_proxy(cfg["backend"], rollouts, request_logprobs=True) as (url, bases):
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        emit({"url": url, "bases": bases, "pid": os.getpid(), "module": aglverl.proxy.__file__, "loop": loop})
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


async def _run_floor(cfg: dict[str, Any]) -> None:
    from proxy import bare_hop  # benchmarks/proxy.py: a bare aiohttp hop, nothing recorded

    async with bare_hop(cfg["backend"], recorded_work=True) as url:
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        emit(
            {
                "url": url,
                "bases": [f"{url}/v1"],
                "pid": os.getpid(),
                "module": "bare aiohttp hop",
                "loop": loop,
            }
        )
        async for cmd in stdin_commands():
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
    """CPU self time per function and per package (the loop's epoll waits counted apart), and the time spent
    in (and under) each of aglverl's functions."""
    session = profiler.last_session
    root = session.root_frame()
    by_function: Counter[str] = Counter()
    by_package: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    idle = 0.0

    def walk(frame: Any, above: frozenset[str]) -> None:
        nonlocal idle
        self_time = frame.total_self_time
        path = frame.file_path or ""
        if (frame.function, Path(path).name) in _IDLE:
            idle += frame.time  # the wait and anything below it
            return
        name = f"{frame.function} ({_package(path)})"
        if self_time > 0:
            by_function[f"{frame.function} ({_package(path)}:{frame.line_no})"] += self_time
            by_package[_package(path)] += self_time
        if "/aglverl/" in path and name not in above:  # a recursive or re-entered frame counts once
            inclusive[name] += frame.time
            above = above | {name}
        for child in frame.children:
            if not child.is_synthetic:
                walk(child, above)

    if root is not None:
        walk(root, frozenset())
    busy = sum(by_package.values())
    share = lambda t: round(100 * t / busy, 1) if busy else 0.0  # noqa: E731
    return {
        "cpu_seconds_sampled": round(busy, 3),
        "cpu_seconds_in_epoll": round(idle, 3),
        "cpu_percent_by_package": {k: share(v) for k, v in by_package.most_common(14)},
        "cpu_percent_top_functions": {k: share(v) for k, v in by_function.most_common(20)},
        "cpu_percent_in_and_under_aglverl_functions": {k: share(v) for k, v in inclusive.most_common(20)},
    }


def _child_main(role: str, cfg: dict[str, Any]) -> None:
    if role == "mock":
        run_loop(_run_mock, cfg)
        return
    if cfg.get("path"):  # another version's aglverl, found before this tree's
        sys.path.insert(0, cfg["path"])
    run_loop(_run_floor if role == "floor" else _run_proxy, cfg, loop=cfg.get("loop"))


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
        except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
            failures += 1
            FAILURES[repr(exc)[:160]] += 1

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


def _cpu_of(child: JsonChild) -> float:
    """CPU seconds of a process, all its threads, to the nanosecond (``/proc/<pid>/task/*/schedstat``; the
    10 ms ticks of ``/proc/<pid>/stat`` would be a few percent of a short block's work)."""
    total = 0
    for task in os.listdir(f"/proc/{child.pid}/task"):
        try:
            with open(f"/proc/{child.pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def _cpu(proxies: list[JsonChild]) -> float:
    return sum(_cpu_of(p) for p in proxies)


def _bodies(kind: str) -> tuple[bytes, Callable[[aiohttp.ClientSession, str, bytes], Awaitable[float]], int]:
    """The request body of a sweep's calls, how one is made, and the units of work it is (calls or events)."""
    stream = kind == "stream"
    body = orjson.dumps({**BODY, "stream": True} if stream else BODY)
    return body, (_stream_call if stream else _json_call), (COMPLETION_TOKENS if stream else 1)


async def sweep(
    kind: str,
    rates: tuple[int, ...],
    seconds: float,
    direct_url: str,
    proxied_urls: list[str],
    proxies: list[JsonChild],
    session: aiohttp.ClientSession,
    deadline: float,
) -> dict[str, Any]:
    stream = kind == "stream"
    body, call, per_call = _bodies(kind)  # per_call: events per stream, calls per call
    levels: list[dict[str, Any]] = []
    sustained: dict[str, Any] | None = None
    ended = "every level passed"
    for rate in rates:
        if time.monotonic() > deadline:
            ended = "time bound reached"
            break
        runs: dict[str, tuple[list[float], float, int]] = {}
        cpu0, t0 = _cpu(proxies), time.perf_counter()
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
        cpu, wall = _cpu(proxies) - cpu0, time.perf_counter() - t0
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
    body, call, per_call = _bodies(kind)
    await proxy.request({"profile": "start"})
    await open_loop(rate, seconds, lambda i: call(session, proxied_urls[i % len(proxied_urls)], body))
    return {"rate_per_s": rate * per_call, **await proxy.request({"profile": "stop"})}


async def versus(
    groups: dict[str, dict[str, JsonChild]],
    rates: tuple[float, float],
    seconds: float,
    blocks: int,
    session: aiohttp.ClientSession,
) -> dict[str, Any]:
    """Each version's CPU per call and per event under the same load at the same time, block by block: the
    versions of one group (one event loop) driven together, the groups in turn within each block."""
    out: dict[str, Any] = {group: {} for group in groups}
    for kind, rate in zip(("json", "stream"), rates, strict=True):
        body, call, per_call = _bodies(kind)
        per_block = {g: {name: [] for name in versions} for g, versions in groups.items()}
        added = {g: {name: [] for name in versions} for g, versions in groups.items()}
        for _ in range(blocks):
            for group, versions in groups.items():
                runs: dict[str, tuple[list[float], float, int]] = {}
                cpu0 = {name: _cpu_of(child) for name, child in versions.items()}
                async with anyio.create_task_group() as tg:
                    for name, child in versions.items():
                        urls = [f"{b}/chat/completions" for b in child.info["bases"]]
                        tg.start_soon(
                            _load,
                            runs,
                            name,
                            rate,
                            seconds,
                            lambda i, urls=urls, call=call, body=body: call(
                                session, urls[i % len(urls)], body
                            ),
                        )
                for name, child in versions.items():
                    latencies, _, failed = runs[name]
                    if failed:
                        raise RuntimeError(
                            f"{group} {name}: {failed} calls failed at {rate}/s: {FAILURES.most_common(3)}"
                        )
                    units = max(1, len(latencies) * per_call)
                    per_block[group][name].append((_cpu_of(child) - cpu0[name]) / units * 1e6)
                    added[group][name].append(percentile(latencies, 50) * 1e3)
        unit = "us_per_event" if kind == "stream" else "us_per_call"
        for group in groups:
            out[group][kind] = {
                "offered_per_s": rate * per_call,
                f"proxy_cpu_{unit}": {
                    name: {
                        "median": round(statistics.median(v), 1),
                        "min": round(min(v), 1),
                        "max": round(max(v), 1),
                    }
                    for name, v in per_block[group].items()
                },
                "latency_p50_ms_median": {
                    name: round(statistics.median(v), 3) for name, v in added[group].items()
                },
            }
    return out


async def _start_proxies(
    backend: str, count: int, path: str | None = None, loop: str = "asyncio"
) -> list[JsonChild]:
    cfg = {"backend": backend, "rollouts": ROLLOUTS // count, "path": path, "loop": loop}
    return [await JsonChild.start(child_args(__file__, "proxy", cfg)) for _ in range(count)]


async def _stop(children: list[JsonChild]) -> None:
    for child in reversed(children):
        await child.stop()


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    seconds = 2.0 if args.quick else 4.0
    deadline = time.monotonic() + args.max_seconds
    mock = await JsonChild.start(child_args(__file__, "mock", {"chunk_latency": CHUNK_LATENCY}))
    children: list[JsonChild] = []
    results: dict[str, Any] = {}
    try:
        direct_url = f"{mock.info['url']}/v1/chat/completions"
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            if args.against:
                # Per event loop, driven together: the old tree, this one, and the floor, what any aiohttp hop
                # costs here moving the same bytes (nothing parsed or recorded).
                loops = ["asyncio", "uvloop"] if args.loop == "uvloop" else ["asyncio"]
                groups: dict[str, dict[str, JsonChild]] = {}
                for loop in loops:
                    group = groups[loop] = {}
                    for name, path in (("old", args.against), ("new", None)):
                        [child] = await _start_proxies(mock.info["url"], 1, path, loop)
                        children.append(child)
                        group[name] = child
                    floor_cfg = {"backend": mock.info["url"], "loop": loop}
                    group["floor_bare_aiohttp_hop"] = await JsonChild.start(
                        child_args(__file__, "floor", floor_cfg)
                    )
                    children.append(group["floor_bare_aiohttp_hop"])
                for child in children:  # warm-up
                    for base in child.info["bases"][:8]:
                        await _json_call(session, f"{base}/chat/completions", orjson.dumps(BODY))
                rates = tuple(args.compare_rates)
                results["versus"] = {
                    "what": "CPU per unit of each proxy version, driven at the same time with the same load, per "
                    "event loop (the loops' groups in turn within each block); per block of seconds, then "
                    "median/min/max over blocks",
                    "versions": {
                        loop: {name: c.info["module"] for name, c in group.items()}
                        for loop, group in groups.items()
                    },
                    "block_seconds": seconds,
                    "blocks": COMPARE_BLOCKS,
                    **await versus(groups, (rates[0], rates[1]), seconds, COMPARE_BLOCKS, session),
                }
                await _stop(children)
                children.clear()
            if args.compare_only:
                return results
            json_rates = JSON_RATES[::2] if args.quick else JSON_RATES
            stream_rates = STREAM_RATES[::2] if args.quick else STREAM_RATES
            by_shards: dict[str, Any] = {}
            counts = args.shards
            for n, count in enumerate(counts):
                proxies = await _start_proxies(mock.info["url"], count, loop=args.loop)
                children.extend(proxies)
                # The shards' rollouts interleaved: consecutive agents go to different shards.
                per_shard = [[f"{b}/chat/completions" for b in p.info["bases"]] for p in proxies]
                proxied_urls = [u for group in itertools.zip_longest(*per_shard) for u in group if u]
                for url in itertools.islice(itertools.cycle([direct_url, *proxied_urls[:8]]), 50):  # warm-up
                    await _json_call(session, url, orjson.dumps(BODY))
                proxy_cpu0 = _cpu(proxies)
                result: dict[str, Any] = {}
                # Each shard count gets its share of what is left of the time bound, half per sweep.
                share = (deadline - time.monotonic()) / (len(counts) - n)
                half = time.monotonic() + share / 2 - seconds
                result["json"] = await sweep(
                    "json", json_rates, seconds, direct_url, proxied_urls, proxies, session, half
                )
                result["stream"] = await sweep(
                    "stream",
                    stream_rates,
                    seconds,
                    direct_url,
                    proxied_urls,
                    proxies,
                    session,
                    time.monotonic() + share / 2 - 2 * seconds,
                )
                if count == 1:
                    profiles = {}
                    for kind, rates_ in (("json", json_rates), ("stream", stream_rates)):
                        sustained = result[kind]["sustained_level"]
                        rate = (
                            sustained["offered_per_s"] / (COMPLETION_TOKENS if kind == "stream" else 1)
                            if sustained
                            else rates_[0]
                        )
                        profiles[kind] = await profile_at(
                            kind, rate, seconds, proxied_urls, proxies[0], session
                        )
                    result["proxy_cpu_profile_at_sustained_load"] = profiles
                result["proxy_cpu_seconds_whole_sweeps"] = round(_cpu(proxies) - proxy_cpu0, 2)
                by_shards[str(count)] = result
                await _stop(proxies)
                children.clear()
            results["shards"] = by_shards
    finally:
        await _stop(children)
        await mock.stop()
    return results


def _counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--shards takes counts >= 1 separated by commas, got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter levels, every other rate (a smoke run)")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="bound on the sweeps' time")
    parser.add_argument(
        "--shards", type=_counts, default=[1], help="proxy processes to split the agents over, e.g. 1,2"
    )
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default=loop_name(),
        help="this tree's loop (default: uvloop where installed; with --against, uvloop means both loops)",
    )
    parser.add_argument("--against", metavar="DIR", help="compare with the aglverl package found in DIR")
    parser.add_argument(
        "--compare-rates",
        type=float,
        nargs=2,
        default=COMPARE_RATES,
        metavar=("CALLS", "STREAMS"),
        help="--against: JSON calls/s and streams/s (x 256 events) each version gets",
    )
    parser.add_argument("--compare-only", action="store_true", help="with --against: run only the comparison")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child_main(args.child[0], orjson.loads(args.child[1]))
        return
    if args.compare_only and not args.against:
        parser.error("--compare-only needs --against DIR")
    if args.against:
        args.against = os.path.abspath(args.against)
        if not os.path.isdir(os.path.join(args.against, "aglverl", "proxy")):
            parser.error(
                f"--against {args.against}: no aglverl/proxy there (git archive <rev> aglverl | tar -x)"
            )
    started = time.monotonic()
    machine_before = machine_info()
    results = run_loop(measure, args)
    out = {
        "benchmark": "LLMProxy processes: sustained load at added latency p99 <= 5 ms (loopback, MockVLLM)",
        "limit_added_p99_ms": LIMIT_MS,
        "completion_tokens": COMPLETION_TOKENS,
        "stream_chunk_latency_s": CHUNK_LATENCY,
        "proxy": {"request_logprobs": True, "route": "attributed (recorded)", "event_loop": args.loop},
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
