"""Soak: >= 10,000 rollouts through the real daemon with faulty backends and vanishing agents; nothing may be lost.

Run: ``python benchmarks/soak.py [--rollouts 10000 --agents 300 --max-seconds 600]`` (``--help`` for the rest).
Prints ONE JSON object on stdout; progress goes to stderr.

``python benchmarks/soak.py --training [--steps 200 --kill-every 50]`` runs the training soak instead:
``AsyncVERL`` on CPU with agents failing 10% and hanging past their lease 2% of the time, SIGKILLed and
restarted every 50 steps (see ``benchmarks/_training_soak.py``): steps trained, rollouts lost and duplicated,
journal size and RSS per step.

Processes (each figure belongs to one program):

- ``mock``: a :class:`~aglverl.testing.MockVLLM` answering 8 tokens after ``latency + U(0, jitter)`` seconds,
  with a seeded random ``--failure-rate`` of generation calls answered 500 at once;
- ``daemon``: an :class:`~aglverl.AgentDaemon` (short ``--lease-seconds`` so vanished agents' tasks come back
  quickly; proxy retry policy and ``--max-attempts`` at their defaults) plus the trainer: it keeps
  ``--inflight-steps`` steps submitted (each ``--rollouts-per-step`` rollouts = samples x ``--n``), takes every
  batch from ``daemon.batches``, checks it (below), drops it, and samples its own RSS (``VmRSS``) after each
  step; ``VmHWM`` at the end. It stops submitting once ``--rollouts`` are queued or the time budget runs low;
- ``agents``: ``--agents`` agent loops as asyncio tasks in ``--agent-procs`` processes. Each long-polls a task,
  makes the sample's k (1-3, fixed per sample) chat calls through the rollout's proxy URL (half of them
  streamed), thinking a random ``U(0, think)`` before each, and posts reward 1. A call that fails (non-200,
  broken stream, error event) is the agent's failure: it posts ``status="failed"`` at once (as ``run_agents``
  does) and the daemon requeues the task while attempts remain; the agent does not retry the call itself (the
  proxy already retries 5xx/429 before the first byte). With probability ``--vanish-rate`` an agent vanishes
  from a rollout: before a call, in the middle of one (the request is abandoned, closing its connection), or
  after its last call; it never posts, so the lease must expire and the task be requeued. With probability
  ``--straggle-rate`` an agent finishes its calls and then dawdles ``U(1, 2)`` leases before posting: its task
  is requeued meanwhile, two attempts race, and the first result must win (the other one is refused or
  ignored, never counted twice);
- this process: starts the others, bounds the run (``--max-seconds``), gathers the figures.

What is checked:

- lost = rollouts queued minus rollouts of finished steps that reached a terminal state (a step that never
  produced its batch loses all of its rollouts), plus per-step shortfalls of completed + failed vs queued;
  also the store must hold no rollout after the last step;
- duplicated = (rollout, turn) rows repeated in a batch + rollouts appearing in two batches + rows of rollouts
  another step queued + per-step excesses of completed + failed over queued;
- every completed rollout has exactly k rows (turns 0..k-1), each response equal to what the mock generates
  for that row's prompt ids (exact token ids of the winning attempt, nothing from a vanished attempt);
- batches contain only rollouts some agent got a "received and stored" answer for, and vice versa;
- RSS flat: see :func:`rss_verdict`.

If the time budget runs out with steps still open, the daemon is asked what it still holds and the JSON carries
it under ``overran_budget`` (the open steps' rollouts then count as lost). ``ok`` is true when nothing was lost
or duplicated, every id check passed and RSS was judged flat.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import aiohttp
import anyio
import numpy as np
import orjson
from _common import run_loop

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
    status_kib,
    stdin_commands,
    summary_ms,
    system_busy_seconds,
)

MODEL = "mock"
COMPLETION_TOKENS = 8
#: Longest prompt: the 3rd turn of the longest task text is ~200 ids; nothing is cut.
PROMPT_WIDTH, RESPONSE_WIDTH = 512, 16
LONG_POLL_SECONDS = 30.0
JSON_HEADERS = {"Content-Type": "application/json"}
#: An agent's LLM call is abandoned after this long (the run must end even if the proxy misbehaved).
AGENT_CALL_TIMEOUT = 60.0
#: The daemon stops submitting new steps this long before the time budget ends, to let open steps finish.
DRAIN_RESERVE = 0.25
#: RSS is "flat" if, over the second half of the steps, the fitted slope is below this many MB per step and
#: the last quarter's mean is within this many MB of the second quarter's (see rss_verdict).
RSS_SLOPE_MAX_MB_PER_STEP = 0.25
RSS_QUARTER_DELTA_MAX_MB = 8.0


# ---------------------------------------------------------------------------------------------- the work
def calls_for(index: int) -> int:
    """How many chat calls sample ``index`` needs: 1, 2 or 3, uniform, fixed by a hash."""
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % 3


def sample(index: int) -> dict[str, Any]:
    return {"i": index, "k": calls_for(index), "text": f"Soak task {index}: answer yes or no."}


# ---------------------------------------------------------------------------------------------- mock
async def _run_mock(cfg: dict[str, Any]) -> None:
    from aglverl.testing import MockVLLM

    # A stream whose client left (an agent vanished mid-call, so the proxy dropped the upstream request) may
    # fail its next write before aiohttp cancels the handler; aiohttp logs that with a traceback. Count it.
    server_log = LogCounter()
    logging.getLogger("aiohttp.server").addHandler(server_log)
    logging.getLogger("aiohttp.server").propagate = False
    async with MockVLLM(
        model=MODEL,
        latency=cfg["latency"],
        latency_jitter=cfg["jitter"],
        failure_rate=cfg["failure_rate"],
        seed=cfg["seed"],
        completion_tokens=COMPLETION_TOKENS,
        record_requests=False,
    ) as mock:
        emit({"url": mock.url, "pid": os.getpid()})
        async for _ in stdin_commands():
            emit(
                {
                    "answered": mock.completed,
                    "failed_randomly": mock.failed_randomly,
                    "cancelled_by_client": mock.cancelled,
                    "active": mock.active,
                    "handler_errors_logged": server_log.count,
                    "handler_errors_first": server_log.first,
                }
            )


# ---------------------------------------------------------------------------------------------- daemon
def check_batch(data: Any, rollout_ids: Sequence[str], ks: Sequence[int], seen: set[str]) -> dict[str, int]:
    """Check one step's batch rows; ``ks[j]`` is the calls rollout ``rollout_ids[j]`` needs. Updates ``seen``."""
    from aglverl.testing import completion_token_ids

    n = len(data)
    rids = data.non_tensor_batch["rollout_id_list"].tolist() if n else []
    turns = [int(t) for t in data.non_tensor_batch["turn_index_list"].tolist()] if n else []
    pairs = Counter(zip(rids, turns, strict=True))
    expected = dict(zip(rollout_ids, ks, strict=True))
    rows_of: dict[str, list[int]] = {}
    for rid, turn in pairs:
        rows_of.setdefault(rid, []).append(turn)
    out = {
        "rows": n,
        "duplicate_rows": sum(c - 1 for c in pairs.values()),
        "foreign_rows": sum(1 for rid in rids if rid not in expected),
        "rollouts_in_earlier_batches": sum(1 for rid in rows_of if rid in seen),
        "rollouts_with_wrong_turns": sum(
            1 for rid, got in rows_of.items() if sorted(got) != list(range(expected.get(rid, -1)))
        ),
        "rows_with_wrong_ids": 0,
        "rollouts_in_batch": len(rows_of),
    }
    seen.update(rows_of)
    if n:
        prompts = data.batch["prompts"]
        prompt_mask = data.batch["attention_mask"][:, : prompts.shape[1]].bool()
        responses = data.batch["responses"]
        lengths = data.batch["response_mask"].sum(-1).tolist()
        for row in range(n):
            prompt = prompts[row][prompt_mask[row]].tolist()
            response = responses[row][: lengths[row]].tolist()
            if response != completion_token_ids(prompt, 0, COMPLETION_TOKENS):
                out["rows_with_wrong_ids"] += 1
    return out


