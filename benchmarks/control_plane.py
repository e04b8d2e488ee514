"""Control-plane efficiency: N tasks, M agents, 1-3 LLM calls each, through the real daemon, against the ideal.

Run (prints one JSON object per run on stdout; results and RESULTS.md's "Control plane" section explain them)::

    python benchmarks/control_plane.py [--tasks 256 --agents 32 --latency-ms 50] [--baseline] [--stream]
    python benchmarks/control_plane.py --sweep [--write-results]   # N x M x stream grid, table, plots
    python benchmarks/control_plane.py --profile [--profiler pyinstrument]   # sample the daemon process

Processes (each CPU / memory figure belongs to one program):

- ``mock``: a :class:`~aglverl.testing.MockVLLM` that sleeps ``latency`` before each answer (8 tokens);
- ``daemon``: an :class:`~aglverl.AgentDaemon` (task server, LLM proxy, store, collector) plus the trainer side:
  ``step = await daemon.submit(samples)`` then ``await daemon.batches.receive()``. Wall time is measured here,
  from just before ``submit`` to the batch in hand; so are its CPU (``/proc/self/stat`` utime + stime, all
  threads) and its peak RSS (``VmHWM``). It then checks every row of the batch against the mock: the response
  ids must be exactly what the mock generates for that row's prompt ids;
- ``agents``: M aiohttp agents in one process (``--agent-procs`` to split them): long-poll ``GET /task``,
  resolve the task's ``main_llm`` (a ``ProxyLLM`` -> the rollout attempt's URL), make k chat calls (JSON or
  SSE), post the reward. k in {1, 2, 3} is a fixed function of the task's index (a hash), so the work, and the
  ideal, are known exactly before the run and identical for every system measured;
- ``baseline`` (with ``--baseline``): a bare aiohttp task server written here (a queue, long-poll, a counter
  and an event; no store, no proxy) whose agents call the mock directly. Same agents, same tasks, same k;
- this process: starts the others and drives them with JSON lines over stdin/stdout (never a sleep to wait
  for a child), probes ``GET /healthz`` every ``--healthz-interval`` seconds during measured steps, and reads
  every process's CPU plus the machine-wide busy time, so CPU taken by unrelated programs during a step is
  reported too (``other_programs_on_machine``).

The machine these targets were set for has 2 cores and is shared. Before each measured step this process
waits (up to ``--quiet-max-wait`` s) for a 0.5 s window in which other programs used under ``--quiet-cores``
CPUs; that and the /healthz pacing are its only sleeps. Diagnosis options: ``--calls-per-task 0..3`` (fixed k;
0 = task server alone), ``--server-uvloop``, ``--idle-before-step`` (a trainer update between steps: the
proxy's idle upstream connections expire), ``--loop-lag`` (how late the daemon's loop wakes, and why).

Ideal wall time = sum over tasks of k * latency / M (perfect packing, zero overhead). It cannot be reached even
with zero overhead: agents take tasks in queue order and the last ones leave a tail, so the JSON also gives the
makespan of that greedy schedule with zero overhead (``simulated_zero_overhead_wall_s``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import heapq
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.abc
import orjson
from _common import loop_name, run_loop
from anyio.streams.buffered import BufferedByteReceiveStream

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _common import (
    JsonChild,
    LogCounter,
    child_args,
    emit,
    machine_info,
    peak_rss_bytes,
    proc_cpu_seconds,
    read_sse_text,
    stdin_commands,
    summary_ms,
    system_busy_seconds,
)

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"
MODEL = "mock"
COMPLETION_TOKENS = 8
#: Batch widths: the longest prompt here (3rd turn of the longest task text) is ~220 ids, so nothing is cut.
PROMPT_WIDTH, RESPONSE_WIDTH = 256, 16
#: Agents' long-poll length; the server answers the moment a task is queued.
LONG_POLL_SECONDS = 30.0
JSON_HEADERS = {"Content-Type": "application/json"}
#: py-spy samples per second (each pauses the daemon for a few tens of microseconds).
PY_SPY_RATE = 100
#: Length of one sample of the machine's load when waiting for other programs to quiet down.
QUIET_WINDOW = 0.5

#: Targets from the issue, and the reference figures measured elsewhere for the default work (256 x 32 x 50 ms).
TARGETS = {
    "efficiency_min": 0.75,
    "token_ids_ratio": 1.0,
    "healthz_p99_ms_max_at_512_agents": 10.0,
    "cpu_per_rollout_spread_max": 1.5,
}
REFERENCE_DEFAULT_WORK = {
    "ideal_wall_s": 0.8,
    "old_thread_flask_5s_polling_daemon_wall_s": 10.0,
    "litellm_successor_wall_s": 45.9,
    "litellm_successor_rollouts_missing_token_ids": "3 of 256",
    "controller_polling_every_1s_wall_s": 17.2,
    "bare_aiohttp_baseline_efficiency_measured_elsewhere": "0.76-0.78",
}
SWEEP_TASKS = (256, 1024, 4096)
SWEEP_AGENTS = (32, 128, 512)


# ---------------------------------------------------------------------------------------------- the work
def calls_for(index: int, fixed: int | None = None) -> int:
    """How many LLM calls the agent makes for task ``index``: 1, 2 or 3, uniform, fixed by a hash.

    ``fixed`` (``--calls-per-task``) overrides it; 0 measures the task server alone.
    """
    if fixed is not None:
        return fixed
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % 3


def task_text(index: int) -> str:
    return f"Task {index}: answer yes or no."


def simulate_greedy(ks: Sequence[int], agents: int, latency: float) -> float:
    """Makespan with zero overhead when each free agent takes the next task in queue order."""
    free_at = [0.0] * min(agents, len(ks))
    heapq.heapify(free_at)
    for k in ks:
        heapq.heappush(free_at, heapq.heappop(free_at) + k * latency)
    return max(free_at, default=0.0)


@dataclass(frozen=True)
class Work:
    tasks: int
    agents: int
    latency: float
    fixed_calls: int | None = None

    @property
    def ks(self) -> list[int]:
        return [calls_for(i, self.fixed_calls) for i in range(self.tasks)]

    def describe(self) -> dict[str, Any]:
        ks = self.ks
        ideal = sum(ks) * self.latency / self.agents
        sim = simulate_greedy(ks, self.agents, self.latency)
        return {
            "tasks": self.tasks,
            "agents": self.agents,
            "latency_ms": round(self.latency * 1e3, 3),
            "llm_calls": sum(ks),
            "calls_per_task": dict(sorted(Counter(ks).items())),
            "ideal_wall_s": round(ideal, 4),
            "simulated_zero_overhead_wall_s": round(sim, 4),
            "simulated_zero_overhead_efficiency": round(ideal / sim, 4) if sim else None,
        } | ({"calls_per_task_fixed": self.fixed_calls} if self.fixed_calls is not None else {})


# ---------------------------------------------------------------------------------------------- children
def aglverl_source() -> dict[str, Any]:
    """Which aglverl code was measured (it changes under us): a hash of its sources and the newest mtime."""
    root = HERE.parent / "aglverl"
    digest = hashlib.sha256()
    newest = 0.0
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
        newest = max(newest, path.stat().st_mtime)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(newest))
    return {"sha256_12": digest.hexdigest()[:12], "newest_file_mtime": stamp}


async def _run_mock(cfg: dict[str, Any]) -> None:
    from aglverl.testing import MockVLLM

    async with MockVLLM(
        latency=cfg["latency"], completion_tokens=COMPLETION_TOKENS, record_requests=False, model=MODEL
    ) as mock:
        emit({"url": mock.url, "pid": os.getpid()})
        async for _ in stdin_commands():
            emit({"completed": mock.completed, "cancelled": mock.cancelled})


class _GcWatch:
    """Times the cyclic garbage collector's passes (``gc.callbacks``): count, total and longest, per generation."""

    def __init__(self) -> None:
        self.reset()
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        gen = info["generation"]
        took = time.perf_counter() - self._started
        self.passes[gen] += 1
        self.seconds[gen] += took
        self.longest[gen] = max(self.longest[gen], took)

    def report(self) -> dict[str, Any]:
        return {
            f"gen{g}": {
                "passes": self.passes[g],
                "total_ms": round(self.seconds[g] * 1e3, 2),
                "longest_ms": round(self.longest[g] * 1e3, 2),
            }
            for g in range(3)
        } | {"tracked_objects": len(gc.get_objects())}


