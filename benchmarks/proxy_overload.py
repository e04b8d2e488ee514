"""One LLM proxy process driven past its capacity, with its overload protection on and off, in the same run.

Run: ``python benchmarks/proxy_overload.py [--factors 2,4] [--rate cpu|R] [--seconds 8] [--blocks 4]
[--policy F=V,...] [--against DIR] [--quick]``. Prints ONE JSON object on stdout.

Processes on loopback, so each figure belongs to one program:

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
- this process: the load, on a lean HTTP/1.1 client (keep-alive connections, requests encoded by hand: a
  fraction of aiohttp's cost per call), two ways:

  - ``open`` loop: calls start at the offered rate whatever is still running, as independent agents send them,
    each the first call of a new rollout attempt (the calls the protection may turn away); a call that gets a
    429 is not retried (the offered load stays what it is);
  - ``closed`` loop: a population of multi-turn agents (``TURNS`` calls per conversation on one rollout attempt,
    its history re-sent as text, ``THINK`` seconds between calls), sized to offer the same rate if answered at
    once; an agent waits out a 429's ``retry-after-ms`` and tries again, as the SDKs do. A 429 to a later turn
    (``later_turns_shed``) would be a conversation refused mid-way: the protection never does that.

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
import dataclasses
import itertools
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

import aiohttp
import anyio
import orjson
from _common import (
    JsonChild,
    child_args,
    emit,
    machine_info,
    run_loop,
    status_kib,
    stdin_commands,
    summary_ms,
)
from proxy_capacity import BODY
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


# ---------------------------------------------------------------------------------------------- the proxy child
class Records:
    """The proxy's store view for this benchmark: every attempt is admitted, every call's records are taken and
    dropped (counted): the proxy does all its work per call, and its memory is what its calls in flight hold,
    not what a store keeps of finished ones."""

    vocab_size = None

    def __init__(self) -> None:
        self.recorded = 0

    def check_attempt(self, rollout_id: str, attempt_id: str) -> None:
        pass

    def record_calls(self, rollout_id: str, attempt_id: str, calls: Any) -> bool:
        self.recorded += len(calls)
        return True


async def _run_proxy(cfg: dict[str, Any]) -> None:
    from aglverl.proxy import LLMProxy, OverloadPolicy

    records = Records()
    # token-in off: the static backend renders nothing (a later turn would cost a render that fails)
    proxy = LLMProxy(records, backends=[cfg["backend"]], request_logprobs=True, token_in=False)
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        policy = proxy.overload.policy = OverloadPolicy(refuse=cfg["refuse"], **cfg["policy"])
        module = sys.modules[LLMProxy.__module__].__file__
        emit({"url": proxy.url, "pid": os.getpid(), "policy": repr(policy), "module": module})
        marks: dict[str, Any] = {}
        async for cmd in stdin_commands():
            if cmd.get("block") == "start":
                marks = _marks(proxy)
                emit({"started": True})
            elif cmd.get("block") == "end":
                emit({**_block_figures(proxy, marks), "records_dropped_so_far": records.recorded})
            elif "probe_cost" in cmd:
                emit(await _probe_cost(proxy, cmd["probe_cost"]))
            elif (
                "refuse_all" in cmd
            ):  # every new call turned away (the refusal's own cost), or back to the policy
                refusing = dataclasses.replace(policy, max_lag=1e-6, min_in_flight=0, refuse=True)
                proxy.overload.policy = refusing if cmd["refuse_all"] else policy
                emit({"refusing_all": cmd["refuse_all"]})
            else:
                emit({"error": f"unknown command {cmd!r}"})
        tg.cancel_scope.cancel()


def _marks(proxy: Any) -> dict[str, Any]:
    return {"lag": proxy.overload.statistics(), "thread_cpu": time.thread_time(), "wall": time.monotonic()}


def _block_figures(proxy: Any, marks: dict[str, Any]) -> dict[str, Any]:
    """The proxy's figures since ``marks``: the probes' mean lateness, the lag at the end, the time over
    ``max_lag``, the calls shed, its loop thread's CPU share."""
    now = _marks(proxy)
    lag, before = now["lag"], marks["lag"]
    probes = lag.probes - before.probes
    return {
        "lag_probes": probes,
        "lag_probe_mean_ms": round((lag.late_seconds - before.late_seconds) / max(1, probes) * 1e3, 2),
        "lag_at_end_ms": round(lag.lag * 1e3, 2),
        "overloaded_seconds": round(lag.overloaded_seconds - before.overloaded_seconds, 2),
        "shed": lag.shed - before.shed,
        "loop_thread_cpu_percent": round(
            100 * (now["thread_cpu"] - marks["thread_cpu"]) / max(1e-9, now["wall"] - marks["wall"]), 1
        ),
    }


