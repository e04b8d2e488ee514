"""One agent, four ways of running it, in one run: Agent Lightning 0.3's ``Trainer`` with aglverl's ``VERL`` (its
runners' dequeue long-polled, and as ``agl.VERL``'s runners poll: every 5 s), ``AsyncVERL(agent=...)``, and an
Agent Lightning 1.0 agent class under aglverl's process runner.

    .venv-agl03/bin/python benchmarks/agl03.py                  # needs .venv-agl03 (make venv-agl03)
    .venv-agl03/bin/python benchmarks/agl03.py --steps 4 --rollouts 32 --runners 8 --update 2

Each system gets a fresh daemon in front of a vLLM-shaped mock backend (``--latency`` seconds a call, 4 tokens),
and ``--steps`` steps of ``--rollouts`` rollouts queued at once; between steps nothing is queued for
``--update`` seconds, what a trainer's update takes (on CPU with the tiny model ~1-2 s; minutes on GPUs). The
agent is the same: one chat call with the ``openai`` SDK, its reward returned:

- ``agl_trainer_verl``: ``agl.Trainer(n_runners=--runners).fit(@agl.rollout function)``, its algorithm doing what
  ``aglverl.agent_lightning.VERL.run`` does around the trainer (``LightningStoreBridge``: every attempt a rollout
  of the Trainer's store; ``DequeueBell``: the runners' empty dequeue long-polled);
- ``agl_trainer_verl_polling``: the same without the bell: the runners poll as under ``agl.VERL`` (an empty
  queue: a 5 s +- 0.5 s sleep);
- ``asyncverl_agent``: ``run_agents(url, async agent, concurrency=--runners)``, what ``AsyncVERL(agent=...)`` runs;
- ``agl10_class``: ``examples/agl_agent.py``'s ``OneWordAgent`` under ``aglverl.process_runner`` (a process per
  rollout, ``--runners`` at once).

Figures per system: each step's wall time (its rollouts queued to the last one's end), rollouts/s, the time from
a rollout's queueing to its agent's first LLM call (as aglverl's proxy recorded it: p50 / p90 / max, the first
step apart from the later ones, which follow an update), and CPU seconds per rollout (this process: daemon,
proxy, bridge, store server; and its children: runners or agent processes). ``idle_sleep_cost_s``: the
median later step's wall time polling minus long-polled. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault(
    "LITELLM_LOCAL_MODEL_COST_MAP", "True"
)  # litellm's price list from the package, no network

import agentlightning as agl
import anyio
import openai
from _common import emit, machine_info, percentile, run_queued

from aglverl import AgentDaemon, run_agents
from aglverl.agl03.store_bridge import DequeueBell, LightningStoreBridge
from aglverl.agl10.config import AgentLightningSettings
from aglverl.agl10.wire import RolloutConfig, RolloutLocalConfig
from aglverl.models import LLM
from aglverl.process_runner import ProcessOptions, ProcessRunner
from aglverl.testing.mock_vllm import MockVLLM

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
TASK = {"prompt": "Answer with one word: yes.", "word": "yes"}
ENV_MAP = {"TASK_PROMPT": "input.prompt", "TASK_WORD": "input.word"}


def reward(answer: str, word: str) -> float:
    words = answer.lower().split()
    return sum(w == word for w in words) / len(words) if words else 0.0


@agl.rollout
def agl_agent(task: dict, llm: agl.LLM) -> float:
    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}]
    )
    return reward(reply.choices[0].message.content or "", task["word"])


ASYNC_CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)


async def aglverl_agent(task: dict, llm: LLM) -> float:
    reply = await ASYNC_CLIENT.with_options(base_url=llm.endpoint).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}]
    )
    return reward(reply.choices[0].message.content or "", task["word"])


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


async def _steps(daemon: AgentDaemon, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--steps`` steps: the rollouts queued at once, awaited, then ``--update`` seconds with nothing queued."""
    steps = []
    for step in range(args.steps):
        if step:
            await anyio.sleep(args.update)  # the trainer's update: nothing is queued meanwhile
        tasks = [dict(TASK) for _ in range(args.rollouts)]
        wall, records, firsts = await run_queued(daemon, tasks, args.deadline)
        steps.append(
            {"wall_s": wall, "firsts": firsts, "completed": sum(r.state == "completed" for r in records)}
        )
    return steps


class BenchAlgorithm(agl.Algorithm):
    """What ``VERL.run`` does around verl's trainer (the bridge, the bell), with the steps of :func:`_steps`
    in place of the trainer's."""

    def __init__(self, args: argparse.Namespace, long_poll: bool) -> None:
        super().__init__()
        self.args = args
        self.long_poll = long_poll
        self.steps: list[dict[str, Any]] = []
        self.woken = 0

    async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
        store = self.get_store()
        bell = DequeueBell() if self.long_poll else None
        if bell is not None:
            bell.install(store)
        try:
            async with (
                MockVLLM(completion_tokens=4, latency=self.args.latency) as mock,
                AgentDaemon(backends=[mock.url], model="mock", max_attempts=1) as daemon,
                anyio.create_task_group() as tg,
            ):
                bridge = LightningStoreBridge(daemon, store, concurrency=self.args.rollouts, bell=bell)
                await tg.start(bridge.serve)
                self.steps = await _steps(daemon, self.args)
                tg.cancel_scope.cancel()
        finally:
            if bell is not None:
                bell.close()
                self.woken = bell.woken


