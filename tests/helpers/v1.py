"""A live verl V1 trainer for a test module: Ray, TransferQueue, verl's workers and replicas, and the daemon
serving as its producer (``aglverl.verl_v1.running``), as ``AsyncVERL`` sets them up, minus ``fit``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import ExitStack, asynccontextmanager
from typing import Any

from aglverl.algorithm import VerlRuntime, compose_config, verl_runtime
from aglverl.algorithm.config import daemon_config, run_config
from aglverl.algorithm.runtime import worker_group_class
from aglverl.verl_plugin.patches import use_worker_group
from aglverl.verl_v1 import DaemonAgentLoopManager, RunPlan, running


@asynccontextmanager
async def live_trainer(
    overrides: Mapping[str, Any], train: list[dict[str, Any]]
) -> AsyncIterator[tuple[Any, Any, VerlRuntime]]:
    """``(run, trainer, runtime)``: the trainer initialised (weights synced, replicas awake) and set up as
    verl's ``fit`` sets it up for step 1, its agent-loop manager the daemon's."""
    config, options = compose_config(overrides)
    config = run_config(config, has_validation=False)
    with ExitStack() as stack:
        runtime = stack.enter_context(verl_runtime(config))
        use_worker_group(worker_group_class(runtime.env, runtime.rendezvous_dir))
        plan = RunPlan(config=config, daemon=daemon_config(config, options), train=train, progress=False)
        async with running(plan) as (run, trainer):
            trainer.agent_loop_manager = DaemonAgentLoopManager(run)
            trainer.global_steps = 1
            trainer.curr_step_profile, trainer.timing_raw = False, {}  # what verl's fit() sets for a step
            yield run, trainer, runtime


async def multi_turn_agents(run: Any, count: int, turns: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """``count`` agents claim a task each and hold a ``turns``-call conversation through the proxy with the
    openai SDK, then post reward 1. The first call is a chat call (the model's chat template); each later one
    is a completion whose prompt is the previous call's prompt + answer ids + a tool message's ids, the way
    verl's own agent loop keeps a conversation as token ids, so every call extends the one before exactly (an
    agent that re-renders its history as text can drift: the tiny random model's answers often do not survive
    decode + re-encode, see tests/test_multiturn.py). Returns, per rollout, each call's (prompt ids, response
    ids) as the engine returned them (the proxy asks on the agent's behalf)."""
    import openai

    from aglverl.client import AgentClient
    from aglverl.models import Rollout

    seen: dict[str, list[tuple[list[int], list[int]]]] = {}
    async with AgentClient(run.daemon.server_url) as agent:
        client = openai.AsyncOpenAI(api_key="-", max_retries=0)
        for _ in range(count):
            task = await agent.next_task(wait=30)
            assert task is not None
            llm = (await agent.resources(task.resources_id)).resources["main_llm"]
            sdk = client.with_options(base_url=llm.get_base_url(task.rollout_id, task.attempt_id))
            calls = seen.setdefault(task.rollout_id, [])
            chat = await sdk.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task.input["prompt"]}], max_tokens=3
            )
            calls.append((chat.model_extra["prompt_token_ids"], chat.choices[0].model_extra["token_ids"]))
            for turn in range(1, turns):
                prompt, response = calls[-1]
                tool = [7, 8, 9 + turn]  # a tool result's ids
                answer = await sdk.completions.create(
                    model=llm.model, prompt=prompt + response + tool, max_tokens=3
                )
                choice = answer.choices[0].model_extra
                calls.append((choice["prompt_token_ids"], choice["token_ids"]))
            await agent.post_rollout(
                Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
            )
        await client.close()
    return seen


def assert_rows_are_the_engines_chains(
    keys: list[str], data: Any, seen: dict[str, list[tuple[list[int], list[int]]]]
) -> int:
    """Each TransferQueue row is a chain of one rollout's calls: its ids are its last call's prompt + response,
    its ids under ``response_mask`` those the engine generated for its calls, in order, ``num_turns`` twice its
    calls; every call is in exactly one row. Returns how many rows hold more than one call."""
    covered: dict[str, list[int]] = {rid: [] for rid in seen}
    merged = 0
    for i, key in enumerate(keys):
        prompt, response = data["prompts"][i].tolist(), data["responses"][i].tolist()
        mask = data["response_mask"][i].tolist()
        assert data["input_ids"][i].tolist() == prompt + response
        assert data["loss_mask"][i].tolist() == mask
        owners = [
            (rid, c)
            for rid, calls in seen.items()
            for c, (p, r) in enumerate(calls)
            if p + r == prompt + response
        ]
        assert len(owners) == 1, key
        rid, last = owners[0]
        first = next(c for c, (p, _) in enumerate(seen[rid]) if p == prompt)
        assert int(key.rsplit("_", 1)[1]) == first
        generated = [t for _, r in seen[rid][first : last + 1] for t in r]
        assert [t for t, m in zip(response, mask, strict=True) if m] == generated
        assert int(data["num_turns"][i]) == 2 * (last - first + 1)
        covered[rid] += range(first, last + 1)
        merged += last > first
    assert all(sorted(c) == list(range(len(seen[rid]))) for rid, c in covered.items())
    return merged