def _check_rows(data: Any, rollout_ids: Sequence[str], fixed_calls: int | None) -> dict[str, Any]:
    """Every batch row's ids against the mock: response ids must be what the mock generates for the prompt."""
    from aglverl.testing import completion_token_ids

    prompts = data.batch["prompts"]
    responses = data.batch["responses"]
    prompt_mask = data.batch["attention_mask"][:, : prompts.shape[1]].bool()
    response_len = data.batch["response_mask"].sum(-1).tolist()
    row_rollouts = list(data.non_tensor_batch["rollout_id_list"])
    with_ids = matching = 0
    good_rows: Counter[str] = Counter()
    for row in range(len(data)):
        prompt = prompts[row][prompt_mask[row]].tolist()
        response = responses[row][: response_len[row]].tolist()
        if prompt and response:
            with_ids += 1
            if response == completion_token_ids(prompt, 0, COMPLETION_TOKENS):
                matching += 1
                good_rows[row_rollouts[row]] += 1
    incomplete = sum(good_rows[rid] != calls_for(i, fixed_calls) for i, rid in enumerate(rollout_ids))
    return {
        "rows": len(data),
        "rows_with_ids": with_ids,
        "rows_matching_backend": matching,
        "rollouts_with_missing_or_wrong_ids": incomplete,
    }


class _LoopLag:
    """Diagnosis (``--loop-lag``): how late the daemon's loop wakes a 2 ms sleeper, and why.

    For each wake-up it notes the lateness and the main thread's CPU time in the interval: a late wake-up
    with little CPU used means the process was waiting for a core (other processes ran); one with the CPU
    used means the loop itself was busy running other callbacks.
    """

    TICK = 0.002

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.active = False

    async def run(self) -> None:
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            await anyio.sleep(self.TICK)
            if self.active:
                self.samples.append((time.perf_counter() - t0 - self.TICK, time.thread_time() - c0))

    def report(self) -> dict[str, Any] | None:
        if not self.samples:
            return None
        late = [(lag, cpu) for lag, cpu in self.samples if lag > 0.005]
        late_wall = sum(lag + self.TICK for lag, _ in late)
        return {
            "wakeups": len(self.samples),
            "lateness_ms": summary_ms([lag for lag, _ in self.samples]),
            "late_over_5ms": len(late),
            "late_over_5ms_total_ms": round(sum(lag for lag, _ in late) * 1e3, 1),
            "late_over_5ms_share_on_cpu": round(sum(c for _, c in late) / late_wall, 3) if late else None,
        }


async def _run_daemon(cfg: dict[str, Any]) -> None:
    from aglverl import AgentDaemon, BatchConfig

    counter = LogCounter()
    for name in ("", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).addHandler(counter)
    logging.getLogger().addHandler(logging.StreamHandler())  # keep printing what lastResort would have
    logging.getLogger().setLevel(logging.WARNING)
    daemon = AgentDaemon(
        port=0,
        proxy_port=0,
        backends=[cfg["mock_url"]],
        model=MODEL,
        batch=BatchConfig(max_prompt_length=PROMPT_WIDTH, max_response_length=RESPONSE_WIDTH),
        lease_seconds=600,
    )
    lag = _LoopLag()
    async with daemon, anyio.create_task_group() as tg:
        emit({"server_url": daemon.server_url, "proxy_url": daemon.proxy_url, "pid": os.getpid()})
        if cfg.get("loop_lag"):
            tg.start_soon(lag.run)
        await _trainer(daemon, counter, lag, cfg.get("fixed_calls"))
        tg.cancel_scope.cancel()


def _write_pyinstrument(profiler: Any, out: Path) -> None:
    """The call tree, and a flat list of self time per function, of the steps profiled so far."""
    out.write_text(profiler.output_text(unicode=True, show_all=False))
    out.with_suffix(".flat.txt").write_text(profiler.output_text(flat=True, flat_time="self"))