def _internals(daemon: Any) -> dict[str, int]:
    """Sizes of the daemon's internal tables (private attributes, read for diagnosis only)."""
    store, proxy = daemon.store, daemon.proxy
    return {
        "store_entries": len(store._entries),
        "store_queue": len(store._queue),
        "store_waiters": len(store._waiters),
        "store_leases_heap": len(store._leases),
        "store_tombstones": len(store._tombstones),
        "proxy_sticky_rollouts": len(proxy._pool._sticky),
        "proxy_connections": proxy.connections,
        "proxy_in_flight": proxy.in_flight,
        "collector_open_steps": len(daemon.collector.steps),
    }


def _registry_figures(daemon: Any) -> dict[str, Any]:
    store, proxy = daemon.store, daemon.proxy
    outcomes = ("ok", "upstream_error", "failed", "cancelled", "rejected")
    return {
        "store_queued": store.meters.queued.value(),
        "store_claimed": store.meters.claimed.value(),
        "store_completed": store.meters.completed.value(),
        "store_failed": store.meters.failed.value(),
        "store_requeued": {r: store.meters.requeued.value(r) for r in ("lease_expired", "agent_failed")},
        "store_released_unused_claims": store.meters.released.value(),
        "store_results_ignored": {
            r: store.meters.ignored.value(r) for r in ("resent", "already_finished", "stale_failure")
        },
        "proxy_calls": {o: proxy.m_calls.value(o) for o in outcomes},
        "proxy_retries": proxy.m_retries.value(),
        "proxy_backend_ejections": proxy.m_ejections.value(),
        "proxy_calls_without_token_ids": proxy.m_no_ids.value(),
        "proxy_calls_unrecorded_rollout_ended": proxy.m_unrecorded.value(),
    }


