"""One LLM proxy process driven past its capacity, with its overload protection on and off, in the same run.

Run: ``python benchmarks/proxy_overload.py [--factors 2,4] [--rate cpu|R] [--seconds 8] [--blocks 4]
[--policy F=V,...] [--against DIR] [--generator auto|python|wrk] [--cores P,L] [--quick]``. Prints ONE JSON
object on stdout.

Processes on loopback, so each figure belongs to one program, and the proxies on a core of their own
(``os.sched_setaffinity``: ``--cores P,L``, default ``0,1``): the proxy being driven alone on core P, the load
generator and the backend on core L, so that what the proxy carries is not what the load leaves it:

- the backend: a static HTTP server that answers every call with the same recorded chat completion (256 tokens
  with their ids and log-probs, as :class:`~aglverl.testing.MockVLLM` makes it, 23 kB): it costs next to
  nothing, so the load saturates the proxy, not the backend;
- two :class:`~aglverl.proxy.LLMProxy` processes in front of it, alike (``request_logprobs``, every call captured
  and recorded, into a store view that drops the records, so that a proxy's memory is what its calls in flight
  hold; token-in off: the static backend renders nothing) but for their
  :class:`~aglverl.proxy.OverloadPolicy`: ``protected`` has the default (new conversations' first calls get a
  429 with ``Retry-After`` while the loop's lag is over ``max_lag``), ``unprotected`` has ``refuse=False`` (it
  measures the lag and admits everything); with ``--against DIR``, a third, ``protected_against``, of the
  aglverl in ``DIR`` (``git archive REV | tar -x -C DIR``) with its own default protection;
- the load (every call with the proxies' token), from this process on a lean HTTP/1.1 client (keep-alive
  connections, requests encoded by hand: a fraction of aiohttp's cost per call) or from wrk (below), two ways:

  - ``open`` loop: calls start at the offered rate whatever is still running, as independent agents send them,
    each the first call of a new rollout attempt (the calls the protection may turn away); a call that gets a
    429 is not retried (the offered load stays what it is);
  - ``closed`` loop: a population of multi-turn agents (``TURNS`` calls per conversation on one rollout attempt,
    its history re-sent as text, ``THINK`` seconds between calls), sized to offer the same rate if answered at
    once; an agent waits out a 429's ``retry-after-ms`` and tries again, as the SDKs do. A 429 to a later turn
    (``later_turns_shed``) would be a conversation refused mid-way: the protection never does that.

``generator``: can this process offer the load from its one core? It measures the calls per second its client
makes against the backend per second of its own CPU (``python_calls_per_cpu_s``); when that is short of the
highest factor times the capacity (with a margin for the backend on the same core), ``--generator auto`` (the
default) drives the closed loop with wrk instead: ``wrk_agents.py``, a compiled generator, one wrk thread per
multi-turn agent (think time ``--think``, 20 ms, so that a few hundred agents offer 4x; ``make bench-tools``
installs it). Without wrk the run stops there, saying so (``skipped``). With wrk there is no open loop (wrk
keeps a call per connection in flight: a closed loop only).

``calibration`` measures, in the same run, the proxy's CPU time per call at ``CALIBRATION_RATE`` and the calls
per second that fill one core at that cost (``capacity_per_s``: where its one loop stops keeping up whatever the
machine); each ``--factors`` multiple of it is one load level (``--rate R``: R calls/s for factor 2 instead).
``refusal_cost`` measures what a refused call costs the protected proxy (all calls refused, at the socket). The
proxies are driven in turn, block by block, ``--seconds`` each, every block waiting for its last call to end, so
all see the same machine over the run. Per proxy and block:

- ``goodput_per_s``: calls answered 200 per second of the block's wall time (its last call's end included), and
  ``goodput_of_capacity`` that over the calibrated capacity; ``goodput_within_1s_per_s`` those answered within a
  second (a proxy hop should add milliseconds: a call that waited seconds in the proxy's queue is late);
- ``ok_ms``: latency of the calls answered 200 (p50 / p99 / max): what an admitted call costs an agent;
- ``shed`` (and ``later_turns_shed``): 429 answers and their latency, ``failed``: anything else (other statuses,
  no answer within ``CALL_TIMEOUT`` s, connection errors): the calls lost;
- ``proxy_figures``: its CPU share, the loop's lag as its probes saw it (their mean lateness, the smoothed lag at
  the block's end), seconds over ``max_lag``, and its memory: resident set after the block and its peak
  (``VmHWM``) so far, and the share of wall time it was runnable but waiting for a CPU (the machine's other work
  holding it back); ``load_generator_*``: the same for this process.

``probe_cost``: the lag probe's own cost: the proxy's loop thread CPU time idle with the probe stopped and with
it every millisecond, per probe. Every figure is of the machine it ran on: a shared 2-core VM whose other jobs
take CPU from these processes (``machine.loadavg_1_5_15``); what carries is the comparison between the proxies
of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

import anyio
import orjson
from _common import (
    JsonChild,
    child_args,
    machine_info,
    run_loop,
    status_kib,
    summary_ms,
)
from overload_processes import child_main
from proxy_capacity import BODY
from wrk_agents import INSTALL, wrk_path
from wrk_agents import run as run_wrk
from yarl import URL

#: Seconds an agent waits for a call before giving up on it.
CALL_TIMEOUT = 60.0
#: Connections the load generator keeps to a proxy at most (thousands of agents, under the file limits).
CONNECTIONS = 4096
#: The load one proxy process sustained at added latency p99 <= 5 ms on this machine when quiet (calls/s).
QUIET_CAPACITY = 400.0
#: The calibration's load (calls/s, for ``CALIBRATION_SECONDS``), well within what one proxy carries.
CALIBRATION_RATE = 300.0
CALIBRATION_SECONDS = 4.0
SECONDS = 8.0
BLOCKS = 4
#: Calls per conversation of the closed loop's agents, and their think time between calls (seconds, mean).
TURNS = 4
THINK = 0.25
#: Offered load as multiples of the calibrated capacity (``--factors``).
FACTORS = (2.0, 4.0)
PROBE_COST_SECONDS = 5.0
HEADERS = {"Content-Type": "application/json"}
BODY_BYTES = orjson.dumps(BODY)
#: The proxies' token: every call carries it, as an agent's does.
TOKEN = "overload-bench-token"
#: Mean think time of wrk's agents between calls (seconds): short, so that a few hundred agents offer 4x.
WRK_THINK = 0.02
#: How much more than the highest offered load the Python client must make per second of its CPU to be used
#: (the backend takes its share of the same core).
GENERATOR_MARGIN = 1.25
#: Seconds (and concurrent calls) of the Python client's own measure against the backend.
GENERATOR_SECONDS = 2.0
GENERATOR_CONCURRENCY = 256


# ---------------------------------------------------------------------------------------------- load
class Client:
    """A lean HTTP/1.1 client for one proxy: keep-alive connections (an idle one reused, else a new one, at most
    ``CONNECTIONS``: a call beyond waits for one, as an agent's connection pool makes it wait), one request on a
    connection at a time, pre-encoded requests, bodies read by ``Content-Length``. It costs the load generator
    a fraction of what aiohttp's client does, so that one process offers more than a proxy process can carry
    on the same machine."""

    def __init__(self, url: str) -> None:
        parsed = URL(url)
        self.host, self.port = parsed.host or "127.0.0.1", parsed.port or 80
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.slots = anyio.Semaphore(CONNECTIONS)

    def request(self, path: str, body: bytes) -> bytes:
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
        head += f"Authorization: Bearer {TOKEN}\r\n"
        return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str]]:
        """The status and headers of the answer (its body read and dropped)."""
        async with self.slots:
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> tuple[int, dict[str, str]]:
        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(self.request(path, body))
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            await reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, headers

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


class Outcomes:
    """What the calls of one block got: latencies of 200s and 429s (and the 429s of a conversation's later
    turns), and failures by kind."""

    def __init__(self) -> None:
        self.ok: list[float] = []
        self.shed: list[float] = []
        self.later_turns_shed = 0
        self.failed: Counter[str] = Counter()
        self.retry_after: Counter[str] = Counter()

    async def call(self, client: Client, path: str, body: bytes, turn: int = 0) -> tuple[int, dict[str, str]]:
        started = time.perf_counter()
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                status, headers = await client.post(path, body)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            self.failed[type(exc).__name__] += 1
            return 0, {}
        elapsed = time.perf_counter() - started
        if status == 200:
            self.ok.append(elapsed)
        elif status == 429:
            self.shed.append(elapsed)
            self.later_turns_shed += turn > 0
            self.retry_after[headers.get("retry-after", "none")] += 1
        else:
            self.failed[f"status {status}"] += 1
        return status, headers


_conversations = itertools.count()


def _new_path() -> str:
    """A new rollout attempt's chat route: every call of the open loop is a conversation's first (the calls the
    protection may turn away; a call of an attempt under way never is)."""
    n = next(_conversations)
    return f"/rollout/r{n}/attempt/a{n}/v1/chat/completions"


async def open_loop(client: Client, rate: float, seconds: float) -> tuple[Outcomes, float, float]:
    """Start a call at ``rate`` per second for ``seconds``, whatever is still running, each a new rollout
    attempt's first; wait for all. Returns the outcomes, the achieved start rate and the wall time to the last
    end."""
    outcomes = Outcomes()
    count = max(1, round(rate * seconds))
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(count):
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(outcomes.call, client, _new_path(), BODY_BYTES)
        achieved = count / (time.perf_counter() - started + 1 / rate)
    return outcomes, achieved, time.perf_counter() - started


def _turn_body(turn: int) -> bytes:
    """A conversation's call ``turn`` (0-based): its history re-sent as text, growing by a turn each call."""
    messages = list(BODY["messages"])
    for k in range(turn):
        messages += [
            {"role": "assistant", "content": "An answer " * 20},
            {"role": "user", "content": f"more {k}"},
        ]
    return orjson.dumps({**BODY, "messages": messages})


TURN_BODIES = [_turn_body(turn) for turn in range(TURNS)]


async def closed_loop(client: Client, agents: int, seconds: float, think: float) -> tuple[Outcomes, float]:
    """``agents`` multi-turn agents, each conversation ``TURNS`` calls on one rollout attempt, ``think`` seconds
    (U(0.5, 1.5) times) between calls; an agent starts new conversations for ``seconds`` and finishes the one it
    is in. A call answered 429 is tried again after the ``retry-after-ms`` it was given, as the SDKs do (the
    later turns must never get one). Returns the outcomes and the wall time to the last agent's end."""
    outcomes = Outcomes()
    stop = time.perf_counter() + seconds

    async def agent() -> None:
        await anyio.sleep(random.uniform(0, think))  # not all at once
        while time.perf_counter() < stop:
            path = _new_path()
            for turn in range(TURNS):
                while True:
                    status, headers = await outcomes.call(client, path, TURN_BODIES[turn], turn)
                    if status != 429:
                        break
                    await anyio.sleep(int(headers.get("retry-after-ms", "1000")) / 1e3)
                if status != 200:
                    break  # the conversation is lost
                await anyio.sleep(think * random.uniform(0.5, 1.5))

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(agents):
            tg.start_soon(agent)
    return outcomes, time.perf_counter() - started


async def calibrate(proxy: JsonChild, client: Client, seconds: float = CALIBRATION_SECONDS) -> dict[str, Any]:
    """The proxy's capacity: the calls per second that fill one core at its CPU cost per call, measured on the
    (unprotected) proxy at ``CALIBRATION_RATE`` (which it carries), with the loop's lag there. CPU time per
    call hardly depends on how busy the machine is, so the figure holds on a shared machine; the load that
    fills the core is where a single loop stops keeping up and its calls start queueing."""
    level = await block("unprotected", proxy, client, "open", CALIBRATION_RATE, seconds)
    figures = level["proxy_figures"]
    cpu_per_call = figures["cpu_percent"] / 100 / max(1e-9, level["goodput_per_s"])
    generator_per_call = (
        level["load_generator_cpu_percent"] / 100 / max(1e-9, level["achieved_start_rate_per_s"])
    )
    return {
        "capacity_per_s": round(1 / cpu_per_call),
        "proxy_cpu_us_per_call": round(cpu_per_call * 1e6, 1),
        "load_generator_cpu_us_per_call": round(generator_per_call * 1e6, 1),
        "at": {
            "rate": CALIBRATION_RATE,
            "ok_ms": level["ok_ms"],
            "failed": level["failed"],
            "lag_probe_mean_ms": figures["lag_probe_mean_ms"],
            "proxy_cpu_percent": figures["cpu_percent"],
            "proxy_runnable_waiting_percent": figures["runnable_waiting_percent"],
        },
    }


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds a process's threads ran on a CPU and waited, runnable, for one (``/proc/<pid>/task/*/schedstat``):
    the second is how much the machine's other work held it back."""
    ran = waited = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                fields = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran / 1e9, waited / 1e9


async def block(
    name: str, proxy: JsonChild, client: Client, load: str, level: float, seconds: float
) -> dict[str, Any]:
    """One block of load on one proxy: ``open`` (``level`` calls/s, each a new conversation's first) or
    ``closed`` (``level`` multi-turn agents), from this process."""
    await proxy.request({"block": "start"})
    marks = _schedstat(proxy.pid), _schedstat(os.getpid())
    if load == "open":
        outcomes, achieved, wall = await open_loop(client, level, seconds)
    else:
        outcomes, wall = await closed_loop(client, int(level), seconds, THINK)
        achieved = (len(outcomes.ok) + len(outcomes.shed) + sum(outcomes.failed.values())) / wall
    return await _block_figures_of(name, proxy, load, level, outcomes, achieved, wall, marks)


async def wrk_block(name: str, proxy: JsonChild, agents: int, seconds: float, think: float) -> dict[str, Any]:
    """One block of wrk's multi-turn agents (``closed``) on one proxy: ``agents`` of them."""
    await proxy.request({"block": "start"})
    marks = _schedstat(proxy.pid), _schedstat(os.getpid())
    prefix = f"{name}{next(_conversations)}"  # rollout ids never seen by this proxy
    run = await run_wrk(
        proxy.info["url"],
        agents=agents,
        seconds=seconds,
        think=think,
        bodies=TURN_BODIES,
        prefix=prefix,
        token=TOKEN,
    )
    outcomes = Outcomes()
    outcomes.ok, outcomes.shed, outcomes.later_turns_shed = run.ok, run.shed, run.later_turns_shed
    outcomes.failed = run.failed
    achieved = (len(run.ok) + len(run.shed) + sum(run.failed.values())) / run.duration
    figures = await _block_figures_of(name, proxy, "closed", agents, outcomes, achieved, run.duration, marks)
    figures["generator"] = {
        "tool": "wrk",
        "wrk_cpu_percent": round(100 * run.cpu_seconds / run.duration, 1),
        "agents": run.agents,
        "think_s_mean": think,
        "conversations": run.conversations,
        "conversations_finished": run.finished_conversations,
        "unanswered_when_the_run_stopped": run.unfinished,
    }
    return figures


async def _block_figures_of(
    name: str,
    proxy: JsonChild,
    load: str,
    level: float,
    outcomes: Outcomes,
    achieved: float,
    wall: float,
    marks: tuple[tuple[float, float], tuple[float, float]],
) -> dict[str, Any]:
    """A block's figures: what its calls got, the CPU of the proxy and of the load generator since ``marks``
    (their schedstats at the start), the proxy's own figures."""
    (cpu0, wait0), mine0 = marks
    (cpu, wait), mine = _schedstat(proxy.pid), _schedstat(os.getpid())
    cpu, wait = cpu - cpu0, wait - wait0
    figures = await proxy.request({"block": "end"})
    return {
        "proxy": name,
        "load": load,
        ("offered_per_s" if load == "open" else "agents"): level,
        "achieved_start_rate_per_s": round(achieved, 1),
        "wall_seconds": round(wall, 2),
        "ok": len(outcomes.ok),
        "goodput_per_s": round(len(outcomes.ok) / wall, 1),
        "goodput_within_1s_per_s": round(sum(t <= 1.0 for t in outcomes.ok) / wall, 1),
        "goodput_per_proxy_cpu_s": round(len(outcomes.ok) / max(cpu, 1e-9), 1),
        "ok_ms": summary_ms(outcomes.ok),
        "shed": len(outcomes.shed),
        "later_turns_shed": outcomes.later_turns_shed,
        "shed_ms": summary_ms(outcomes.shed),
        "retry_after_headers": dict(outcomes.retry_after),
        "failed": dict(outcomes.failed),
        "load_generator_cpu_percent": round(100 * (mine[0] - mine0[0]) / wall, 1),
        "load_generator_runnable_waiting_percent": round(100 * (mine[1] - mine0[1]) / wall, 1),
        "proxy_figures": {
            **figures,
            "cpu_percent": round(100 * cpu / wall, 1),
            "runnable_waiting_percent": round(100 * wait / wall, 1),
            "rss_mib_after": round(status_kib(proxy.pid, "VmRSS:") / 1024, 1),
            "peak_rss_mib_so_far": round(status_kib(proxy.pid, "VmHWM:") / 1024, 1),
        },
    }


async def python_generator(backend: str, seconds: float = GENERATOR_SECONDS) -> dict[str, Any]:
    """How many calls per second this process's client makes per second of its own CPU, against the backend
    (which costs next to nothing), ``GENERATOR_CONCURRENCY`` calls in flight: the most it can offer from one
    core."""
    client = Client(backend)
    count = 0
    stop = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal count
        while time.perf_counter() < stop:
            await client.post("/v1/chat/completions", BODY_BYTES)
            count += 1

    cpu = time.process_time()
    started = time.perf_counter()
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(GENERATOR_CONCURRENCY):
                tg.start_soon(caller)
    finally:
        client.close()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - started
    return {
        "python_calls_per_s": round(count / wall, 1),
        "python_cpu_percent": round(100 * cpu / wall, 1),
        "python_calls_per_cpu_s": round(count / max(cpu, 1e-9), 1),
    }


def _summary(blocks: list[dict[str, Any]], capacity: float) -> dict[str, Any]:
    """Per proxy: each block's goodput (and as a share of the calibrated capacity), p50 / p99 of its calls
    answered 200, 429s (of later turns apart), failures, the loop's mean lag, the proxy's share of wall time
    waiting for a CPU; the medians over blocks; the peak memory."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(b["proxy"] for b in blocks):
        mine = [b for b in blocks if b["proxy"] == name]
        series = {
            "goodput_per_s": [b["goodput_per_s"] for b in mine],
            "goodput_of_capacity": [round(b["goodput_per_s"] / capacity, 3) for b in mine],
            "goodput_within_1s_per_s": [b["goodput_within_1s_per_s"] for b in mine],
            # the share of the CPU the proxy got that went to answered calls (the machine's other work aside)
            "goodput_of_cpu_capacity": [round(b["goodput_per_proxy_cpu_s"] / capacity, 3) for b in mine],
            "ok_p50_ms": [b["ok_ms"].get("p50", math.nan) for b in mine],
            "ok_p99_ms": [b["ok_ms"].get("p99", math.nan) for b in mine],
            "shed": [b["shed"] for b in mine],
            "later_turns_shed": [b["later_turns_shed"] for b in mine],
            "failed": [sum(b["failed"].values()) for b in mine],
            "lag_probe_mean_ms": [b["proxy_figures"]["lag_probe_mean_ms"] for b in mine],
            "proxy_runnable_waiting_percent": [b["proxy_figures"]["runnable_waiting_percent"] for b in mine],
        }
        out[name] = {
            **series,
            "medians": {key: round(statistics.median(values), 3) for key, values in series.items()},
            "peak_rss_mib": max(b["proxy_figures"]["peak_rss_mib_so_far"] for b in mine),
        }
    return out


async def refusal_cost(proxy: JsonChild, client: Client, seconds: float) -> dict[str, Any]:
    """What turning a call away costs the proxy: its CPU per call while it refuses every new call (all of
    them at the socket: each call here is a new conversation's first), at ``CALIBRATION_RATE``."""
    await proxy.request({"refuse_all": True})
    try:
        level = await block("protected", proxy, client, "open", CALIBRATION_RATE, seconds)
    finally:
        await proxy.request({"refuse_all": False})
    cpu = level["proxy_figures"]["cpu_percent"] / 100 * level["wall_seconds"]
    return {
        "rate": CALIBRATION_RATE,
        "refused": level["shed"],
        "answered": level["ok"],
        "proxy_cpu_us_per_refusal": round(cpu / max(1, level["shed"]) * 1e6, 1),
        "shed_ms": level["shed_ms"],
    }


def _generator(
    args: argparse.Namespace, calibration: dict[str, Any], python: dict[str, Any]
) -> dict[str, Any]:
    """Which generator drives the load levels: this process's client when it can offer the highest factor's
    load from its core (``--generator auto``), else wrk; ``skipped`` says why when that is not installed. What
    it can offer is the lower of its client's calls per CPU second (against the backend, calls in flight) and
    its open loop's (the calibration's: a task and a timer per call)."""
    capacity = calibration["capacity_per_s"]
    highest = max(args.factors) * capacity if args.rate == "cpu" else float(args.rate) * max(args.factors) / 2
    open_loop = 1e6 / max(1e-9, calibration["load_generator_cpu_us_per_call"])
    python = {**python, "python_open_loop_calls_per_cpu_s": round(open_loop, 1)}
    enough = min(python["python_calls_per_cpu_s"], open_loop) >= GENERATOR_MARGIN * highest
    chosen = args.generator if args.generator != "auto" else ("python" if enough else "wrk")
    out = {
        **python,
        "highest_offered_per_s": round(highest, 1),
        "python_enough": enough,
        "chosen": chosen,
    }
    if chosen == "wrk":
        path = wrk_path()
        out["wrk"] = path
        if path is None:
            made = min(python["python_calls_per_cpu_s"], open_loop)
            why = (
                "--generator wrk"
                if args.generator == "wrk"
                else f"this process's client makes {made:.0f} calls per second of its CPU, short of the "
                f"{highest:.0f} calls/s to offer (x{GENERATOR_MARGIN:g}); wrk would"
            )
            out["skipped"] = f"{why}, and wrk is not installed: {INSTALL}"
    return out


async def _levels(
    args: argparse.Namespace,
    chosen: str,
    capacity: float,
    children: dict[str, JsonChild],
    clients: dict[str, Client],
) -> dict[str, Any]:
    """Each factor's blocks, the proxies in turn: open and closed loop from this process, or wrk's agents."""
    runs: dict[str, Any] = {}
    for factor in args.factors:
        rate = factor * capacity if args.rate == "cpu" else float(args.rate) * factor / 2
        blocks = []
        if chosen == "wrk":
            agents = round(rate * args.think)  # agents that offer ``rate`` if answered at once
            for _ in range(args.blocks):
                for name, child in children.items():
                    blocks.append(await wrk_block(name, child, agents, args.seconds, args.think))
            runs[f"{factor:g}x"] = {
                "offered_per_s": round(rate, 1),
                "wrk_agents": agents,
                "closed": _summary(blocks, capacity),
                "blocks": blocks,
            }
            continue
        agents = round(rate * THINK)  # a closed loop that would offer ``rate`` if answered at once
        for _ in range(args.blocks):
            for load, level in (("open", rate), ("closed", agents)):
                for name, child in children.items():
                    blocks.append(await block(name, child, clients[name], load, level, args.seconds))
        runs[f"{factor:g}x"] = {
            "offered_per_s": round(rate, 1),
            "closed_loop_agents": agents,
            "open": _summary([b for b in blocks if b["load"] == "open"], capacity),
            "closed": _summary([b for b in blocks if b["load"] == "closed"], capacity),
            "blocks": blocks,
        }
    return runs


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    proxy_core, load_core = args.cores if args.cores else (None, None)
    if load_core is not None:
        os.sched_setaffinity(0, {load_core})  # this process, and the backend it starts
    backend = await JsonChild.start(child_args(__file__, "backend", {}))
    children: dict[str, JsonChild] = {}
    clients: dict[str, Client] = {}
    try:
        versions = [("protected", True, None), ("unprotected", False, None)]
        if args.against:  # the tree's own protection, at the same loads
            versions.append(("protected_against", True, args.against))
        for name, refuse, path in versions:
            cfg = {
                "backend": backend.info["url"],
                "refuse": refuse,
                "policy": args.policy,
                "path": path,
                "core": proxy_core,
                "token": TOKEN,
            }
            children[name] = await JsonChild.start(child_args(__file__, "proxy", cfg))
            clients[name] = Client(children[name].info["url"])
        for name in children:  # warm-up: connections, the first calls' imports
            await open_loop(clients[name], 50, 1.0)
        idle = {name: round(status_kib(c.pid, "VmRSS:") / 1024, 1) for name, c in children.items()}
        probe_cost = await children["protected"].request({"probe_cost": args.probe_seconds})
        calibration = await calibrate(
            children["unprotected"], clients["unprotected"], args.calibration_seconds
        )
        capacity = calibration["capacity_per_s"]
        refusal = await refusal_cost(children["protected"], clients["protected"], args.calibration_seconds)
        generator = _generator(args, calibration, await python_generator(backend.info["url"]))
        out: dict[str, Any] = {
            "cores": {"proxy": proxy_core, "load_generator_and_backend": load_core},
            "backend_answer_bytes": backend.info["answer_bytes"],
            "policies": {name: c.info["policy"] for name, c in children.items()},
            "modules": {name: c.info["module"] for name, c in children.items()},
            "rss_mib_after_warm_up": idle,
            "probe_cost": probe_cost,
            "calibration": calibration,
            "refusal_cost": refusal,
            "generator": generator,
            "closed_loop": {
                "turns": TURNS,
                "think_s_mean": args.think if generator["chosen"] == "wrk" else THINK,
            },
        }
        if "skipped" in generator:
            print(f"proxy_overload: skipped: {generator['skipped']}", file=sys.stderr)
            return {"skipped": generator["skipped"], **out}
        out["runs"] = await _levels(args, generator["chosen"], capacity, children, clients)
        return out
    finally:
        for client in clients.values():
            client.close()
        for child in children.values():
            await child.stop()
        await backend.stop()


def _policy(text: str) -> dict[str, float]:
    fields = dict(item.split("=", 1) for item in text.split(",") if item)
    try:
        return {key: float(value) if key != "min_in_flight" else int(value) for key, value in fields.items()}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--policy takes FIELD=NUMBER,...: {exc}") from None


def _cores(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    try:
        proxy, load = (int(core) for core in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("--cores takes P,L (two core numbers) or 'none'") from None
    if proxy == load or not {proxy, load} <= os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(
            f"--cores {text}: two different cores of {sorted(os.sched_getaffinity(0))}"
        )
    return proxy, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rate",
        default="cpu",
        help="'cpu' (default): each factor times the calls/s that fill one core at the CPU cost per call the "
        f"calibration measures in this run; a number R: R calls/s for factor 2 (R x factor / 2 for the others; "
        f"{2 * QUIET_CAPACITY:g} is twice the {QUIET_CAPACITY:g} calls/s one proxy sustained on a quiet VM)",
    )
    parser.add_argument(
        "--factors",
        type=lambda text: [float(f) for f in text.split(",")],
        default=list(FACTORS),
        help="offered load as multiples of the capacity, e.g. 2,4 (the default)",
    )
    parser.add_argument("--seconds", type=float, default=SECONDS, help="seconds of load per block")
    parser.add_argument(
        "--policy",
        type=_policy,
        default={},
        metavar="FIELD=VALUE,...",
        help="OverloadPolicy fields other than the default (both proxies; e.g. max_lag=0.05,window=0.2)",
    )
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="blocks per proxy, in turn")
    parser.add_argument("--probe-seconds", type=float, default=PROBE_COST_SECONDS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="also drive a proxy of the aglverl in DIR (git archive REV | tar -x), protected",
    )
    parser.add_argument(
        "--calibration-seconds", type=float, default=CALIBRATION_SECONDS, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--generator",
        choices=("auto", "python", "wrk"),
        default="auto",
        help="what offers the load levels: this process's client, wrk (make bench-tools), or (auto) this "
        "process's when it can offer the highest level from its core, else wrk",
    )
    parser.add_argument(
        "--cores",
        default="0,1",
        metavar="P,L",
        help="pin the proxies to core P, the load generator and the backend to core L (default 0,1; 'none': no "
        "pinning)",
    )
    parser.add_argument(
        "--think", type=float, default=WRK_THINK, help="wrk agents' mean think time between calls (seconds)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="factor 2, one 2 s block per load and proxy (a smoke run)"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child[0], orjson.loads(args.child[1]))
        return
    try:
        args.cores = _cores(args.cores)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.against:
        args.against = os.path.abspath(args.against)
    if args.quick:
        args.seconds, args.blocks, args.probe_seconds, args.factors = 1.0, 1, 0.4, [2.0]
        args.calibration_seconds = 1.5
    started = time.monotonic()
    machine_before = machine_info()
    results = run_loop(measure, args)
    out = {
        "benchmark": "one LLMProxy process past its capacity: overload protection on and off, open and closed loop "
        "(loopback, static backend)",
        "call": "chat completion, 256 tokens with ids and log-probs, recorded; open loop: every call a new "
        "conversation's first, no retry after a 429; closed loop: multi-turn agents that wait out a 429",
        "call_timeout_s": CALL_TIMEOUT,
        "machine": {
            **machine_before,
            "loadavg_after": list(os.getloadavg()),
            "shared": "a shared 2-core VM: other jobs run on the same cores (see cores: what runs where)",
        },
        **results,
        "run_seconds": round(time.monotonic() - started, 1),
    }
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")


if __name__ == "__main__":
    main()
