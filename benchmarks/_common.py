"""Helpers shared by the benchmarks: percentiles, per-process CPU and memory from ``/proc``, JSON-line children.

Processes talk over pipes, one JSON object per line: a child writes its description (URLs, pid) as its first
stdout line, then answers each command read from stdin with one line; a child exits when its stdin closes.
Nothing here sleeps to wait for a child: every wait is a read of its next line (bound it with
``anyio.fail_after``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from subprocess import PIPE
from typing import Any, TypeVar

import aiohttp
import anyio
import anyio.abc
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream

__all__ = [
    "LOOP_ENV",
    "TREE_ENV",
    "JsonChild",
    "emit",
    "loop_name",
    "machine_info",
    "peak_rss_bytes",
    "percentile",
    "proc_cpu_seconds",
    "run_loop",
    "stdin_commands",
    "summary_ms",
    "system_busy_seconds",
]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: The event loop the benchmarks' processes run on: as ``aglverl``'s commands choose it (``auto``: uvloop where
#: installed; ``asyncio``). Decided here, not by importing aglverl: a child that measures another tree of aglverl
#: (``--against DIR``) must import that tree's package, first.
LOOP_ENV = "AGLVERL_LOOP"
T = TypeVar("T")
#: Set in a child that measures another tree of aglverl (``--against DIR``, first on its ``PYTHONPATH``): its
#: ``aglverl`` is then that tree's alone. An editable install of this tree (a finder on ``sys.meta_path``) would
#: otherwise fill in the modules the other tree lacks with this tree's (an older tree measured as a mix of
#: both): its finders are dropped when this module is imported, before aglverl is.
TREE_ENV = "AGLVERL_BENCH_TREE"
if os.environ.get(TREE_ENV):
    sys.meta_path[:] = [
        f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
    ]


def loop_name(choice: str | None = None) -> str:
    """``uvloop`` or ``asyncio``: ``choice``, else ``$AGLVERL_LOOP``, else uvloop where it is installed."""
    choice = choice or os.environ.get(LOOP_ENV) or "auto"
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{LOOP_ENV} / --loop must be auto, uvloop or asyncio, got {choice!r}")
    if choice == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return choice


def run_loop(func: Callable[..., Awaitable[T]], *args: Any, loop: str | None = None) -> T:
    """``anyio.run(func, *args)`` on the loop :func:`loop_name` picks."""
    options = {"use_uvloop": True} if loop_name(loop) == "uvloop" else {}
    return anyio.run(func, *args, backend_options=options)


#: Longest JSON line a child may write.
MAX_LINE = 64 << 20
#: How long a child gets to exit after its stdin closed, before it is terminated (then killed).
STOP_GRACE = 20.0


# ---------------------------------------------------------------------------------------------- numbers
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary_ms(seconds: Sequence[float]) -> dict[str, float | int]:
    """p50 / p99 / max in milliseconds (3 decimals) and the sample count."""
    if not seconds:
        return {"n": 0}
    return {
        "p50": round(percentile(seconds, 50) * 1e3, 3),
        "p99": round(percentile(seconds, 99) * 1e3, 3),
        "max": round(max(seconds) * 1e3, 3),
        "n": len(seconds),
    }


# ---------------------------------------------------------------------------------------------- /proc
def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads included (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def status_kib(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (``VmRSS:``, ``VmHWM:``, ...)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(f"{key} not in /proc/{pid}/status")


def peak_rss_bytes(pid: int) -> int:
    """Peak resident set size of a process (``VmHWM``)."""
    return status_kib(pid, "VmHWM:") * 1024


def system_busy_seconds() -> float:
    """CPU seconds all CPUs spent doing anything but idling/waiting for I/O since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU count and model, Python, load average when asked."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/loadavg") as f:
        load = [float(x) for x in f.read().split()[:3]]
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "loadavg_1_5_15": load,
    }