def run_agl_trainer(args: argparse.Namespace, long_poll: bool) -> dict[str, Any]:
    algorithm = BenchAlgorithm(args, long_poll)
    own, children, started = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    agl.Trainer(algorithm=algorithm, n_runners=args.runners).fit(agl_agent, train_dataset=[TASK])
    total = time.perf_counter() - started
    out = _figures(
        algorithm.steps, args, _cpu(resource.RUSAGE_SELF) - own, _cpu(resource.RUSAGE_CHILDREN) - children
    )
    out["fit_total_s"] = round(total, 2)
    out["dequeues_woken_by_the_bell"] = algorithm.woken if long_poll else None
    return out


async def run_asyncverl_agent(args: argparse.Namespace) -> dict[str, Any]:
    own = _cpu(resource.RUSAGE_SELF)
    async with (
        MockVLLM(completion_tokens=4, latency=args.latency) as mock,
        AgentDaemon(backends=[mock.url], model="mock", max_attempts=1) as daemon,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(
            functools.partial(run_agents, daemon.server_url, aglverl_agent, concurrency=args.runners)
        )
        steps = await _steps(daemon, args)
        tg.cancel_scope.cancel()
    return _figures(steps, args, _cpu(resource.RUSAGE_SELF) - own, 0.0)


async def run_agl10_class(args: argparse.Namespace) -> dict[str, Any]:
    agent_class = "agl_agent:OneWordAgent"
    settings = AgentLightningSettings(
        rollout_config=RolloutConfig(
            timeout_seconds=600, local=RolloutLocalConfig(agent_class=agent_class, env_map=ENV_MAP)
        )
    )
    options = ProcessOptions.from_mapping({"agent_class": agent_class, "env_map": ENV_MAP})
    own, children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    async with (
        MockVLLM(completion_tokens=4, latency=args.latency) as mock,
        AgentDaemon(backends=[mock.url], model="mock", agent_lightning=settings, max_attempts=1) as daemon,
        anyio.create_task_group() as tg,
    ):
        runner = ProcessRunner(daemon, options, concurrency=args.runners, log_dir=args.logs)
        await tg.start(runner.serve)
        steps = await _steps(daemon, args)
        tg.cancel_scope.cancel()
    return _figures(steps, args, _cpu(resource.RUSAGE_SELF) - own, _cpu(resource.RUSAGE_CHILDREN) - children)


def _figures(
    steps: list[dict[str, Any]], args: argparse.Namespace, own: float, children: float
) -> dict[str, Any]:
    n = sum(len(s["firsts"]) for s in steps)
    first, later = steps[0], steps[1:]

    def spread(values: list[float]) -> dict[str, float | None]:
        return {
            "p50": round(percentile(values, 50), 3) if values else None,
            "p90": round(percentile(values, 90), 3) if values else None,
            "max": round(max(values), 3) if values else None,
        }

    return {
        "step_wall_s": [round(s["wall_s"], 3) for s in steps],
        "later_step_wall_s_median": round(statistics.median(s["wall_s"] for s in later), 3)
        if later
        else None,
        "rollouts_per_s_later_steps": round(args.rollouts / statistics.median(s["wall_s"] for s in later), 2)
        if later
        else None,
        "queued_to_first_call_s": {
            "first_step": spread(first["firsts"]),
            "later_steps": spread([f for s in later for f in s["firsts"]]),
        },
        "completed": sum(s["completed"] for s in steps),
        "rollouts": args.steps * args.rollouts,
        "cpu_s_per_rollout": {
            "this_process": round(own / max(n, 1), 4),
            "children": round(children / max(n, 1), 4),
        },
    }


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts queued at once per step")
    parser.add_argument("--runners", type=int, default=8, help="runners / agent loops / agent processes")
    parser.add_argument("--update", type=float, default=2.0, help="seconds between steps with nothing queued")
    parser.add_argument("--latency", type=float, default=0.05, help="the mock backend's seconds per call")
    parser.add_argument("--deadline", type=float, default=600.0)
    parser.add_argument(
        "--systems", default="agl_trainer_verl,agl_trainer_verl_polling,asyncverl_agent,agl10_class"
    )
    parser.add_argument("--logs", type=Path, default=Path("/tmp/aglverl-bench-agl03-logs"))
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(EXAMPLES), str(HERE), os.environ.get("PYTHONPATH")) if p
    )
    sys.path.insert(0, str(EXAMPLES))
    result: dict[str, Any] = {
        "machine": machine_info(),
        **{k: v for k, v in vars(args).items() if k != "logs"},
    }
    for system in args.systems.split(","):
        if system == "agl_trainer_verl":
            result[system] = run_agl_trainer(args, long_poll=True)
        elif system == "agl_trainer_verl_polling":
            result[system] = run_agl_trainer(args, long_poll=False)
        elif system == "asyncverl_agent":
            result[system] = anyio.run(run_asyncverl_agent, args)
        elif system == "agl10_class":
            result[system] = anyio.run(run_agl10_class, args)
        else:
            parser.exit(2, f"unknown system {system!r}\n")
        print(json.dumps({system: result[system]}), file=sys.stderr, flush=True)  # each system as it ends
    polled, long_polled = result.get("agl_trainer_verl_polling"), result.get("agl_trainer_verl")
    if (
        polled
        and long_polled
        and polled["later_step_wall_s_median"]
        and long_polled["later_step_wall_s_median"]
    ):
        result["idle_sleep_cost_s"] = round(
            polled["later_step_wall_s_median"] - long_polled["later_step_wall_s_median"], 3
        )
    result["machine_after"] = machine_info()["loadavg_1_5_15"]
    emit(result)


if __name__ == "__main__":
    cli()
