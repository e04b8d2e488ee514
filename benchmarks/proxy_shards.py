"""The LLM proxy as one process vs as shards on Ray: capacity at added latency p99 <= 5 ms, and what shards cost.

Run: ``python benchmarks/proxy_shards.py [--shards 1,2] [--quick] [--max-seconds S]``. Prints ONE JSON object on
stdout, one entry per shard count, measured in the same run one after the other.

For each shard count, three kinds of processes on loopback:

- the backend: a :class:`~aglverl.testing.MockVLLM` in a child process (256 tokens per answer with ids and,
  when asked, log-probs; streams one token per event, 4 ms apart), shared by every shard count;
- the daemon: ``AgentDaemon(proxy_shards=N)`` in a child process, with ``request_logprobs`` (every call recorded
  with its ids and log-probs, as a trainer's are). ``N = 1``: the proxy in the daemon's process, no Ray.
  ``N > 1``: a Ray started in that child (loopback only) and N shard actors, each its own process;
- this process: the agents' side. It claims rollouts through the task server (``GET /task``, which with shards
  returns once the attempt's shard admits it), fetches each task's resources (its shard's ``main_llm``) and
  loads the proxy the way ``benchmarks/proxy_capacity.py`` does (its ``sweep``: open-loop levels, each run
  straight to the mock and through the proxy at the same time; added latency = the difference of their p99),
  calls spread over every claimed attempt, so over every shard.

Per shard count: ``json`` (calls/s) and ``stream`` (events/s) at added p99 <= 5 ms, the proxy's CPU per call and
per event (summed over the shard processes), and the costs only shards have: the start of the proxy (the
daemon's ``__aenter__``: the shard actors started in parallel), the claim (``GET /task`` with the admission's
round trip), the turnaround of ``POST /rollout`` for a rollout of two recorded calls (the take of its records
from its shard), the gate (``pause_calls`` + ``resume_calls`` with nothing in flight), and the driver's own
round-trip histograms (table pushes, takes, gate broadcasts) scraped from ``/metrics``.
Every figure is of the machine it ran on (``machine.loadavg_1_5_15``); the CPU per unit carries to another.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import orjson
import proxy_capacity
from _common import (
    JsonChild,
    child_args,
    emit,
    machine_info,
    peak_rss_bytes,
    run_loop,
    stdin_commands,
    summary_ms,
)
from proxy import call as _json_call  # benchmarks/proxy.py: one JSON call, its latency
from proxy_capacity import BODY, CHUNK_LATENCY, JSON_RATES, STREAM_RATES, sweep

ROLLOUTS = 128
#: Rollouts posted for the turnaround figure, each after ``TURNAROUND_CALLS`` recorded calls.
TURNAROUND_ROLLOUTS = 64
TURNAROUND_CALLS = 2
GATE_ROUNDS = 20


# ---------------------------------------------------------------------------------------------- children
async def _run_daemon(cfg: dict[str, Any]) -> None:
    from aglverl import AgentDaemon
    from aglverl.proxy.shards import ProxyShards
    from aglverl.trajectory.signals import SignalConfig

    shards = int(cfg["shards"])
    if shards > 1:
        import ray

        from aglverl.verl_plugin.patches import loopback_only_ray

        loopback_only_ray()
        # a Ray of this child's own (never a cluster another program started on this machine)
        await anyio.to_thread.run_sync(
            lambda: ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        )
    try:
        started = time.monotonic()
        async with AgentDaemon(
            backends=[cfg["backend"]],
            model="mock",
            proxy_shards=shards,
            signal=SignalConfig(request_logprobs=True),
            lease_seconds=3600,
        ) as daemon:
            start_seconds = time.monotonic() - started
            for i in range(cfg["rollouts"]):
                await daemon.queue_task({"i": i})
            proxy = daemon.proxy
            pids = (
                [await s.actor.pid.remote() for s in proxy.shards]
                if isinstance(proxy, ProxyShards)
                else [os.getpid()]
            )
            emit(
                {
                    "server_url": daemon.server_url,
                    "proxy_pids": pids,
                    "pid": os.getpid(),
                    "start_seconds": start_seconds,
                }
            )
            async for cmd in stdin_commands():
                if cmd.get("queue"):
                    for i in range(cmd["queue"]):
                        await daemon.queue_task({"extra": i})
                    emit({"queued": cmd["queue"]})
                elif cmd.get("gate"):
                    rounds = []
                    for _ in range(cmd["gate"]):
                        t0 = time.perf_counter()
                        await daemon.pause_calls()
                        await daemon.resume_calls()
                        rounds.append(time.perf_counter() - t0)
                    emit({"pause_resume_ms": summary_ms(rounds)})
                else:
                    emit({"error": f"unknown command {cmd!r}"})
    finally:
        if shards > 1:
            import ray

            await anyio.to_thread.run_sync(ray.shutdown)


def _child_main(role: str, cfg: dict[str, Any]) -> None:
    assert role == "daemon", role
    run_loop(_run_daemon, cfg)


# ---------------------------------------------------------------------------------------------- the agents' side
@dataclass(frozen=True)
class _Process:
    """A proxy process as ``sweep`` reads its CPU (by ``pid``): the daemon's (one shard) or a shard actor's."""

    pid: int


async def _claim(agent: Any, count: int) -> tuple[list[str], list[Any], list[float]]:
    """``count`` claimed attempts: their base URLs (each task's own resources), tasks, and claim latencies."""
    bases, tasks, latencies = [], [], []
    for _ in range(count):
        t0 = time.perf_counter()
        task = await agent.next_task(wait=10)
        latencies.append(time.perf_counter() - t0)
        assert task is not None and task.attempt_id is not None
        llm = (await agent.resources(task.resources_id)).resources["main_llm"]
        bases.append(llm.get_base_url(task.rollout_id, task.attempt_id))
        tasks.append(task)
    return bases, tasks, latencies


def _histogram_means(text: str) -> dict[str, Any]:
    """Mean (ms) and count of the driver's ``aglverl_proxy_shard_*_seconds`` histograms in a /metrics text."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("aglverl_proxy_shard_") and name.endswith("_seconds_sum"):
            sums[name.removesuffix("_sum")] = float(value)
        elif name.startswith("aglverl_proxy_shard_") and name.endswith("_seconds_count"):
            counts[name.removesuffix("_count")] = float(value)
    return {
        name.removeprefix("aglverl_proxy_shard_"): {"mean_ms": round(1e3 * sums[name] / n, 3), "n": int(n)}
        for name, n in counts.items()
        if n
    }


async def measure_one(
    shards: int, mock_url: str, quick: bool, seconds: float, deadline: float
) -> dict[str, Any]:
    from aglverl.client import AgentClient
    from aglverl.models import Rollout

    daemon = await JsonChild.start(
        child_args(__file__, "daemon", {"backend": mock_url, "shards": shards, "rollouts": ROLLOUTS}),
        ready_within=180,
    )
    try:
        processes = [_Process(pid) for pid in daemon.info["proxy_pids"]]
        direct_url = f"{mock_url}/v1/chat/completions"
        connector = aiohttp.TCPConnector(limit=0)
        async with (
            AgentClient(daemon.info["server_url"]) as agent,
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session,
        ):
            bases, _, claims = await _claim(agent, ROLLOUTS)
            proxied_urls = [f"{b}/chat/completions" for b in bases]
            for url in proxied_urls[:32]:  # warm-up: every shard's connections
                await _json_call(session, url, orjson.dumps(BODY))
            json_rates = JSON_RATES[::2] if quick else JSON_RATES
            stream_rates = STREAM_RATES[::2] if quick else STREAM_RATES
            half = time.monotonic() + (deadline - time.monotonic()) / 2
            results: dict[str, Any] = {"shards": shards, "proxy_processes": len(processes)}
            results["json"] = await sweep(
                "json", json_rates, seconds, direct_url, proxied_urls, processes, session, half
            )
            results["stream"] = await sweep(
                "stream", stream_rates, seconds, direct_url, proxied_urls, processes, session, deadline
            )
            # what only shards cost: the claim's admission, the take on the turnaround, the gate
            await daemon.request({"queue": TURNAROUND_ROLLOUTS})
            bases, tasks, _ = await _claim(agent, TURNAROUND_ROLLOUTS)
            body = orjson.dumps(BODY)
            for base in bases:
                for _ in range(TURNAROUND_CALLS):
                    await _json_call(session, f"{base}/chat/completions", body)
            posts = []
            for task in tasks:
                t0 = time.perf_counter()
                await agent.post_rollout(
                    Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
                )
                posts.append(time.perf_counter() - t0)
            gate = await daemon.request({"gate": GATE_ROUNDS})
            async with session.get(f"{daemon.info['server_url']}/metrics") as response:
                metrics = await response.text()
        results["costs"] = {
            "proxy_start_seconds": round(daemon.info["start_seconds"], 3),
            "claim_ms": summary_ms(claims),
            f"post_rollout_ms_with_{TURNAROUND_CALLS}_recorded_calls": summary_ms(posts),
            "pause_resume_ms_nothing_in_flight": gate["pause_resume_ms"],
            "driver_round_trips": _histogram_means(metrics),
        }
        results["peak_rss_mib_per_proxy_process"] = [
            round(peak_rss_bytes(p.pid) / 2**20, 1) for p in processes
        ]
    finally:
        await daemon.stop()
    return results


async def measure(counts: list[int], quick: bool, max_seconds: float) -> dict[str, Any]:
    seconds = 2.0 if quick else 4.0
    # the backend: proxy_capacity.py's own mock child (the same answers as its sweeps get)
    mock = await JsonChild.start(
        child_args(proxy_capacity.__file__, "mock", {"chunk_latency": CHUNK_LATENCY})
    )
    try:
        runs = {}
        started = time.monotonic()
        for i, shards in enumerate(counts):
            left = max_seconds - (time.monotonic() - started)
            deadline = time.monotonic() + left / (len(counts) - i)
            runs[str(shards)] = await measure_one(shards, mock.info["url"], quick, seconds, deadline)
    finally:
        await mock.stop()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2", help="shard counts to measure, in this order (e.g. 1,2)")
    parser.add_argument("--quick", action="store_true", help="shorter levels, every other rate (a smoke run)")
    parser.add_argument("--max-seconds", type=float, default=480.0, help="bound on all the sweeps' time")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child_main(args.child[0], orjson.loads(args.child[1]))
        return
    counts = [int(n) for n in args.shards.split(",")]
    if not counts or min(counts) < 1:
        parser.error(f"--shards must list shard counts >= 1, got {args.shards!r}")
    started = time.monotonic()
    machine_before = machine_info()
    runs = run_loop(measure, counts, args.quick, args.max_seconds)
    out = {
        "benchmark": "the LLM proxy as N shards (AgentDaemon(proxy_shards=N)): added p99 <= 5 ms capacity and costs",
        "runs": runs,
        "machine": {**machine_before, "loadavg_after": machine_info()["loadavg_1_5_15"]},
        "seconds": round(time.monotonic() - started, 1),
    }
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")


if __name__ == "__main__":
    main()