async def _trainer(daemon: Any, cfg: dict[str, Any], log: LogCounter) -> None:
    """Keep ``inflight`` steps submitted, check and drop each batch, sample RSS; one line per step, then done."""
    n = cfg["n"]
    samples_per_step = cfg["rollouts_per_step"] // n
    steps_wanted = math.ceil(cfg["rollouts"] / (samples_per_step * n))
    started = time.monotonic()
    submit_until = started + cfg["submit_seconds"]
    open_steps: dict[int, tuple[Any, float, list[int]]] = {}
    next_sample = 0
    submitted = 0
    seen: set[str] = set()
    batch_ids: list[str] = []
    turnarounds: list[float] = []
    unexpected_batches = 0
    observe = daemon.collector._m_turnaround.observe

    def recording_observe(value: float) -> None:  # the collector's "last rollout terminal -> batch ready"
        turnarounds.append(value)
        observe(value)

    daemon.collector._m_turnaround.observe = recording_observe

    async def submit() -> None:
        nonlocal next_sample, submitted
        samples = [sample(next_sample + j) for j in range(samples_per_step)]
        next_sample += samples_per_step
        step = await daemon.submit(samples, n=n)
        ks = [s["k"] for s in samples for _ in range(n)]
        open_steps[step.number] = (step, time.monotonic(), ks)
        submitted += 1

    while submitted < min(cfg["inflight"], steps_wanted):
        await submit()
    emit({"kind": "started", "steps_wanted": steps_wanted})
    while open_steps:
        batch = await daemon.batches.receive()
        received = time.monotonic()
        if batch.step not in open_steps:  # a second batch for a step, or one nobody submitted
            unexpected_batches += 1
            continue
        step, submitted_at, ks = open_steps.pop(batch.step)
        checks = check_batch(batch.data, step.rollout_ids, ks, seen)
        batch_ids.extend(sorted(set(batch.data.non_tensor_batch["rollout_id_list"].tolist())))
        keep = ("step/n_", "batch/n_")
        metrics = {k: v for k, v in batch.metrics.items() if k.startswith(keep)}
        report_seconds = batch.report.seconds
        del batch  # the trainer is done with it: whatever the daemon still holds of this step is a leak
        if submitted < steps_wanted and time.monotonic() < submit_until:
            await submit()
        emit(
            {
                "kind": "step",
                "step": step.number,
                "queued": len(step.rollout_ids),
                "wall_s": received - submitted_at,
                "report_s": report_seconds,
                "collector_turnaround_s": turnarounds[-1] if turnarounds else None,
                "metrics": metrics,
                "checks": checks,
                "rss_kib": status_kib(os.getpid(), "VmRSS:"),
                "py_blocks": sys.getallocatedblocks(),
                "t": received - started,
            }
        )
    gc.collect()
    emit(
        {
            "kind": "done",
            "steps_wanted": steps_wanted,
            "steps_submitted": submitted,
            "stopped_by_time": submitted < steps_wanted,
            "unexpected_batches": unexpected_batches,
            "batch_rollout_ids": batch_ids,
            "collector_turnarounds_s": turnarounds,
            "registry": _registry_figures(daemon),
            "internals_after_run": _internals(daemon),
            "rss_kib_after_gc": status_kib(os.getpid(), "VmRSS:"),
            "peak_rss_bytes": peak_rss_bytes(os.getpid()),
            "cpu_s": proc_cpu_seconds(os.getpid()),
            "log_warnings": log.count,
            "log_first": log.first,
        }
    )


