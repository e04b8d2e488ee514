"""Multi-turn agents on wrk, a compiled HTTP load generator (Debian's ``wrk`` package: ``make bench-tools``), for
``proxy_overload.py``: a Python load generator takes a core to offer a few thousand calls a second, a proxy's
capacity, so it cannot offer four times that from the one core it shares with the backend; wrk can.

:func:`run` starts ``wrk`` with ``overload_agents.lua`` (beside this file): one wrk thread per agent, each on one
keep-alive connection, talking in conversations of ``turns`` calls on one rollout attempt's path (its history
re-sent as text), ``think`` seconds (U(0.5, 1.5) times) between calls, a 429 waited out (``retry-after-ms``) and
the same call sent again, as the SDKs do. It returns what the calls got (:class:`WrkRun`). :func:`wrk_path` is
where wrk is (``None``: not installed).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import anyio
import orjson

__all__ = ["INSTALL", "SCRIPT", "WrkRun", "run", "wrk_path"]

#: The Lua script that makes wrk's threads multi-turn agents.
SCRIPT = Path(__file__).with_name("overload_agents.lua")
#: How to get wrk, for the message of a run that needs it.
INSTALL = "`make bench-tools` installs it (Debian's wrk: apt-get install wrk)"
#: Most agents (wrk threads, one connection each) a run starts.
MAX_AGENTS = 4000


def wrk_path() -> str | None:
    """Where ``wrk`` is, or ``None`` when it is not installed."""
    return shutil.which("wrk")


@dataclasses.dataclass
class WrkRun:
    """What one wrk run's calls got: latencies (seconds) of the calls answered 200 and 429, the 429s to later
    turns, failures by kind (``status N``, ``lost`` for a connection that broke under a call, wrk's socket
    errors), the calls still unanswered when the run stopped (not failures: cut by the run's end), the run's
    duration (seconds, wrk's own) and wrk's CPU time (seconds)."""

    ok: list[float]
    shed: list[float]
    later_turns_shed: int
    failed: Counter[str]
    unfinished: int
    conversations: int
    finished_conversations: int
    duration: float
    agents: int
    cpu_seconds: float = 0.0


def _bodies_file(directory: str, bodies: list[bytes]) -> str:
    path = os.path.join(directory, "bodies.jsonl")
    with open(path, "wb") as f:
        for body in bodies:
            if b"\n" in body:
                raise ValueError("a turn's body must be one line of JSON")
            f.write(body + b"\n")
    return path


def _parse(raw: bytes, agents: int) -> WrkRun:
    report = orjson.loads(raw)
    ok: list[float] = []
    shed: list[float] = []
    failed: Counter[str] = Counter()
    later = unfinished = conversations = finished = 0
    for agent in report["agents"]:
        ok.extend(ms / 1e3 for ms in agent["ok_ms"])
        shed.extend(ms / 1e3 for ms in agent["shed_ms"])
        later += agent["later_turns_shed"]
        unfinished += bool(agent["unfinished"])
        conversations += agent["conversations"]
        finished += agent["finished"]
        failed.update({f"status {status}": n for status, n in agent["failed_statuses"].items()})
        if agent["lost"]:
            failed["lost"] += agent["lost"]
    for kind, n in report["socket_errors"].items():
        if n:
            failed[f"socket {kind}"] += n
    return WrkRun(
        ok, shed, later, failed, unfinished, conversations, finished, report["duration_us"] / 1e6, agents
    )


async def run(
    url: str,
    *,
    agents: int,
    seconds: float,
    think: float,
    bodies: list[bytes],
    prefix: str,
    token: str | None = None,
) -> WrkRun:
    """``agents`` multi-turn agents (``len(bodies)`` turns, ``bodies[k]`` turn k's) against the proxy at ``url``
    for ``seconds``; rollout ids start with ``prefix`` (new for every run: a proxy remembers the attempts under
    way). Raises ``RuntimeError`` when wrk is not installed or fails (its output in the message). Cancelled, wrk
    is killed."""
    wrk = wrk_path()
    if wrk is None:
        raise RuntimeError(f"wrk is not installed: {INSTALL}")
    agents = max(1, min(agents, MAX_AGENTS))
    with tempfile.TemporaryDirectory(prefix="aglverl-wrk-") as directory:
        out = os.path.join(directory, "agents.json")
        env = {**os.environ, "AGL_BENCH_OUT": out, "AGL_BENCH_TOKEN": token or ""}
        command = [
            wrk,
            *("-t", str(agents), "-c", str(agents), "-d", f"{seconds:g}s", "--timeout", "60s"),
            *("-s", str(SCRIPT), url.rstrip("/") + "/", "--"),
            *(str(len(bodies)), f"{think * 1e3:g}", prefix, _bodies_file(directory, bodies)),
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = await anyio.run_process(command, env=env, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        report = anyio.Path(out)
        if done.returncode != 0 or not await report.exists():
            output = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
            raise RuntimeError(f"wrk failed (exit {done.returncode}): {output}")
        result = _parse(await report.read_bytes(), agents)
        result.cpu_seconds = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return result