async def _trainer(daemon: Any, counter: LogCounter, lag: _LoopLag, fixed_calls: int | None) -> None:
    """The trainer side: one step per command, answered with its wall time, CPU, memory and checks."""
    pid = os.getpid()
    gc_watch = _GcWatch()
    profiler: Any = None
    async for cmd in stdin_commands():
        samples = [{"i": i, "text": task_text(i)} for i in range(cmd["tasks"])]
        gc_watch.reset()
        lag.samples.clear()
        lag.active = True
        if cmd.get("profile"):
            if profiler is None:
                from pyinstrument import Profiler

                profiler = Profiler(interval=0.0005, async_mode="disabled")  # samples the loop thread
            profiler.start()
        cpu0 = proc_cpu_seconds(pid)
        t0 = time.perf_counter()
        step = await daemon.submit(samples)
        batch = await daemon.batches.receive()
        wall = time.perf_counter() - t0
        cpu = proc_cpu_seconds(pid) - cpu0
        if cmd.get("profile"):
            profiler.stop()  # sessions of successive steps accumulate
            _write_pyinstrument(profiler, Path(cmd["profile"]))
        lag.active = False
        gc_report = gc_watch.report()
        assert batch.step == step.number
        keep = ("batch/", "step/n_", "step/seconds")
        check_started = time.process_time()
        ids = _check_rows(batch.data, step.rollout_ids, fixed_calls)
        emit(
            {
                "wall_s": wall,
                "cpu_s": cpu,
                "bench_check_cpu_s": time.process_time() - check_started,
                "gc": gc_report,
                "loop_lag": lag.report(),
                "peak_rss_bytes": peak_rss_bytes(pid),
                "ids": ids,
                "metrics": {k: v for k, v in batch.metrics.items() if k.startswith(keep)},
                "log_warnings": counter.count,
                "log_first": counter.first,
            }
        )


async def _run_baseline(cfg: dict[str, Any]) -> None:
    """A bare aiohttp task server: a queue with long-poll, a POST counter, an event at the last post."""
    import asyncio

    from aiohttp import web

    from aglverl._net import bind_listener, url_of

    loop = asyncio.get_running_loop()
    queue: deque[dict[str, Any]] = deque()
    parked: deque[asyncio.Future[dict[str, Any]]] = deque()
    state: dict[str, Any] = {"remaining": set(), "done": asyncio.Event()}
    resources = {
        "resources_id": "bare",
        "resources": {
            "main_llm": {
                "resource_type": "llm",
                "endpoint": f"{cfg['mock_url']}/v1",
                "model": MODEL,
                "sampling_parameters": {},
            }
        },
    }

    def answer(task: dict[str, Any] | None) -> web.Response:
        body = orjson.dumps({"is_available": task is not None, "task": task})
        return web.Response(body=body, content_type="application/json")

    async def get_task(request: web.Request) -> web.Response:
        if queue:
            return answer(queue.popleft())
        wait = float(request.query.get("wait", "0"))
        if wait <= 0:
            return answer(None)
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        parked.append(future)
        with anyio.move_on_after(wait):
            return answer(await future)
        return answer(None)

    async def get_resources(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(resources), content_type="application/json")

    async def post_rollout(request: web.Request) -> web.Response:
        rollout = orjson.loads(await request.read())
        remaining: set[str] = state["remaining"]
        remaining.discard(rollout["rollout_id"])
        if not remaining:
            state["done"].set()
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    app = web.Application()
    app.router.add_get("/task", get_task)
    app.router.add_get("/resources/{rid}", get_resources)
    app.router.add_post("/rollout", post_rollout)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = bind_listener("127.0.0.1", 0)
    await web.SockSite(runner, sock).start()
    pid = os.getpid()
    emit({"server_url": url_of(sock), "pid": pid})
    try:
        async for cmd in stdin_commands():
            number = cmd["number"]
            tasks = [
                {
                    "rollout_id": f"s{number}-{i}",
                    "attempt_id": "a0",
                    "input": {"i": i, "text": task_text(i)},
                    "resources_id": "bare",
                    "mode": "train",
                    "metadata": {},
                }
                for i in range(cmd["tasks"])
            ]
            state["remaining"] = {t["rollout_id"] for t in tasks}
            state["done"] = done = asyncio.Event()
            cpu0 = proc_cpu_seconds(pid)
            t0 = time.perf_counter()
            queue.extend(tasks)
            while queue and parked:
                future = parked.popleft()
                if not future.done():
                    future.set_result(queue.popleft())
            await done.wait()
            wall = time.perf_counter() - t0
            emit(
                {"wall_s": wall, "cpu_s": proc_cpu_seconds(pid) - cpu0, "peak_rss_bytes": peak_rss_bytes(pid)}
            )
    finally:
        await runner.cleanup()


