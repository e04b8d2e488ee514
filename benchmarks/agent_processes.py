"""Agents as processes: aglverl's built-in runner next to Agent Lightning's own controller, in one run.

    .venv/bin/python benchmarks/agent_processes.py                        # needs .venv-agl (make venv-agl)
    .venv/bin/python benchmarks/agent_processes.py --rollouts 32 --concurrency 8 --against /tmp/old019 \\
        --systems this_child against --agents sdk stdlib shell --repeat 5      # two trees, each in a child

For each system it queues ``--rollouts`` rollouts at once on a daemon (a vLLM-shaped mock backend answering at
once, so the figures are the orchestration's and the processes' own) and measures, per rollout, the time from
its queueing to its agent's first LLM call (the call's start as aglverl's proxy recorded it), and the rollouts
per second until the last one ended. Two Agent Lightning v1.0 agent classes, ``--concurrency`` processes at
once: ``sdk``, ``examples/agl_agent.py``'s ``OneWordAgent`` (the OpenAI SDK, one call, a reward event with
httpx), and ``stdlib``, ``benchmarks/_stdlib_agent.py`` (the same with ``urllib``: what the orchestration costs
when the agent imports next to nothing). Each is run by:

- ``aglverl``: the built-in runner (:mod:`aglverl.runners`), woken by the store when work is queued, with its
  defaults (the fork server: the class imported once, each rollout a fork);
- ``aglverl_spawn``: the same with ``fork_server: false`` (a new Python per rollout, Agent Lightning's way);
- ``against``: with ``--against DIR`` (another tree, e.g. ``git -C /work/main archive 019ee6f aglverl | tar -x -C
  DIR``), that tree's built-in runner, in a child process that imports it (``PYTHONPATH=DIR``; that tree's
  modules alone: ``_common.TREE_ENV``), run right after this tree's for the same agent; and ``this_child``, this
  tree's run the same way, in a child process of its own: the pair to compare (each child a fresh process,
  where ``aglverl`` runs in this one, warmed by the systems run before it);
- ``agl_poll_1s`` / ``agl_poll_10s``: ``python -m agentlightning.controller runner_type=local`` from the Agent
  Lightning venv, pointed at the task server, polling every second / every 10 s (its default), started and
  polling before the rollouts are queued;
and, as one more agent, ``shell``: the built-in runner with ``examples/word_agent.sh`` (sh, curl, jq, sed, tr).

Also the process start cost per rollout: wall and CPU seconds of ``sh -c true``, ``python -c pass``, Python
importing ``httpx``, and importing ``openai`` + ``httpx`` (what an OpenAI-SDK agent pays before its first call),
each started ``--starts`` times in a row. CPU seconds per rollout of each system are its processes' (children's
``getrusage`` once the runner has stopped: the agents, their supervisors and the fork server's templates, import
included; the controller's and its agents' for Agent Lightning's) plus this process's own (the daemon, the proxy
path), over the rollouts. The load average is recorded before and after each system. ``--repeat N`` runs every
system N times, interleaved, and reports the medians (and each run); ``--systems`` / ``--agents`` keep only the
ones named. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from _common import TREE_ENV, emit, machine_info, percentile, run_loop, run_queued
from anyio.streams.text import TextReceiveStream

import aglverl
from aglverl import AgentDaemon
from aglverl.process_runner import ProcessOptions, ProcessRunner  # the old tree's too (--against)
from aglverl.testing.mock_vllm import MockVLLM

try:  # Agent Lightning v1.0's settings, where the tree measured keeps them (--against an older tree)
    from aglverl.agl10.config import AgentLightningSettings
    from aglverl.agl10.wire import RolloutConfig, RolloutLocalConfig
except ImportError:  # before aglverl/agl10 (019ee6f)
    from aglverl.agent_lightning.config import AgentLightningSettings  # type: ignore[no-redef]
    from aglverl.agent_lightning.wire import RolloutConfig, RolloutLocalConfig  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLES = ROOT / "examples"
KEY = "bench"
AGENT_CLASSES = {"sdk": "agl_agent:OneWordAgent", "stdlib": "_stdlib_agent:StdlibAgent"}
ENV_MAP = {"TASK_PROMPT": "input.prompt", "TASK_WORD": "input.word"}


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


async def start_costs(starts: int) -> dict[str, Any]:
    """Wall and CPU seconds (medians) of starting a process that does nothing else, per kind."""
    python = sys.executable
    kinds = {
        "sh -c true": ["sh", "-c", "true"],
        "python -c pass": [python, "-c", "pass"],
        "python: import httpx": [python, "-c", "import httpx"],
        "python: import openai, httpx": [python, "-c", "import openai, httpx"],
    }
    out: dict[str, Any] = {}
    for name, argv in kinds.items():
        walls, cpus = [], []
        for _ in range(starts):
            cpu, wall = _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
            await anyio.run_process(argv)
            walls.append(time.perf_counter() - wall)
            cpus.append(_cpu(resource.RUSAGE_CHILDREN) - cpu)
        out[name] = {"wall_s": round(percentile(walls, 50), 4), "cpu_s": round(percentile(cpus, 50), 4)}
    return out


async def _controller(
    agl_python: str, server: str, poll: float, concurrency: int, tg: anyio.abc.TaskGroup
) -> anyio.abc.Process:
    """Agent Lightning's local controller, returned once it polls (its first line: 'LocalReconciler starting')."""
    command = [
        agl_python,
        "-m",
        "agentlightning.controller",
        "runner_type=local",
        f"agl_server.url={server}",
        f"agl_server.key={KEY}",
        f"local_runner.poll_interval={poll:g}",
        f"local_runner.maximum_size={concurrency}",
        "hydra.run.dir=/tmp/aglverl-bench-hydra",
        "hydra.output_subdir=null",
    ]
    process = await anyio.open_process(command, stdin=None, stderr=None)
    assert process.stdout is not None
    started = anyio.Event()

    async def follow() -> None:  # keeps reading, so the controller never blocks on a full pipe
        assert process.stdout is not None
        async for text in TextReceiveStream(process.stdout):
            if "LocalReconciler starting" in text:
                started.set()

    tg.start_soon(follow)
    with anyio.fail_after(120):
        await started.wait()
    return process


