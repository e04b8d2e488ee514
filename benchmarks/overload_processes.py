"""The processes ``proxy_overload.py`` drives, each started as a child of it (``--child ROLE CFG``):

- ``proxy``: one :class:`~aglverl.proxy.LLMProxy` (``request_logprobs``, token-in off, the benchmark's token),
  every call captured and recorded into :class:`Records` (a store view that drops them: the proxy's memory is
  what its calls in flight hold), its :class:`~aglverl.proxy.OverloadPolicy` as the driver says; it answers the
  driver's commands on stdin (a block's start and end figures, the lag probe's cost, refuse all);
- ``backend``: :class:`StaticBackend`, an HTTP/1.1 server that answers every call with the same recorded chat
  completion, so that the load saturates the proxy, not the backend.

Each pins itself to the core the driver names (``cfg["core"]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from typing import Any

import aiohttp
import anyio
from _common import emit, run_loop, stdin_commands
from proxy_capacity import BODY

__all__ = ["child_main"]


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
    proxy = LLMProxy(
        records, backends=[cfg["backend"]], request_logprobs=True, token_in=False, token=cfg.get("token")
    )
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


def child_main(role: str, cfg: dict[str, Any]) -> None:
    """Run ``role`` (``proxy`` or ``backend``) with ``cfg`` (what the driver sent), pinned to ``cfg["core"]``."""
    if cfg.get("path"):  # another version's aglverl, found before this tree's
        sys.path.insert(0, cfg["path"])
    if cfg.get("core") is not None:
        os.sched_setaffinity(0, {cfg["core"]})
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