async def _run_agents(cfg: dict[str, Any]) -> None:
    """``cfg["agents"]`` agent loops sharing one aiohttp session; ``stats`` returns and resets the counters."""
    from aglverl.models import ProxyLLM, ResourcesUpdate

    server = cfg["server_url"]
    stream = bool(cfg["stream"])
    latencies: list[float] = []
    get_times: list[float] = []  # GET /task that returned a task: pure overhead once tasks are queued
    since = [time.perf_counter()]  # GETs parked before the last stats call waited for the step, not in it
    post_times: list[float] = []
    counts = {"calls": 0, "tasks": 0, "errors": 0}
    first_errors: list[str] = []
    llms: dict[str, Any] = {}
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
    )

    async def llm_of(task: dict[str, Any]) -> tuple[str, str]:
        rid = task["resources_id"]
        llm = llms.get(rid)
        if llm is None:
            async with session.get(f"{server}/resources/{rid}") as resp:
                update = ResourcesUpdate.model_validate_json(await resp.read())
            llm = llms[rid] = update.resources["main_llm"]
        if isinstance(llm, ProxyLLM):
            return llm.get_base_url(task["rollout_id"], task["attempt_id"]), llm.model
        return llm.endpoint, llm.model

    async def chat(url: str, body: dict[str, Any]) -> str:
        started = time.perf_counter()
        async with session.post(url, data=orjson.dumps(body), headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                raise RuntimeError(f"chat call answered {resp.status}: {(await resp.read())[:200]!r}")
            if stream:
                content = await read_sse_text(resp)
            else:
                content = orjson.loads(await resp.read())["choices"][0]["message"]["content"]
        latencies.append(time.perf_counter() - started)
        counts["calls"] += 1
        return content

    async def solve(task: dict[str, Any]) -> dict[str, Any]:
        base, model = await llm_of(task)
        index = task["input"]["i"]
        messages = [{"role": "user", "content": task["input"]["text"]}]
        for _ in range(calls_for(index, cfg.get("fixed_calls"))):
            body = {"model": model, "messages": messages, "max_tokens": COMPLETION_TOKENS, "stream": stream}
            content = await chat(f"{base}/chat/completions", body)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
        return {"rollout_id": task["rollout_id"], "attempt_id": task["attempt_id"], "final_reward": index % 2}

    async def agent() -> None:
        while True:
            started = time.perf_counter()
            async with session.get(f"{server}/task?wait={LONG_POLL_SECONDS:g}") as resp:
                task = orjson.loads(await resp.read()).get("task")
            if not task:
                continue
            if started >= since[0]:
                get_times.append(time.perf_counter() - started)
            try:
                result = await solve(task)
            except Exception as exc:  # reported, and posted as a failed attempt like a real agent would
                counts["errors"] += 1
                if len(first_errors) < 5:
                    first_errors.append(repr(exc)[:300])
                result = {
                    "rollout_id": task["rollout_id"],
                    "attempt_id": task["attempt_id"],
                    "status": "failed",
                }
            started = time.perf_counter()
            async with session.post(
                f"{server}/rollout", data=orjson.dumps(result), headers=JSON_HEADERS
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    counts["errors"] += 1
            post_times.append(time.perf_counter() - started)
            counts["tasks"] += 1

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(cfg["agents"]):
                tg.start_soon(agent)
            emit({"pid": os.getpid()})
            async for _ in stdin_commands():
                emit(
                    {
                        **counts,
                        "first_errors": first_errors,
                        "latencies": [round(x, 6) for x in latencies],
                        "get_task": [round(x, 6) for x in get_times],
                        "post_rollout": [round(x, 6) for x in post_times],
                    }
                )
                for samples in (latencies, get_times, post_times):
                    samples.clear()
                since[0] = time.perf_counter()
                counts.update(calls=0, tasks=0, errors=0)
            tg.cancel_scope.cancel()
    finally:
        await session.close()


def _child_main(role: str, cfg: dict[str, Any]) -> None:
    runners = {"mock": _run_mock, "daemon": _run_daemon, "baseline": _run_baseline, "agents": _run_agents}
    run_loop(runners[role], cfg, loop="uvloop" if cfg.get("uvloop") else None)


# ---------------------------------------------------------------------------------------------- measuring
@dataclass(frozen=True, kw_only=True)
class Options:
    """How a point is measured (everything but the work itself)."""

    stream: bool = False
    baseline: bool = False
    repeats: int = 5
    warmup_tasks: int = 64
    agent_procs: int = 1
    healthz_interval: float = 0.01
    deadline: float = 120.0
    server_uvloop: bool = False
    quiet_cores: float = 0.35
    quiet_max_wait: float = 60.0
    loop_lag: bool = False
    idle_before_step: float = 0.0
    profile: Path | None = None
    profiler: str = "py-spy"


@dataclass
class System:
    """A task server child (the daemon, or the bare baseline) with its agent children."""

    name: str
    server: JsonChild
    agents: list[JsonChild]
    steps: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    async def start(cls, name: str, mock_url: str, work: Work, opts: Options) -> System:
        agents, fixed_calls = work.agents, work.fixed_calls
        cfg = {
            "mock_url": mock_url,
            "uvloop": opts.server_uvloop,
            "loop_lag": opts.loop_lag,
            "fixed_calls": fixed_calls,
        }
        server = await JsonChild.start(child_args(__file__, name, cfg))
        children: list[JsonChild] = []
        procs = opts.agent_procs
        try:
            for p in range(procs):
                share = agents // procs + (p < agents % procs)
                cfg = {
                    "server_url": server.info["server_url"],
                    "agents": share,
                    "stream": opts.stream,
                    "fixed_calls": fixed_calls,
                }
                children.append(await JsonChild.start(child_args(__file__, "agents", cfg)))
        except BaseException:
            for child in children:
                await child.kill()
            await server.kill()
            raise
        return cls(name, server, children)

    async def step(self, tasks: int, profile: Path | None = None) -> dict[str, Any]:
        """One step of ``tasks`` tasks; ``profile``: the daemon profiles it with pyinstrument into that file."""
        self.steps += 1
        cmd = {"cmd": "step", "tasks": tasks, "number": self.steps}
        if profile is not None:
            cmd["profile"] = str(profile)
        return await self.server.request(cmd)

    async def agent_stats(self) -> dict[str, Any]:
        lists = ("first_errors", "latencies", "get_task", "post_rollout")
        total: dict[str, Any] = {"calls": 0, "tasks": 0, "errors": 0} | {k: [] for k in lists}
        for child in self.agents:
            stats = await child.request({"cmd": "stats"})
            for key in total:
                total[key] += stats[key]
        return total

    async def stop(self, *, kill: bool = False) -> None:
        for child in [*self.agents, self.server]:
            await (child.kill() if kill else child.stop())


class _Cpu:
    """CPU seconds of every benchmark process, and of the whole machine, between two snapshots."""

    def __init__(self, children: dict[str, JsonChild]) -> None:
        self.pids = {name: c.pid for name, c in children.items()} | {"orchestrator": os.getpid()}

    def snapshot(self) -> dict[str, float]:
        return {name: proc_cpu_seconds(pid) for name, pid in self.pids.items()} | {
            "_machine": system_busy_seconds()
        }

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        d = {k: after[k] - before[k] for k in before}
        d["_foreign"] = max(0.0, d["_machine"] - sum(v for k, v in d.items() if not k.startswith("_")))
        return d


async def _probe_healthz(url: str, interval: float, out: list[float]) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        while True:
            started = time.perf_counter()
            async with session.get(url) as resp:
                await resp.read()
            out.append(time.perf_counter() - started)
            await anyio.sleep(interval)


async def _wait_for_quiet(cpu: _Cpu, cores: float, max_wait: float) -> float:
    """Wait (up to ``max_wait`` s) for a 0.5 s window in which other programs used < ``cores`` CPUs.

    The machine is shared; this keeps other people's test runs out of the measured step where possible
    (the CPU they did take during the step is reported either way). Returns the seconds waited.
    """
    started = time.monotonic()
    while time.monotonic() - started < max_wait:
        before = cpu.snapshot()
        await anyio.sleep(QUIET_WINDOW)
        if cpu.delta(before, cpu.snapshot())["_foreign"] < cores * QUIET_WINDOW:
            break
    return time.monotonic() - started


async def measure_once(system: System, mock: JsonChild, work: Work, opts: Options) -> dict[str, Any]:
    """One measured step of ``work`` on ``system``; ``TimeoutError`` past ``opts.deadline`` seconds."""
    children = {"server": system.server, "mock": mock} | {
        f"agents{i}": a for i, a in enumerate(system.agents)
    }
    cpu = _Cpu(children)
    await anyio.sleep(opts.idle_before_step)  # the trainer's update between steps, when asked for
    waited = await _wait_for_quiet(cpu, opts.quiet_cores, opts.quiet_max_wait) if opts.quiet_cores else 0.0
    await system.agent_stats()  # every agent is parked in GET /task now: start its counters here
    health: list[float] = []
    probe = opts.healthz_interval > 0 and system.name == "daemon"
    async with anyio.create_task_group() as tg:
        if probe:
            url = f"{system.server.info['server_url']}/healthz"
            async with aiohttp.ClientSession() as s, s.get(url) as r:  # also checks the route answers
                await r.read()
            tg.start_soon(_probe_healthz, url, opts.healthz_interval, health)
        before = cpu.snapshot()
        with anyio.fail_after(opts.deadline):
            in_process = opts.profile if opts.profiler == "pyinstrument" and system.name == "daemon" else None
            result = await system.step(work.tasks, in_process)
        after = cpu.snapshot()
        tg.cancel_scope.cancel()
    stats = await system.agent_stats()
    d = cpu.delta(before, after)
    d["server"] -= result.get("bench_check_cpu_s", 0.0)  # the benchmark's own id check, not the daemon's work
    result["cpu"] = d
    result["agents"] = stats
    result["healthz"] = health
    result["waited_for_quiet_s"] = waited
    return result


def summarize(name: str, work: Work, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures over its measured steps (medians; latencies pooled)."""
    desc = work.describe()
    walls = [r["wall_s"] for r in runs]
    wall = statistics.median(walls)
    n, calls = work.tasks, desc["llm_calls"]

    def per_rollout_ms(key: str) -> float:
        return round(
            statistics.median(sum(v for k, v in r["cpu"].items() if k.startswith(key)) for r in runs)
            / n
            * 1e3,
            4,
        )

    out: dict[str, Any] = {
        "wall_s": round(wall, 4),
        "walls_s": [round(w, 4) for w in walls],
        "efficiency": round(desc["ideal_wall_s"] / wall, 4),
        "efficiency_vs_simulated_zero_overhead": round(desc["simulated_zero_overhead_wall_s"] / wall, 4),
        "rollouts_per_s": round(n / wall, 1),
        "llm_calls_per_s": round(calls / wall, 1),
        "agent_llm_latency_ms": summary_ms([x for r in runs for x in r["agents"]["latencies"]]),
        "agent_get_task_ms": summary_ms([x for r in runs for x in r["agents"]["get_task"]]),
        "agent_post_rollout_ms": summary_ms([x for r in runs for x in r["agents"]["post_rollout"]]),
        "waited_for_quiet_s": [round(r["waited_for_quiet_s"], 1) for r in runs],
        "server_cpu_s_per_rollout": round(statistics.median(r["cpu_s"] for r in runs) / n, 7),
        # ~1.0 means the server's one event loop had a core to itself and used all of it: saturated.
        "server_cores_busy": round(statistics.median(r["cpu_s"] / r["wall_s"] for r in runs), 3),
        "server_peak_rss_mb": round(max(r["peak_rss_bytes"] for r in runs) / 2**20, 1),
        "cpu_ms_per_rollout": {
            "server": per_rollout_ms("server"),
            "agents": per_rollout_ms("agents"),
            "mock": per_rollout_ms("mock"),
            "orchestrator": per_rollout_ms("orchestrator"),
            "other_programs_on_machine": per_rollout_ms("_foreign"),
        },
        "agent_calls_made": [r["agents"]["calls"] for r in runs],
        "agent_errors": sum(r["agents"]["errors"] for r in runs),
        "agent_first_errors": [e for r in runs for e in r["agents"]["first_errors"]][:5],
    }
    if name == "daemon":
        ids = [r["ids"] for r in runs]
        made = sum(r["agents"]["calls"] for r in runs)
        out["daemon_cpu_s_per_rollout"] = out.pop("server_cpu_s_per_rollout")
        out["daemon_peak_rss_mb"] = out.pop("server_peak_rss_mb")
        out["daemon_cores_busy"] = out.pop("server_cores_busy")
        out["token_ids"] = {
            "calls_made": made,
            "rows": sum(i["rows"] for i in ids),
            "rows_with_ids": sum(i["rows_with_ids"] for i in ids),
            "rows_matching_backend": sum(i["rows_matching_backend"] for i in ids),
            "rollouts_with_missing_or_wrong_ids": sum(i["rollouts_with_missing_or_wrong_ids"] for i in ids),
            "captured_over_expected": round(sum(i["rows_matching_backend"] for i in ids) / made, 6)
            if made
            else None,
        }
        out["healthz_ms"] = summary_ms([x for r in runs for x in r["healthz"]])
        out["batch_metrics_last_step"] = {
            k: v for k, v in runs[-1]["metrics"].items() if not k.endswith("_mean")
        }
        out["daemon_log_warnings"] = runs[-1]["log_warnings"]
        out["daemon_log_first"] = runs[-1]["log_first"]
        out["daemon_gc_during_step"] = [r["gc"] for r in runs]
        if runs[-1].get("loop_lag"):
            out["daemon_loop_lag"] = [r["loop_lag"] for r in runs]
    else:
        out["bare_server_cpu_s_per_rollout"] = out.pop("server_cpu_s_per_rollout")
        out["bare_server_peak_rss_mb"] = out.pop("server_peak_rss_mb")
        out["bare_server_cores_busy"] = out.pop("server_cores_busy")
    return out


def targets(work: Work, ours: dict[str, Any]) -> dict[str, Any]:
    t: dict[str, Any] = {
        "efficiency": {
            "target": f">= {TARGETS['efficiency_min']}",
            "measured": ours["efficiency"],
            "met": ours["efficiency"] >= TARGETS["efficiency_min"],
        },
        "token_ids_ratio": {
            "target": TARGETS["token_ids_ratio"],
            "measured": ours["token_ids"]["captured_over_expected"],
            "met": ours["token_ids"]["captured_over_expected"] == TARGETS["token_ids_ratio"],
        },
    }
    if work.agents >= 512:
        p99 = ours["healthz_ms"].get("p99", math.inf)
        t["healthz_p99_ms"] = {
            "target": f"<= {TARGETS['healthz_p99_ms_max_at_512_agents']}",
            "measured": p99,
            "met": p99 <= TARGETS["healthz_p99_ms_max_at_512_agents"],
        }
    return t


async def run_point(mock: JsonChild, work: Work, opts: Options) -> dict[str, Any]:
    """Start the systems, warm up, measure ``repeats`` steps (alternating systems), stop; one JSON object."""
    names = ["daemon", "baseline"] if opts.baseline else ["daemon"]
    systems: list[System] = []
    killed = False
    record: dict[str, Any] = {
        "benchmark": "control_plane",
        "stream": opts.stream,
        "work": work.describe(),
        "repeats": opts.repeats,
        "server_event_loop": "uvloop" if opts.server_uvloop else loop_name(),
        "aglverl_source": aglverl_source(),
        "machine": machine_info(),
    }
    spy: anyio.abc.Process | None = None
    try:
        for name in names:
            systems.append(await System.start(name, mock.info["url"], work, opts))
        for system in systems:
            with anyio.fail_after(opts.deadline):
                await system.step(min(work.tasks, opts.warmup_tasks))
            await system.agent_stats()
        if opts.profile is not None and opts.profiler == "py-spy":
            spy = await _start_py_spy(systems[0].server.pid, opts.profile)
        for _ in range(opts.repeats):
            for system in systems:
                system.runs.append(await measure_once(system, mock, work, opts))
    except TimeoutError:
        killed = True
        record["skipped"] = f"a step did not finish within {opts.deadline:.0f} s (cap per point); killed"
        return record
    finally:
        if spy is not None:
            await _stop_py_spy(spy)
        for system in systems:
            await system.stop(kill=killed)
    ours = summarize("daemon", work, systems[0].runs)
    record["aglverl"] = ours
    if opts.baseline:
        bare = summarize("baseline", work, systems[1].runs)
        record["baseline_bare_aiohttp_direct_to_mock"] = bare
        record["daemon_cost"] = {
            "wall_ratio_daemon_over_bare": round(ours["wall_s"] / bare["wall_s"], 3),
            "efficiency_ratio_daemon_over_bare": round(ours["efficiency"] / bare["efficiency"], 3),
            "extra_wall_s": round(ours["wall_s"] - bare["wall_s"], 4),
        }
    record["targets"] = targets(work, ours)
    if (work.tasks, work.agents, work.latency) == (256, 32, 0.05):
        record["reference_default_work"] = REFERENCE_DEFAULT_WORK
        record["speedup_vs_old_daemon"] = round(10.0 / ours["wall_s"], 1)
    return record


# ---------------------------------------------------------------------------------------------- profiling
async def _start_py_spy(pid: int, out: Path) -> anyio.abc.Process:
    """py-spy sampling ``pid`` (all threads, idle excluded) into collapsed stacks; returns once attached.

    Blocking mode (the process is paused for each sample): with ``--nonblocking`` py-spy often caught 3.11
    frames half set up and charged ~25% of samples to the ``def`` lines of arbitrary functions.
    """
    exe = Path(sys.executable).with_name("py-spy")
    cmd = [str(exe), "record", "--pid", str(pid), "--format", "raw", "--rate", str(PY_SPY_RATE)]
    spy = await anyio.open_process([*cmd, "-o", str(out)], stdout=subprocess.PIPE, stderr=None)
    assert spy.stdout is not None
    with anyio.fail_after(30):
        line = await BufferedByteReceiveStream(spy.stdout).receive_until(b"\n", 4096)
    if b"Sampling" not in line:  # "py-spy> Sampling process 250 times a second. ..." once attached
        raise RuntimeError(f"py-spy did not start: {line!r}")
    return spy


async def _stop_py_spy(spy: anyio.abc.Process) -> None:
    """SIGINT makes py-spy write its output file and exit."""
    with anyio.CancelScope(shield=True), anyio.fail_after(60):
        spy.send_signal(signal.SIGINT)
        await spy.wait()


def _frame_key(frame: str) -> str:
    name, _, where = frame.partition(" (")
    path = where.split(":", 1)[0]
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"


#: Leaf frames that are waiting, not working (py-spy's blocking mode still reports some of them as active).
IDLE_LEAVES = ("Condition.wait (threading.py)", "EpollSelector.select (selectors.py)")
#: Components of the daemon by a frame that appears in the stack (first match wins), for the CPU split.
COMPONENTS = (
    ("benchmark's own checks (after the step)", ("_check_rows", "_GcWatch", "_LoopLag")),
    ("collector + batch build", ("RolloutCollector", "aglverl/trajectory/")),
    ("LLM proxy (handlers)", ("LLMProxy.",)),
    ("task server (uvicorn + starlette + routes)", ("uvicorn/", "starlette/", "TaskServer.")),
    ("trainer side (submit)", ("AgentDaemon.submit",)),
    ("store (outside handlers)", ("aglverl/store/",)),
)


def summarize_profile(path: Path, top: int = 25) -> dict[str, Any]:
    """From collapsed stacks: shares of working samples per function (self, inclusive), library, component.

    Samples whose leaf is an idle wait (:data:`IDLE_LEAVES`) are counted apart. The rest of the loop's own
    work (reading sockets, running callbacks, aiohttp protocol code below any handler) is "event loop and
    protocol plumbing".
    """
    self_counts: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    libs: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    total = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = [_frame_key(f) for f in stack.split(";") if "(" in f]
        if not frames:
            continue
        count = int(count_text)
        if frames[-1] in IDLE_LEAVES:
            idle += count
            continue
        total += count
        self_counts[frames[-1]] += count
        for key in set(frames):
            incl[key] += count
        leaf_path = frames[-1].rsplit("(", 1)[1].rstrip(")")
        libs[leaf_path.split("/", 1)[0].removesuffix(".py")] += count
        part = "event loop and protocol plumbing"
        for name, markers in COMPONENTS:
            if any(m in stack for m in markers):
                part = name
                break
        parts[part] += count

    def share(c: Counter[str], n: int = top) -> list[list[Any]]:
        return [[k, round(v / total * 100, 1)] for k, v in c.most_common(n)]

    return {
        "working_samples": total,
        "idle_samples_excluded": idle,
        "component_percent": share(parts, len(COMPONENTS) + 1),
        "self_percent": share(self_counts),
        "inclusive_percent": share(incl),
        "self_percent_by_library": share(libs),
    }


# ---------------------------------------------------------------------------------------------- sweep output
TABLE_HEAD = (
    "| N | M | stream | ideal s | zero-overhead s | wall s | efficiency | eff. vs zero-overhead | rollouts/s "
    "| LLM calls/s | LLM p50 / p99 ms | daemon CPU ms/rollout | daemon busy (cores) | peak RSS MB | ids "
    "| /healthz p99 ms | other programs' CPU s |\n"
    "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(rec: dict[str, Any]) -> str:
    w = rec["work"]
    head = f"| {w['tasks']} | {w['agents']} | {'sse' if rec['stream'] else 'json'} | {w['ideal_wall_s']:.3f} "
    head += f"| {w['simulated_zero_overhead_wall_s']:.3f} "
    if "aglverl" not in rec:
        return head + f"| skipped: {rec.get('skipped', '?')} |" + " |" * 11
    a = rec["aglverl"]
    lat = a["agent_llm_latency_ms"]
    foreign = a["cpu_ms_per_rollout"]["other_programs_on_machine"] * w["tasks"] / 1e3
    return head + (
        f"| {a['wall_s']:.3f} | {a['efficiency']:.3f} | {a['efficiency_vs_simulated_zero_overhead']:.3f} "
        f"| {a['rollouts_per_s']:.0f} | {a['llm_calls_per_s']:.0f} | {lat['p50']:.1f} / {lat['p99']:.1f} "
        f"| {a['daemon_cpu_s_per_rollout'] * 1e3:.2f} | {a['daemon_cores_busy']:.2f} | {a['daemon_peak_rss_mb']:.0f} "
        f"| {a['token_ids']['captured_over_expected']} | {a['healthz_ms'].get('p99', float('nan')):.1f} "
        f"| {foreign:.1f} |"
    )


def plot_sweep(records: list[dict[str, Any]], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if "aglverl" in r]
    written = []
    for metric, label, fname in (
        ("efficiency", "efficiency = ideal / wall", "control_plane_efficiency.png"),
        ("cpu", "daemon CPU ms per rollout", "control_plane_cpu_per_rollout.png"),
    ):

        def value(r: dict[str, Any], metric: str = metric) -> float:
            a = r["aglverl"]
            return a["efficiency"] if metric == "efficiency" else a["daemon_cpu_s_per_rollout"] * 1e3

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, (x_key, line_key, x_label, line_label) in zip(
            axes,
            (("tasks", "agents", "N (tasks)", "M"), ("agents", "tasks", "M (agents)", "N")),
            strict=True,
        ):
            for stream in (False, True):
                for line in sorted({r["work"][line_key] for r in done}):
                    pts = sorted(
                        (r["work"][x_key], value(r))
                        for r in done
                        if r["stream"] == stream and r["work"][line_key] == line
                    )
                    if pts:
                        xs, ys = zip(*pts, strict=True)
                        ax.plot(
                            xs,
                            ys,
                            marker="o",
                            linestyle="--" if stream else "-",
                            label=f"{line_label}={line} {'sse' if stream else 'json'}",
                        )
            ax.set_xscale("log", base=2)
            ax.set_xlabel(x_label)
            ax.set_ylabel(label)
            if metric == "efficiency":
                ax.axhline(TARGETS["efficiency_min"], color="grey", linewidth=0.8, linestyle=":")
                ax.set_ylim(0, 1)
            else:
                ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        fig.suptitle(f"aglverl control plane: {label} (mock latency 50 ms, 1-3 calls/task, 2 cores shared)")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path.relative_to(HERE.parent)))
    return written


SWEEP_BEGIN = "<!-- control_plane_sweep:begin -->"
SWEEP_END = "<!-- control_plane_sweep:end -->"


def write_sweep_table(table: str) -> None:
    """Put ``table`` between the sweep markers of RESULTS.md's "## Control plane" section (created if absent)."""
    block = f"{SWEEP_BEGIN}\n{table}\n{SWEEP_END}"
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else "# Benchmark results\n"
    if SWEEP_BEGIN in text and SWEEP_END in text:
        head, rest = text.split(SWEEP_BEGIN, 1)
        text = head + block + rest.split(SWEEP_END, 1)[1]
    elif "## Control plane" in text:
        head, rest = text.split("## Control plane", 1)
        nxt = rest.find("\n## ")
        section, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        text = head + "## Control plane" + section.rstrip("\n") + "\n\n" + block + "\n" + tail
    else:
        text = text.rstrip("\n") + "\n\n## Control plane\n\n" + block + "\n"
    RESULTS_MD.write_text(text)


# ---------------------------------------------------------------------------------------------- main
def _options(args: argparse.Namespace, **overrides: Any) -> Options:
    fields = {
        "stream": args.stream,
        "baseline": args.baseline,
        "repeats": args.repeats,
        "warmup_tasks": args.warmup_tasks or max(args.agents, 64),
        "agent_procs": args.agent_procs,
        "healthz_interval": args.healthz_interval,
        "deadline": args.deadline,
        "server_uvloop": args.server_uvloop,
        "quiet_cores": args.quiet_cores,
        "quiet_max_wait": args.quiet_max_wait,
        "loop_lag": args.loop_lag,
        "idle_before_step": args.idle_before_step,
    }
    return Options(**(fields | overrides))


async def main_async(args: argparse.Namespace) -> None:
    latency = args.latency_ms / 1e3
    mock = await JsonChild.start(child_args(__file__, "mock", {"latency": latency}))
    try:
        if args.sweep:
            await sweep(mock, args, latency)
            return
        profile = None
        if args.profile:
            profile = RESULTS_DIR / f"control_plane_profile_{args.profiler.replace('-', '')}.txt"
            RESULTS_DIR.mkdir(exist_ok=True)
        record = await run_point(
            mock,
            Work(args.tasks, args.agents, latency, args.calls_per_task),
            _options(args, profile=profile, profiler=args.profiler),
        )
        if profile is not None and profile.exists() and args.profiler == "py-spy":
            record["profile"] = {"file": str(profile.relative_to(HERE.parent)), **summarize_profile(profile)}
        print(json.dumps(record), flush=True)
    finally:
        await mock.stop()


async def sweep(mock: JsonChild, args: argparse.Namespace, latency: float) -> None:
    """Every (N, M, stream) point once, each in fresh daemon and agent processes; then table and plots."""
    RESULTS_DIR.mkdir(exist_ok=True)
    started = time.monotonic()
    records = []
    with (RESULTS_DIR / "control_plane_sweep.jsonl").open("w") as rows:
        for stream in (False, True):
            for tasks in SWEEP_TASKS:
                for agents in SWEEP_AGENTS:
                    work = Work(tasks, agents, latency)
                    cap = min(args.point_cap, max(30.0, 8 * work.describe()["ideal_wall_s"] + 20))
                    opts = _options(
                        args,
                        stream=stream,
                        baseline=False,
                        repeats=args.sweep_repeats,
                        warmup_tasks=min(tasks, max(agents, 64)),
                        deadline=cap,
                    )
                    record = await run_point(mock, work, opts)
                    print(json.dumps(record), flush=True)
                    rows.write(json.dumps(record) + "\n")
                    records.append(record)
    done = [r for r in records if "aglverl" in r]
    cpu = [r["aglverl"]["daemon_cpu_s_per_rollout"] * 1e3 for r in done]
    at512 = [r["aglverl"]["healthz_ms"].get("p99") for r in done if r["work"]["agents"] == 512]
    table = "\n".join([TABLE_HEAD, *(table_row(r) for r in records)])
    (RESULTS_DIR / "control_plane_sweep.md").write_text(table + "\n")
    if args.write_results:
        write_sweep_table(table)
    plots = plot_sweep(records, RESULTS_DIR)
    spread = max(cpu) / min(cpu) if cpu else math.nan
    summary = {
        "benchmark": "control_plane_sweep_summary",
        "points": len(records),
        "skipped": [
            {
                "tasks": r["work"]["tasks"],
                "agents": r["work"]["agents"],
                "stream": r["stream"],
                "why": r["skipped"],
            }
            for r in records
            if "skipped" in r
        ],
        "sweep_seconds": round(time.monotonic() - started, 1),
        "daemon_cpu_ms_per_rollout": {
            "min": round(min(cpu), 3),
            "max": round(max(cpu), 3),
            "max_over_min": round(spread, 3),
            "target": f"roughly constant (max/min <= {TARGETS['cpu_per_rollout_spread_max']})",
            "met": spread <= TARGETS["cpu_per_rollout_spread_max"],
        },
        "healthz_p99_ms_at_512_agents": {
            "measured": at512,
            "target": f"<= {TARGETS['healthz_p99_ms_max_at_512_agents']}",
            "met": all(x is not None and x <= TARGETS["healthz_p99_ms_max_at_512_agents"] for x in at512),
        },
        "efficiency": {
            f"{r['work']['tasks']}x{r['work']['agents']}{'-sse' if r['stream'] else ''}": r["aglverl"][
                "efficiency"
            ]
            for r in done
        },
        "plots": plots,
        "table_markdown": table,
        "machine": machine_info(),
    }
    print(json.dumps(summary), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--tasks", type=int, default=256, help="N: tasks per step (default 256)")
    add("--agents", type=int, default=32, help="M: concurrent agents (default 32)")
    add("--latency-ms", type=float, default=50.0, help="mock latency per LLM call (default 50)")
    add("--calls-per-task", type=int, choices=(0, 1, 2, 3), help="fixed k instead of 1-3 by hash (0: no LLM)")
    add("--stream", action="store_true", help="agents make streaming (SSE) chat calls")
    add("--baseline", action="store_true", help="also measure a bare aiohttp server, agents -> mock")
    add("--sweep", action="store_true", help="N in {256,1024,4096} x M in {32,128,512} x stream on/off")
    add("--profile", action="store_true", help="profile the daemon during the measured steps")
    add("--profiler", choices=("py-spy", "pyinstrument"), default="py-spy", help="sampler for --profile")
    add("--repeats", type=int, default=5, help="measured steps per system (median reported; default 5)")
    add("--sweep-repeats", type=int, default=1, help="measured steps per sweep point (default 1)")
    add("--warmup-tasks", type=int, default=0, help="tasks in the warm-up step (default max(M, 64))")
    add("--agent-procs", type=int, default=1, help="processes the M agents are split across (default 1)")
    add("--server-uvloop", action="store_true", help="run the daemon (and bare server) on uvloop")
    add("--healthz-interval", type=float, default=0.01, help="seconds between /healthz probes (0: off)")
    add("--quiet-cores", type=float, default=0.35, help="wait for other programs to use < this many CPUs")
    add("--quiet-max-wait", type=float, default=60.0, help="longest wait for quiet before a step, seconds")
    add(
        "--idle-before-step", type=float, default=0.0, help="idle seconds before each step (a trainer update)"
    )
    add("--loop-lag", action="store_true", help="diagnosis: measure the daemon loop's wake-up lateness")
    add("--deadline", type=float, default=120.0, help="cap on one step, seconds")
    add("--point-cap", type=float, default=90.0, help="sweep: cap on one step, seconds")
    add("--write-results", action="store_true", help="sweep: put the table into RESULTS.md")
    add(
        "--quick",
        action="store_true",
        help="N=32, M=8, 10 ms, one measured step, no waiting for quiet (a smoke run)",
    )
    add("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.tasks, args.agents, args.latency_ms, args.repeats = 32, 8, 10.0, 1
        args.warmup_tasks, args.quiet_max_wait, args.healthz_interval = 8, 0.0, 0.0
    if args.child:
        _child_main(args.child[0], json.loads(args.child[1]))
        return
    run_loop(main_async, args)


if __name__ == "__main__":
    main()