async def one_system(agent: str, system: str, args: argparse.Namespace) -> dict[str, Any]:
    """Queue the rollouts at once on a fresh daemon; run them with ``system``; the figures."""
    if system in ("against", "this_child"):
        return await _in_child(agent, args, args.against if system == "against" else ROOT)
    load_before = os.getloadavg()
    tasks = [{"prompt": "Answer with one word: yes.", "word": "yes"} for _ in range(args.rollouts)]
    agent_class = AGENT_CLASSES.get(agent)
    settings = AgentLightningSettings(
        rollout_config=RolloutConfig(
            timeout_seconds=600, local=RolloutLocalConfig(agent_class=agent_class, env_map=ENV_MAP)
        )
    )
    section: dict[str, Any] = (
        {"agent_class": agent_class, "env_map": ENV_MAP}
        if agent_class
        else {"command": ["sh", str(EXAMPLES / "word_agent.sh")], "env_map": ENV_MAP}
    )
    if system == "aglverl_spawn":
        section["fork_server"] = False
    options = ProcessOptions.from_mapping(section)
    children, own = _cpu(resource.RUSAGE_CHILDREN), _cpu(resource.RUSAGE_SELF)
    runner = None
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(
            backends=[mock.url], model="mock", token=KEY, agent_lightning=settings, max_attempts=1
        ) as daemon,
    ):
        async with anyio.create_task_group() as tg:
            controller = None
            if system.startswith("agl_poll_"):
                controller = await _controller(
                    args.agl_python, daemon.server_url, float(system[9:-1]), args.concurrency, tg
                )
            else:
                runner = ProcessRunner(
                    daemon, options, concurrency=args.concurrency, log_dir=args.logs / f"{agent}-{system}"
                )
                await tg.start(
                    runner.serve
                )  # the fork server's template imports the agent here, before the clock
            wall, records, firsts = await run_queued(daemon, tasks, args.deadline)
            if controller is not None:
                controller.send_signal(signal.SIGTERM)
                await controller.wait()
            tg.cancel_scope.cancel()  # the runner stops: its templates exit and are reaped (their CPU counted)
        own = _cpu(resource.RUSAGE_SELF) - own
    children = _cpu(resource.RUSAGE_CHILDREN) - children
    n = len(records)
    return {
        "rollouts": n,
        "succeeded": sum(r.state == "completed" for r in records),
        "queued_to_first_call_s": {
            "p50": round(percentile(firsts, 50), 3),
            "p90": round(percentile(firsts, 90), 3),
            "max": round(max(firsts), 3) if firsts else None,
        },
        "rollouts_per_s": round(n / wall, 3),
        "wall_s": round(wall, 2),
        "cpu_s_per_rollout": {"processes": round(children / n, 3), "daemon": round(own / n, 4)},
        "peak_processes": runner.peak if runner is not None else None,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "tree": str(Path(aglverl.__file__).parent.parent),
    }


