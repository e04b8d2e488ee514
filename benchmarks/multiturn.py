"""Merged trajectories against one row per call, on verl's V1 trainer (the demo's, on CPU). Prints one JSON object.

Two parts, each variant a child process that trains with ``AsyncVERL`` and reports every step:

- **Cost** (``--turns``, default 2 4 8): a tool agent whose conversation has a ~256-token system prompt (tool
  descriptions), then per turn a call (answers of at most 8 tokens) and a ~64-token tool result; reward: the
  demo's word reward averaged over the answers. The agent keeps its conversation as token ids (verl's agent
  loop's way, see :func:`tool_agent`), so what is measured is the layouts' cost, not the drift. ``trajectory: merge`` and ``per_call`` run the same work
  (``--cost-steps`` steps, ``--prompts`` prompts x ``--n`` samples). Per variant: trainer tokens per rollout
  (the rows' prompt + response ids, ``step/trainer_tokens_per_rollout``), rows per step, seconds per step
  (median over the steps after the first), generated tokens per step, and the drift rate (calls that began
  with their chain's last prompt but not with its exact answer ids, over all calls) with the tiny model's chat
  template.
- **Learning** (``--learn-steps``, 0 to skip): ``aglverl demo --task multiturn`` (3 turns, chat messages the
  tiny model's chat template renders) under each trajectory: the reward per step, the time to ``--target``, and
  the drift rate with that template (early and late in training).

Targets (8 turns): at least 4x fewer trainer tokens and at least 2x less time per step with ``merge``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import emit, machine_info  # noqa: E402

SYSTEM_TOKENS = 256
TOOL_TOKENS = 64
ANSWER_TOKENS = 8
TARGET_TOKENS_RATIO = 4.0
TARGET_STEP_SPEEDUP = 2.0
_TOOLS = (
    "Tool lookup(query: str) returns the facts stored under query. ",
    "Tool calculate(expression: str) evaluates arithmetic and returns a number. ",
    "Tool search(text: str, limit: int) lists documents that mention text. ",
    "Tool fetch(url: str) returns the page body as plain text. ",
)


def _text_of(tokenizer: Any, pieces: tuple[str, ...], tokens: int) -> str:
    """Repeat ``pieces`` until the text is at least ``tokens`` tokens long for ``tokenizer``."""
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += pieces[i % len(pieces)]
        i += 1
    return text


def tool_agent(turns: int, tokenizer: Any, system: str, tool_result: str) -> Any:
    """An agent of ``turns`` calls that keeps its conversation as token ids, as verl's own agent loop does: the
    chat template renders the system prompt and the question once; each call sends the ids so far on the
    completions route, appends the engine's ids as they came back, then the template's ids of a tool result.
    Nothing is re-tokenized, so no call drifts (the chat runs of the learning part measure drift)."""
    from aglverl.demo import _openai_client, word_reward

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def rendered(messages: list[dict[str, str]]) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )

    async def agent(task: dict[str, Any], llm: Any) -> float:
        client = _openai_client().with_options(base_url=llm.endpoint)
        ids = rendered([{"role": "system", "content": system}, {"role": "user", "content": task["prompt"]}])
        rewards = []
        for turn in range(turns):
            reply = await client.completions.create(
                model=llm.model, prompt=ids, max_tokens=ANSWER_TOKENS, temperature=1.0
            )
            answer = list(reply.choices[0].model_extra["token_ids"])
            rewards.append(word_reward(tokenizer.decode(answer, skip_special_tokens=True), task["word"]))
            closing = [] if answer and answer[-1] == end else [end]
            message = f"<|im_start|>user\nResult {turn}: {tool_result}<|im_end|>\n<|im_start|>assistant\n"
            ids = ids + answer + closing + tokenizer("\n" + message, add_special_tokens=False)["input_ids"]
        return sum(rewards) / len(rewards)

    return agent


def child(kind: str, turns: int, trajectory: str, steps: int, prompts: int, n: int) -> None:
    """Train one variant; one JSON line per step on stdout, then ``{"done": ...}``."""
    import anyio
    import ray
    from transformers import AutoTokenizer

    from aglverl.algorithm import AsyncVERL
    from aglverl.demo import TASKS, demo_config, demo_samples
    from aglverl.tiny import tiny_model_path

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = time.monotonic()
    if kind == "learn":
        config = demo_config(steps, task="multiturn", trajectory=trajectory)
        agent = TASKS["multiturn"][0]
    else:
        config = demo_config(steps, trajectory=trajectory)
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path()))
        system = _text_of(tokenizer, _TOOLS, SYSTEM_TOKENS)
        result = _text_of(tokenizer, ("value 42, unit none, status ok, source cache; ",), TOOL_TOKENS)
        # the widest row either layout makes: the last call's whole history (prompt) or the conversation
        # after the first prompt (response), within the tiny model's 1024 positions
        config["data"].update(
            {"train_batch_size": prompts, "max_prompt_length": 1024, "max_response_length": 1024}
        )
        config["actor_rollout_ref"]["rollout"]["n"] = n
        config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = prompts
        agent = tool_agent(turns, tokenizer, system, result)
    algo = AsyncVERL(config, agent=agent, progress=False)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "end": time.monotonic() - started, "metrics": metrics}
        sys.stdout.buffer.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        sys.stdout.flush()

    algo.on_step.append(on_step)
    anyio.run(algo.run, demo_samples(64))
    sys.stdout.buffer.write(orjson.dumps({"done": time.monotonic() - started}) + b"\n")


def run_child(args: list[str], log: Path) -> list[dict[str, Any]]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    # Ray puts the driver's working directory first on its workers' sys.path: never this checkout's root
    with log.open("wb") as stderr:
        out = subprocess.run(
            command, cwd=log.parent, stdout=subprocess.PIPE, stderr=stderr, check=False, timeout=3600
        )
    rows = [orjson.loads(line) for line in out.stdout.splitlines() if line.startswith(b"{")]
    if out.returncode != 0 or not rows or "done" not in rows[-1]:
        raise RuntimeError(f"{args} failed (exit {out.returncode}); see {log}")
    return rows[:-1]


def _sum(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r["metrics"].get(key, 0.0) for r in rows)


def summarize_cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    timed = rows[1:] or rows  # the first step also pays for warming up
    calls = _sum(rows, "batch/n_calls")
    return {
        "steps": len(rows),
        "trainer_tokens_per_rollout": round(
            statistics.mean(r["metrics"]["step/trainer_tokens_per_rollout"] for r in rows), 1
        ),
        "per_call_tokens_per_rollout": round(
            statistics.mean(r["metrics"]["step/trainer_tokens_per_rollout_per_call"] for r in rows), 1
        ),
        "rows_per_step": round(_sum(rows, "step/n_rows") / len(rows), 1),
        "calls_per_step": round(calls / len(rows), 1),
        "seconds_per_step": round(statistics.median(r["metrics"]["timing_s/step"] for r in timed), 3),
        "trainer_seconds_per_step": round(
            statistics.median(
                r["metrics"].get("timing_s/update_actor", 0.0)
                + r["metrics"].get("timing_s/old_log_prob", 0.0)
                for r in timed
            ),
            3,
        ),
        "generated_tokens_per_step": round(_sum(rows, "step/generated_tokens") / len(rows), 1),
        "drift_rate": round(_sum(rows, "batch/n_calls_drifted") / calls, 4) if calls else None,
        "calls_merged_per_step": round(_sum(rows, "batch/n_calls_merged") / len(rows), 1),
        "chains_split_width": _sum(rows, "batch/n_chains_split_width"),
        "reward": [round(r["metrics"].get("training/reward", 0.0), 3) for r in rows],
    }


def summarize_learning(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    first_start = rows[0]["end"] - rows[0]["metrics"]["timing_s/step"]
    rewards = [r["metrics"].get("training/reward", 0.0) for r in rows]
    reached = next((i for i, r in enumerate(rewards) if r >= target), None)
    return {
        "rewards": [round(r, 3) for r in rewards],
        "steps_to_target": None if reached is None else reached + 1,
        "seconds_to_target": None if reached is None else round(rows[reached]["end"] - first_start, 1),
        "seconds_per_step": round(
            statistics.median(r["metrics"]["timing_s/step"] for r in rows[1:] or rows), 3
        ),
        "trainer_tokens_per_rollout": round(
            statistics.mean(r["metrics"]["step/trainer_tokens_per_rollout"] for r in rows), 1
        ),
        "drift_rate": round(_sum(rows, "batch/n_calls_drifted") / max(_sum(rows, "batch/n_calls"), 1), 4),
        "drift_rate_per_step": [
            round(
                r["metrics"].get("batch/n_calls_drifted", 0.0)
                / max(r["metrics"].get("batch/n_calls", 0.0), 1),
                3,
            )
            for r in rows
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="cost", choices=["cost", "learn"], help=argparse.SUPPRESS)
    parser.add_argument("--trajectory", default="merge", help=argparse.SUPPRESS)
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--cost-steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step in the cost runs")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt in the cost runs")
    parser.add_argument("--learn-steps", type=int, default=20, help="steps of the multiturn demo (0: skip)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--logs", default="/tmp/aglverl-bench-multiturn")
    args = parser.parse_args()
    if args.child:
        child(args.kind, args.turns[0], args.trajectory, args.cost_steps, args.prompts, args.n)
        return
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cost: dict[str, Any] = {}
    for turns in args.turns:
        runs = {}
        for trajectory in ("merge", "per_call"):
            common = ["--turns", str(turns), "--trajectory", trajectory, "--cost-steps", str(args.cost_steps)]
            common += ["--prompts", str(args.prompts), "--n", str(args.n)]
            rows = run_child(common, logs / f"cost-{turns}-{trajectory}.log")
            runs[trajectory] = summarize_cost(rows)
        merge, per_call = runs["merge"], runs["per_call"]
        runs["tokens_ratio"] = round(
            per_call["trainer_tokens_per_rollout"] / merge["trainer_tokens_per_rollout"], 2
        )
        runs["step_speedup"] = round(per_call["seconds_per_step"] / merge["seconds_per_step"], 2)
        cost[f"{turns}_turns"] = runs
    learning: dict[str, Any] = {}
    if args.learn_steps:
        for trajectory in ("merge", "per_call"):
            common = ["--kind", "learn", "--trajectory", trajectory, "--cost-steps", str(args.learn_steps)]
            rows = run_child(common, logs / f"learn-{trajectory}.log")
            learning[trajectory] = summarize_learning(rows, args.target)
    widest = cost.get(f"{max(args.turns)}_turns", {})
    emit(
        {
            "benchmark": "multiturn",
            "machine": machine_info(),
            "settings": {
                "turns": args.turns,
                "system_tokens": SYSTEM_TOKENS,
                "tool_tokens": TOOL_TOKENS,
                "answer_tokens": ANSWER_TOKENS,
                "cost_steps": args.cost_steps,
                "rollouts_per_step": args.prompts * args.n,
                "learn_steps": args.learn_steps,
                "target": args.target,
            },
            "cost": cost,
            "learning": learning,
            "targets": {
                "tokens_ratio_at_least": TARGET_TOKENS_RATIO,
                "step_speedup_at_least": TARGET_STEP_SPEEDUP,
                "turns": max(args.turns),
                "tokens_ratio_met": widest.get("tokens_ratio", 0.0) >= TARGET_TOKENS_RATIO,
                "step_speedup_met": widest.get("step_speedup", 0.0) >= TARGET_STEP_SPEEDUP,
            },
            "wall_s": round(time.monotonic() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