# ---------------------------------------------------------------------------------------------- children
class JsonChild:
    """A child process speaking JSON lines: ``info`` is its first line; :meth:`request` sends one and reads one.

    Its stderr is inherited, so its warnings and tracebacks reach the terminal. :meth:`stop` closes its stdin
    (the child's signal to leave cleanly) and waits; a child that does not leave is terminated, then killed.
    """

    def __init__(self, process: anyio.abc.Process, info: dict[str, Any]) -> None:
        self.process = process
        self.info = info
        assert process.stdout is not None
        self._lines = BufferedByteReceiveStream(process.stdout)

    @classmethod
    async def start(
        cls, args: Sequence[str], *, ready_within: float = 120.0, env: Mapping[str, str] | None = None
    ) -> JsonChild:
        """Spawn ``python args...`` (in ``env``, default this process's) and wait (up to ``ready_within`` s) for
        its first JSON line."""
        process = await anyio.open_process(
            [sys.executable, *args], stdin=PIPE, stdout=PIPE, stderr=None, env=env
        )
        child = cls(process, {})
        try:
            with anyio.fail_after(ready_within):
                child.info = await child.read()
        except BaseException:
            await child.kill()
            raise
        return child

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid)

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes(self.pid)

    async def read(self) -> dict[str, Any]:
        """The child's next JSON line; ``RuntimeError`` if it exited instead."""
        try:
            line = await self._lines.receive_until(b"\n", MAX_LINE)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            raise RuntimeError(
                f"benchmark child {self.pid} exited (code {self.process.returncode})"
            ) from None
        return orjson.loads(line)

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(orjson.dumps(message) + b"\n")

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        await self.send(message)
        return await self.read()

    async def stop(self) -> None:
        """Close stdin, wait up to ``STOP_GRACE`` s for the child to leave, else terminate/kill it."""
        with anyio.CancelScope(shield=True):
            if self.process.stdin is not None:
                await self.process.stdin.aclose()
            with anyio.move_on_after(STOP_GRACE):
                await self.process.wait()
                return
            await self.kill()

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.terminate()
                with anyio.move_on_after(5):
                    await self.process.wait()
                    return
                self.process.kill()
                await self.process.wait()


async def run_queued(
    daemon: Any, tasks: Sequence[Any], deadline: float
) -> tuple[float, list[Any], list[float]]:
    """Queue ``tasks`` on an :class:`~aglverl.AgentDaemon` and wait until every rollout has ended: the seconds
    from the first queued to the last ended, the rollouts' records, and for each rollout that made a call the
    seconds from its queueing to its first call."""
    started = time.perf_counter()
    ids = [await daemon.queue_task(task) for task in tasks]
    with anyio.fail_after(deadline):
        await daemon.store.wait_terminal(ids)
    wall = time.perf_counter() - started
    records = [daemon.store.record(r) for r in ids]
    firsts = [
        min(c.started_at for c in r.calls) - daemon.store.task(r.rollout_id).create_time
        for r in records
        if r.calls
    ]
    return wall, records, firsts


def emit(obj: Any) -> None:
    """Write one JSON line to stdout (the child side of :class:`JsonChild`)."""
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.buffer.flush()


async def stdin_commands() -> AsyncIterator[dict[str, Any]]:
    """The JSON commands a child reads from stdin, until stdin closes (read on the loop, no thread)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            yield orjson.loads(line)
    finally:
        transport.close()


async def read_sse_text(resp: aiohttp.ClientResponse, error: type[Exception] = RuntimeError) -> str:
    """The assistant text of a streamed chat completion, parsed event by event as chunks arrive.

    Raises ``error`` on an OpenAI-shaped error event (how the proxy ends a broken stream) or when the stream
    ends without ``data: [DONE]``.
    """
    parts: list[str] = []
    pending = b""
    async for chunk in resp.content.iter_any():
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                return "".join(parts)
            obj = orjson.loads(payload)
            if obj.get("error"):
                raise error(f"stream error event: {str(obj['error'])[:200]}")
            choices = obj.get("choices") or []
            if choices:
                parts.append(choices[0].get("delta", {}).get("content") or "")
    raise error("stream ended without [DONE]")


def child_args(script: str, role: str, cfg: dict[str, Any]) -> list[str]:
    """The command line that runs ``script`` as a benchmark child in ``role`` with ``cfg``."""
    return [os.path.abspath(script), "--child", role, json.dumps(cfg)]


class LogCounter(logging.Handler):
    """Counts WARNING+ records and keeps the first few, so a run reports what the daemon complained about."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 5:
            self.first.append(f"{record.name}: {record.getMessage()[:300]}")