async def _in_child(agent: str, args: argparse.Namespace, tree: Path) -> dict[str, Any]:
    """``agent`` run by the built-in runner of ``tree`` (``--against``'s, or this one), in a child process that
    imports that tree alone."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), str(EXAMPLES), str(HERE)]),
        TREE_ENV: str(tree),
    }
    command = [
        sys.executable,
        str(HERE / "agent_processes.py"),
        "--only",
        agent,
        "--rollouts",
        str(args.rollouts),
        "--concurrency",
        str(args.concurrency),
        "--deadline",
        str(args.deadline),
        "--logs",
        str(args.logs / ("against" if tree == args.against else "this_child")),
        "--agl-python",
        args.agl_python,
    ]
    done = await anyio.run_process(command, env=env, check=False, stderr=None)
    if done.returncode != 0:
        raise RuntimeError(f"the run of {tree} in a child process failed (exit {done.returncode})")
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


async def main(args: argparse.Namespace) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(EXAMPLES), str(HERE), os.environ.get("PYTHONPATH")) if p
    )
    if (
        args.only is not None
    ):  # the child of --against: this agent by the built-in runner of the tree imported
        print(json.dumps(await one_system(args.only, "aglverl_against_child", args)), flush=True)
        return
    systems = [
        "aglverl",
        *(["this_child", "against"] if args.against else []),
        "aglverl_spawn",
        "agl_poll_1s",
        "agl_poll_10s",
    ]
    runs = [(agent, system) for agent in ("sdk", "stdlib") for system in systems]
    if shutil.which("jq") and shutil.which("curl"):
        runs += [("shell", s) for s in ("aglverl", *(["this_child", "against"] if args.against else []))]
    if args.systems:
        runs = [(a, s) for a, s in runs if s in args.systems]
    if args.agents:
        runs = [(a, s) for a, s in runs if a in args.agents]
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "against": str(args.against) if args.against else None,
        "rollouts": args.rollouts,
        "concurrency": args.concurrency,
        "start_cost": await start_costs(args.starts),
    }
    measured: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeat):  # interleaved: every system once, then again
        for agent, system in runs:
            measured.setdefault((agent, system), []).append(await one_system(agent, system, args))
    for (agent, system), figures in measured.items():
        result.setdefault(agent, {})[system] = figures[0] if len(figures) == 1 else _medians(figures)
    result["machine_after"] = machine_info()["loadavg_1_5_15"]
    emit(result)


def _medians(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats of one system: the median of each figure, and every repeat."""

    def median(get: Any) -> float:
        return round(statistics.median(get(f) for f in figures), 4)

    return {
        "repeats": len(figures),
        "queued_to_first_call_s": {
            q: median(lambda f, q=q: f["queued_to_first_call_s"][q]) for q in ("p50", "p90", "max")
        },
        "rollouts_per_s": median(lambda f: f["rollouts_per_s"]),
        "cpu_s_per_rollout": {
            k: median(lambda f, k=k: f["cpu_s_per_rollout"][k]) for k in ("processes", "daemon")
        },
        "succeeded": min(f["succeeded"] for f in figures),
        "each": figures,
    }


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--starts", type=int, default=5, help="starts of each kind of process (start cost)")
    parser.add_argument("--agl-python", default=str(ROOT / ".venv-agl" / "bin" / "python"))
    parser.add_argument(
        "--against", type=Path, help="another tree (its aglverl/ inside): its runner beside this one's"
    )
    parser.add_argument(
        "--systems",
        nargs="*",
        help="only these systems (aglverl, this_child, against, aglverl_spawn, agl_poll_1s...)",
    )
    parser.add_argument("--agents", nargs="*", help="only these agents (sdk, stdlib, shell)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run every system this many times, interleaved (medians)"
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)  # the --against child: one agent, printed as JSON
    parser.add_argument(
        "--deadline", type=float, default=900.0, help="seconds a system gets for its rollouts"
    )
    parser.add_argument("--logs", type=Path, default=Path("/tmp/aglverl-bench-agent-logs"))
    args = parser.parse_args()
    needs_agl = args.only is None and (
        not args.systems or any(s.startswith("agl_poll") for s in args.systems)
    )
    if needs_agl and not Path(args.agl_python).exists():
        parser.exit(
            2, f"no Agent Lightning venv at {args.agl_python}: run `make venv-agl` (or pass --agl-python)\n"
        )
    if args.against is not None and not (args.against / "aglverl" / "__init__.py").is_file():
        parser.exit(2, f"--against {args.against}: no aglverl package in it\n")
    run_loop(main, args)


if __name__ == "__main__":
    cli()