async def _run_daemon(cfg: dict[str, Any]) -> None:
    from aglverl import AgentDaemon, BatchConfig

    log = LogCounter()
    for name in ("", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).addHandler(log)
    logging.getLogger().setLevel(logging.WARNING)
    daemon = AgentDaemon(
        backends=[cfg["mock_url"]],
        model=MODEL,
        batch=BatchConfig(max_prompt_length=PROMPT_WIDTH, max_response_length=RESPONSE_WIDTH),
        lease_seconds=cfg["lease_seconds"],
        max_attempts=cfg["max_attempts"],
    )
    async with daemon, anyio.create_task_group() as tg:
        emit({"server_url": daemon.server_url, "proxy_url": daemon.proxy_url, "pid": os.getpid()})
        async for cmd in stdin_commands():
            if cmd["cmd"] == "run":
                tg.start_soon(_trainer, daemon, cfg, log)
            elif cmd["cmd"] == "diag":  # asked when the run overran: what is still open, and where
                emit({"kind": "diag", "internals": _internals(daemon), "registry": _registry_figures(daemon)})
        tg.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------- agents
class _CallFailed(Exception):
    pass


class _Vanish(Exception):
    pass


async def _run_agents(cfg: dict[str, Any]) -> None:
    """``cfg["agents"]`` agent loops; ``stats`` returns the counters (and the accepted rollout ids)."""
    from aglverl.client import AgentClient, TaskServerError
    from aglverl.models import Rollout

    rng = random.Random(cfg["seed"])
    stats: Counter[str] = Counter()
    accepted: list[str] = []
    first_errors: list[str] = []
    latencies: list[float] = []
    think, vanish_rate, stream_fraction = cfg["think"], cfg["vanish_rate"], cfg["stream_fraction"]
    straggle_rate, lease = cfg["straggle_rate"], cfg["lease_seconds"]
    llm_http = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        timeout=aiohttp.ClientTimeout(total=AGENT_CALL_TIMEOUT, sock_connect=10),
    )

    async def chat(base: str, model: str, messages: list[Any]) -> str:
        stream = rng.random() < stream_fraction
        body = {"model": model, "messages": messages, "max_tokens": COMPLETION_TOKENS, "stream": stream}
        started = time.monotonic()
        try:
            async with llm_http.post(
                f"{base}/chat/completions", data=orjson.dumps(body), headers=JSON_HEADERS
            ) as r:
                if r.status != 200:
                    raise _CallFailed(f"chat answered {r.status}: {(await r.read())[:200]!r}")
                if stream:
                    content = await read_sse_text(r, _CallFailed)
                else:
                    content = orjson.loads(await r.read())["choices"][0]["message"]["content"]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _CallFailed(f"chat call broke: {exc!r}") from exc
        latencies.append(time.monotonic() - started)
        stats["calls_ok_stream" if stream else "calls_ok_json"] += 1
        return content

    async def solve(task: Any, base: str, model: str) -> None:
        k = int(task.input["k"])
        # Where this attempt vanishes, if it does: before call j, during call j, or after the last call (j = k).
        vanish = None
        if rng.random() < vanish_rate:
            j = rng.randrange(k + 1)
            vanish = (j, "after_last_call" if j == k else rng.choice(("before_call", "mid_call")))
        messages: list[Any] = [{"role": "user", "content": task.input["text"]}]
        for j in range(k):
            await anyio.sleep(rng.uniform(0, think))
            if vanish is not None and vanish[0] == j:
                if vanish[1] == "mid_call":
                    with anyio.move_on_after(rng.uniform(0, 0.08)):
                        await chat(base, model, messages)
                raise _Vanish(vanish[1])
            content = await chat(base, model, messages)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
        if vanish is not None:
            raise _Vanish(vanish[1])
        if rng.random() < straggle_rate:
            stats["straggled"] += 1
            await anyio.sleep(rng.uniform(lease, 2 * lease))

    async def post(client: Any, rollout: Any) -> str | None:
        try:
            return await client.post_rollout(rollout)
        except TaskServerError as exc:
            stats[f"post_refused_{exc.status}"] += 1
            return None

    async def agent(client: Any) -> None:
        while True:
            task = await client.next_task(wait=LONG_POLL_SECONDS)
            if task is None:
                continue
            stats["attempts_taken"] += 1
            llm = await client.llm_for(task)
            try:
                await solve(task, llm.endpoint, llm.model)
            except _Vanish as where:
                stats[f"vanished_{where}"] += 1
                continue  # never posts; a fresh agent takes this one's place in the loop
            except _CallFailed as exc:
                stats["calls_failed"] += 1
                if len(first_errors) < 5:
                    first_errors.append(str(exc)[:300])
                failed = Rollout(
                    rollout_id=task.rollout_id,
                    attempt_id=task.attempt_id,
                    status="failed",
                    metadata={"error": str(exc)[:300]},
                )
                if await post(client, failed) is not None:
                    stats["failures_posted"] += 1
                continue
            done = Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
            message = await post(client, done)
            if message is not None and "received and stored" in message:
                stats["results_accepted"] += 1
                accepted.append(task.rollout_id)
            elif message is not None:
                stats["results_acknowledged_not_stored"] += 1

    try:
        async with (
            AgentClient(cfg["server_url"], connections=cfg["agents"] + 8) as client,
            anyio.create_task_group() as tg,
        ):
            for _ in range(cfg["agents"]):
                tg.start_soon(agent, client)
            emit({"pid": os.getpid()})
            async for _ in stdin_commands():
                emit(
                    {
                        "stats": dict(stats),
                        "accepted": accepted,
                        "first_errors": first_errors,
                        "call_latency": summary_ms(latencies),
                    }
                )
            tg.cancel_scope.cancel()
    finally:
        await llm_http.close()