async def _probe_cost(proxy: Any, seconds: float) -> dict[str, Any]:
    """What one lag probe costs the loop: its thread's CPU time idle with the probe stopped and with it every
    millisecond (so that the probes' cost stands out of the idle loop's own), in alternating periods of
    ``seconds`` / 4; the difference per probe, and that times the default rate."""
    from aglverl.proxy import OverloadPolicy

    overload = proxy.overload
    policy = overload.policy
    overload.policy = dataclasses.replace(policy, probe_interval=0.001)
    cpu = {True: 0.0, False: 0.0}
    probes = 0
    try:
        for probing in (False, True, False, True):
            if probing:
                overload.start()
            else:
                overload.stop()
            before, count = time.thread_time(), overload.statistics().probes
            await anyio.sleep(seconds / 4)
            cpu[probing] += time.thread_time() - before
            probes += overload.statistics().probes - count
    finally:
        overload.policy = policy
        overload.start()
    per_probe = (cpu[True] - cpu[False]) / max(1, probes)
    per_second = 1 / OverloadPolicy().probe_interval
    return {
        "idle_seconds_each": seconds / 2,
        "probes": probes,
        "loop_cpu_us_per_s_without_probe": round(cpu[False] / (seconds / 2) * 1e6, 1),
        "loop_cpu_us_per_s_probing_every_ms": round(cpu[True] / (seconds / 2) * 1e6, 1),
        "us_per_probe": round(per_probe * 1e6, 2),
        "core_percent_at_default_interval": round(100 * per_probe * per_second, 4),
    }


def _child_main(role: str, cfg: dict[str, Any]) -> None:
    if cfg.get("path"):  # another version's aglverl, found before this tree's
        sys.path.insert(0, cfg["path"])
    run_loop(_run_backend if role == "backend" else _run_proxy, cfg)


# ---------------------------------------------------------------------------------------------- the backend
class StaticBackend(asyncio.Protocol):
    """An HTTP/1.1 server that answers every POST with the same recorded chat completion (a 256-token answer
    with its ids and log-probs, as MockVLLM made it) and every GET with ``{}``: a backend that costs next to
    nothing, so that the proxy, not the backend, is what the load saturates."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # asyncio's, or uvloop's (not a subclass)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            length = 0
            if (at := head.find(b"content-length:")) >= 0:
                length = int(head[at + 15 :].split(b"\r\n", 1)[0])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            assert self.transport is not None
            self.transport.write(self.answer if head.startswith(b"post") else _response(200, b"{}"))


def _response(status: int, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def _run_backend(cfg: dict[str, Any]) -> None:
    from aglverl.testing import MockVLLM

    async with (
        MockVLLM(completion_tokens=256, record_requests=False) as mock,
        aiohttp.ClientSession() as http,
    ):
        asked = {**BODY, "model": mock.model, "return_token_ids": True, "logprobs": True}
        async with http.post(f"{mock.url}/v1/chat/completions", json=asked) as response:
            answer = await response.read()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: StaticBackend(_response(200, answer)), "127.0.0.1", 0, backlog=4096
    )
    port = server.sockets[0].getsockname()[1]
    emit({"url": f"http://127.0.0.1:{port}", "pid": os.getpid(), "answer_bytes": len(answer)})
    async for cmd in stdin_commands():
        emit({"error": f"unknown command {cmd!r}"})
    server.close()


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
    return {
        "capacity_per_s": round(1 / cpu_per_call),
        "proxy_cpu_us_per_call": round(cpu_per_call * 1e6, 1),
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
    ``closed`` (``level`` multi-turn agents)."""
    await proxy.request({"block": "start"})
    (cpu0, wait0), mine0 = _schedstat(proxy.pid), _schedstat(os.getpid())
    if load == "open":
        outcomes, achieved, wall = await open_loop(client, level, seconds)
    else:
        outcomes, wall = await closed_loop(client, int(level), seconds, THINK)
        achieved = (len(outcomes.ok) + len(outcomes.shed) + sum(outcomes.failed.values())) / wall
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


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    backend = await JsonChild.start(child_args(__file__, "backend", {}))
    children: dict[str, JsonChild] = {}
    clients: dict[str, Client] = {}
    try:
        versions = [("protected", True, None), ("unprotected", False, None)]
        if args.against:  # the tree's own protection, at the same loads
            versions.append(("protected_against", True, args.against))
        for name, refuse, path in versions:
            cfg = {"backend": backend.info["url"], "refuse": refuse, "policy": args.policy, "path": path}
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
        runs: dict[str, Any] = {}
        for factor in args.factors:
            rate = factor * capacity if args.rate == "cpu" else float(args.rate) * factor / 2
            agents = round(rate * THINK)  # a closed loop that would offer ``rate`` if answered at once
            blocks = []
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
        return {
            "backend_answer_bytes": backend.info["answer_bytes"],
            "policies": {name: c.info["policy"] for name, c in children.items()},
            "modules": {name: c.info["module"] for name, c in children.items()},
            "rss_mib_after_warm_up": idle,
            "probe_cost": probe_cost,
            "calibration": calibration,
            "refusal_cost": refusal,
            "closed_loop": {"turns": TURNS, "think_s_mean": THINK},
            "runs": runs,
        }
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
        "--quick", action="store_true", help="factor 2, one 2 s block per load and proxy (a smoke run)"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child_main(args.child[0], orjson.loads(args.child[1]))
        return
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
            "shared": "a shared 2-core VM: the CPUs also run the backend, this load generator and other jobs",
        },
        **results,
        "run_seconds": round(time.monotonic() - started, 1),
    }
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")


if __name__ == "__main__":
    main()