def _child_main(role: str, cfg: dict[str, Any]) -> None:
    runners = {"mock": _run_mock, "daemon": _run_daemon, "agents": _run_agents}
    run_loop(runners[role], cfg)


# ---------------------------------------------------------------------------------------------- verdicts
def _second_half_slope(values: Sequence[float]) -> float:
    half = np.asarray(values[len(values) // 2 :], dtype=float)
    return float(np.polyfit(np.arange(len(half)), half, 1)[0])


def rss_verdict(rss_mb: Sequence[float], py_blocks: Sequence[int], rollouts_per_step: int) -> dict[str, Any]:
    """Does the daemon's RSS stay flat while steps complete?

    Only the second half of the steps is judged (the first half includes warm-up: imports finishing, pools
    and allocator arenas filling). Flat means both: the least-squares slope over the second half is below
    ``RSS_SLOPE_MAX_MB_PER_STEP``, and the mean of the last quarter is within ``RSS_QUARTER_DELTA_MAX_MB`` of
    the second quarter's. Keeping a finished step's data would cost far more than that per step (one step's
    rollouts, calls and batch tensors are several MB), so a retained step shows as a clear slope. The slope is
    also given per rollout, to compare with what the daemon keeps per finished rollout by design.

    RSS also moves when the allocator keeps freed memory (glibc arenas of worker threads, a raised mmap
    threshold after the batch tensors are freed): such steps up plateau. The live Python heap
    (``sys.getallocatedblocks()``, objects not yet freed) is sampled at the same points and its slope is
    reported next to RSS, to tell retention (both grow) from allocator high-water marks (only RSS moves).
    """
    n = len(rss_mb)
    if n < 8:
        return {"judged": False, "reason": f"only {n} steps; need >= 8"}
    slope = _second_half_slope(rss_mb)
    blocks_slope = _second_half_slope(py_blocks)
    q = n // 4
    second_q = float(np.mean(rss_mb[q : 2 * q]))
    last_q = float(np.mean(rss_mb[n - q :]))
    flat = slope < RSS_SLOPE_MAX_MB_PER_STEP and abs(last_q - second_q) < RSS_QUARTER_DELTA_MAX_MB
    return {
        "judged": True,
        "flat": flat,
        "second_half_slope_mb_per_step": round(slope, 4),
        "second_half_slope_bytes_per_rollout": round(slope * 2**20 / rollouts_per_step),
        "python_heap_blocks_first_last": [py_blocks[0], py_blocks[-1]],
        "python_heap_second_half_slope_blocks_per_rollout": round(blocks_slope / rollouts_per_step, 2),
        "second_quarter_mean_mb": round(second_q, 1),
        "last_quarter_mean_mb": round(last_q, 1),
        "last_minus_second_quarter_mb": round(last_q - second_q, 2),
        "thresholds": {
            "slope_mb_per_step_below": RSS_SLOPE_MAX_MB_PER_STEP,
            "quarter_delta_mb_within": RSS_QUARTER_DELTA_MAX_MB,
        },
    }


def summarize(
    args: argparse.Namespace,
    steps: list[dict[str, Any]],
    done: dict[str, Any] | None,
    agents: list[dict[str, Any]],
    mock: dict[str, Any],
    hang: dict[str, Any] | None,
    elapsed: float,
) -> dict[str, Any]:
    queued_per_step = args.rollouts_per_step // args.n * args.n
    submitted = done["steps_submitted"] if done else None
    m = [s["metrics"] for s in steps]
    queued = (submitted if submitted is not None else len(steps)) * queued_per_step
    if hang is not None:  # the daemon's own count is the truth for what was submitted
        queued = int(hang["registry"]["store_queued"])
    completed = sum(int(x["step/n_completed"]) for x in m)
    failed = sum(int(x["step/n_failed"]) for x in m)
    terminal_short = sum(
        max(0, int(x["step/n_queued"] - x["step/n_completed"] - x["step/n_failed"])) for x in m
    )
    terminal_excess = sum(
        max(0, int(x["step/n_completed"] + x["step/n_failed"] - x["step/n_queued"])) for x in m
    )
    finished_queued = sum(int(x["step/n_queued"]) for x in m)
    checks: Counter[str] = Counter()
    for s in steps:
        checks.update(s["checks"])
    batch_ids = done["batch_rollout_ids"] if done else []
    accepted = [rid for a in agents for rid in a["accepted"]]
    agent_stats: Counter[str] = Counter()
    for a in agents:
        agent_stats.update(a["stats"])
    internals = done["internals_after_run"] if done else None
    lost = (queued - finished_queued) + terminal_short + (internals["store_entries"] if internals else 0)
    duplicated = (
        (done["unexpected_batches"] if done else 0)
        + checks["duplicate_rows"]
        + checks["rollouts_in_earlier_batches"]
        + checks["foreign_rows"]
        + terminal_excess
    )
    rss_mb = [s["rss_kib"] / 1024 for s in steps]
    out: dict[str, Any] = {
        "benchmark": "soak",
        "config": {
            k: getattr(args, k)
            for k in (
                "rollouts",
                "rollouts_per_step",
                "n",
                "agents",
                "agent_procs",
                "inflight_steps",
                "failure_rate",
                "vanish_rate",
                "straggle_rate",
                "lease_seconds",
                "max_attempts",
                "latency_ms",
                "jitter_ms",
                "think_ms",
                "stream_fraction",
                "max_seconds",
                "seed",
            )
        },
        "elapsed_s": round(elapsed, 1),
        "overran_budget": hang,
        "steps": {
            "finished": len(steps),
            "submitted": submitted,
            "stopped_by_time": done and done["stopped_by_time"],
        },
        "queued": queued,
        "completed": completed,
        "failed": failed,
        "requeued": sum(int(x["step/n_requeued"]) for x in m),
        "timed_out": sum(int(x.get("step/n_timed_out", 0)) for x in m),
        "lost": lost,
        "duplicated": duplicated,
        "integrity": {
            "unexpected_batches": done["unexpected_batches"] if done else None,
            "steps_with_completed_plus_failed_ne_queued": sum(
                x["step/n_completed"] + x["step/n_failed"] != x["step/n_queued"] for x in m
            ),
            "rollouts_in_batches": len(batch_ids),
            "completed_rollouts_without_rows": completed - checks["rollouts_in_batch"],
            **{
                k: checks[k]
                for k in ("rows", "duplicate_rows", "foreign_rows", "rollouts_in_earlier_batches")
            },
            "rollouts_with_wrong_turn_count": checks["rollouts_with_wrong_turns"],
            "rows_with_wrong_token_ids": checks["rows_with_wrong_ids"],
            "batch_rollouts_no_agent_stored": len(set(batch_ids) - set(accepted)),
            "agent_stored_rollouts_not_in_batches": len(set(accepted) - set(batch_ids)),
            "agent_stored_twice": len(accepted) - len(set(accepted)),
            "daemon_internals_after_run": internals,
        },
        "step_turnaround_ms": {
            "submit_to_batch": summary_ms([s["wall_s"] for s in steps]),
            "last_rollout_to_batch_ready": summary_ms(done["collector_turnarounds_s"] if done else []),
        },
        "rollouts_per_s": round(finished_queued / steps[-1]["t"], 1) if steps else None,
        "daemon_rss": {
            "peak_mb_vmhwm": round(done["peak_rss_bytes"] / 2**20, 1) if done else None,
            "first_step_mb": round(rss_mb[0], 1) if rss_mb else None,
            "last_step_mb": round(rss_mb[-1], 1) if rss_mb else None,
            "after_gc_mb": round(done["rss_kib_after_gc"] / 1024, 1) if done else None,
            "per_step_mb": [round(x, 1) for x in rss_mb],
            **rss_verdict(rss_mb, [s["py_blocks"] for s in steps], queued_per_step),
        },
        "lease_expiries_beyond_abandoned_attempts": (
            int(done["registry"]["store_requeued"]["lease_expired"])
            - sum(v for k, v in agent_stats.items() if k.startswith("vanished_") or k == "straggled")
            if done
            else None
        ),
        "daemon_counters": done["registry"] if done else (hang or {}).get("registry"),
        "daemon_log_warnings": done["log_warnings"] if done else None,
        "daemon_log_first": done["log_first"] if done else None,
        "agents": {
            **dict(sorted(agent_stats.items())),
            "first_errors": [e for a in agents for e in a["first_errors"]][:5],
            "call_latency_ms": [a["call_latency"] for a in agents],
        },
        "mock": mock,
        "machine": machine_info(),
    }
    out["ok"] = bool(
        hang is None
        and lost == 0
        and duplicated == 0
        and out["integrity"]["rows_with_wrong_token_ids"] == 0
        and out["integrity"]["rollouts_with_wrong_turn_count"] == 0
        and out["integrity"]["batch_rollouts_no_agent_stored"] == 0
        and out["integrity"]["agent_stored_rollouts_not_in_batches"] == 0
        and out["daemon_rss"].get("flat", False)
    )
    return out


# ---------------------------------------------------------------------------------------------- orchestration
def _progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    budget = args.max_seconds
    children: list[JsonChild] = []
    steps: list[dict[str, Any]] = []
    done: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None
    try:
        mock = await JsonChild.start(
            child_args(
                __file__,
                "mock",
                {
                    "latency": args.latency_ms / 1e3,
                    "jitter": args.jitter_ms / 1e3,
                    "failure_rate": args.failure_rate,
                    "seed": args.seed,
                },
            )
        )
        children.append(mock)
        submit_seconds = budget * (1 - DRAIN_RESERVE) - (time.monotonic() - started)
        daemon = await JsonChild.start(
            child_args(
                __file__,
                "daemon",
                {
                    "mock_url": mock.info["url"],
                    "lease_seconds": args.lease_seconds,
                    "max_attempts": args.max_attempts,
                    "rollouts": args.rollouts,
                    "rollouts_per_step": args.rollouts_per_step,
                    "n": args.n,
                    "inflight": args.inflight_steps,
                    "submit_seconds": submit_seconds,
                },
            )
        )
        children.append(daemon)
        agents: list[JsonChild] = []
        for p in range(args.agent_procs):
            share = args.agents // args.agent_procs + (p < args.agents % args.agent_procs)
            cfg = {
                "server_url": daemon.info["server_url"],
                "agents": share,
                "seed": args.seed * 1000 + p + 1,
                "think": args.think_ms / 1e3,
                "vanish_rate": args.vanish_rate,
                "stream_fraction": args.stream_fraction,
                "straggle_rate": args.straggle_rate,
                "lease_seconds": args.lease_seconds,
            }
            agents.append(await JsonChild.start(child_args(__file__, "agents", cfg)))
            children.append(agents[-1])
        _progress(f"children up after {time.monotonic() - started:.1f}s; running")
        pids = {"daemon": daemon.pid, "mock": mock.pid} | {f"agents{i}": a.pid for i, a in enumerate(agents)}
        pids["orchestrator"] = os.getpid()
        cpu0 = {name: proc_cpu_seconds(pid) for name, pid in pids.items()} | {
            "_machine": system_busy_seconds()
        }
        await daemon.send({"cmd": "run"})
        try:
            with anyio.fail_after(max(1.0, budget - (time.monotonic() - started))):
                while True:
                    line = await daemon.read()
                    if line["kind"] == "step":
                        steps.append(line)
                        if len(steps) % 5 == 0:
                            s = line["metrics"]
                            _progress(
                                f"step {line['step']}: {len(steps)} done, t={line['t']:.0f}s, "
                                f"wall={line['wall_s']:.2f}s, requeued={s['step/n_requeued']:.0f}, "
                                f"rss={line['rss_kib'] / 1024:.0f}MB"
                            )
                    elif line["kind"] == "done":
                        done = line
                        break
        except TimeoutError:
            _progress("time budget exhausted with steps still open: asking the daemon what is left")
            with anyio.fail_after(30):
                await daemon.send({"cmd": "diag"})
                while (line := await daemon.read())["kind"] != "diag":
                    if line["kind"] == "step":
                        steps.append(line)
            hang = {"finished_steps": len(steps), **line}
        elapsed = time.monotonic() - started
        cpu = {name: proc_cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
        cpu["other_programs"] = system_busy_seconds() - cpu0["_machine"] - sum(cpu.values())
        cpu = {name: round(v, 1) for name, v in cpu.items()}
        agent_reports = [await a.request({"cmd": "stats"}) for a in agents]
        mock_report = await mock.request({"cmd": "stats"})
    finally:
        for child in reversed(children):
            await child.stop()
    result = summarize(args, steps, done, agent_reports, mock_report, hang, elapsed)
    result["cpu_s_during_run"] = cpu
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child_main(sys.argv[2], json.loads(sys.argv[3]))
        return
    if "--training" in sys.argv[1:]:
        import _training_soak

        t = argparse.ArgumentParser(description=_training_soak.__doc__.split("\n\n")[0])
        t.add_argument("--training", action="store_true", help="run the training soak (this one)")
        t.add_argument("--max-seconds", type=float, default=6 * 3600.0, help="bound on the whole run")
        t.add_argument("--seed", type=int, default=0)
        _training_soak.add_arguments(t)
        targs = t.parse_args()
        _training_soak.prepare(targs)
        print(json.dumps(run_loop(_training_soak.training_soak, targs), indent=1))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rollouts", type=int, default=10_000, help="rollouts to queue in all (rounded up to steps)"
    )
    p.add_argument("--rollouts-per-step", type=int, default=256)
    p.add_argument("--n", type=int, default=4, help="GRPO group size: rollouts per sample")
    p.add_argument("--agents", type=int, default=300)
    p.add_argument("--agent-procs", type=int, default=2)
    p.add_argument("--inflight-steps", type=int, default=2, help="steps the trainer keeps submitted")
    p.add_argument("--failure-rate", type=float, default=0.05, help="fraction of backend calls answered 500")
    p.add_argument(
        "--vanish-rate", type=float, default=0.05, help="fraction of attempts whose agent vanishes"
    )
    p.add_argument(
        "--straggle-rate", type=float, default=0.02, help="fraction of attempts posted 1-2 leases late"
    )
    p.add_argument("--lease-seconds", type=float, default=2.0)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--latency-ms", type=float, default=10.0, help="backend latency floor")
    p.add_argument("--jitter-ms", type=float, default=90.0, help="backend latency: + U(0, jitter)")
    p.add_argument("--think-ms", type=float, default=30.0, help="agent: U(0, think) before each call")
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--max-seconds", type=float, default=600.0, help="bound on the whole run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="128 rollouts in steps of 32, 16 agents (a smoke run)"
    )
    args = p.parse_args()
    if args.quick:
        args.rollouts, args.rollouts_per_step, args.agents, args.agent_procs = 128, 32, 16, 1
        args.max_seconds, args.latency_ms, args.jitter_ms, args.think_ms = 60.0, 2.0, 8.0, 3.0
    result = run_loop(soak, args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
