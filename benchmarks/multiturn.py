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
- **Chat** (``--chat-steps``; token-in chat, ``aglverl.proxy.tokenin``): the demo's multiturn agent, an ordinary
  openai SDK chat agent that echoes the text it got (no ids kept), a tool message as a user turn after each of
  its three answers, trained with ``AsyncVERL`` (``trajectory: merge``) under the tiny model's plain template and a copy whose
  template trims every message (Llama 3's way, ``aglverl.testing.chat_templates``), token-in on and off in the
  same run: the drift rate (target 0 with token-in), rows per rollout, trainer tokens per rollout, seconds per
  step, and the proxy's token-in counters. ``--rollout vllm`` trains on verl's vLLM rollout instead of the
  embedded engine (run it with the vLLM tier's venv).
- **Proxy** (``--proxy-turns``, default 2 8 32): what token-in costs per call as the conversation grows,
  without training: a mock vLLM backend (or ``--proxy-backend URL``, a ``vllm serve``), and proxies in front of
  it in their own processes: token-in on, off (the text relay), and with ``--against DIR`` the token-in of an
  older aglverl (``git archive REV aglverl`` extracted in DIR; its render + generate + derender path needs
  ``--enable-scale-out``). ``--conversations`` conversations of T turns each are played up to turn T-1 (each
  mode its own), then their call T is sent ``--repeats`` rounds, every mode in turn in each round (the order
  rotating), next to the same call sent straight to the backend's chat endpoint (``direct``): per mode the
  latency the agent sees, the requests that reached the backend per call (vLLM's ``http_requests_total``, by
  route) and the proxy process's CPU per call (``/proc``), for each T. Target: one request per call, token-in's
  median within max(3 ms, 10 %) of the text relay's, flat in T.
- **Learning** (``--learn-steps``, 0 to skip; ``--seeds``): ``aglverl demo --task multiturn`` (3 turns, chat
  messages the agent echoes as text) under each trajectory, merged (token-in) and ``per_call``, a few seeds
  each: the reward per step, the time to ``--target``, the drift rate and the trainer tokens per rollout.

Targets (8 turns): at least 4x fewer trainer tokens and at least 2x less time per step with ``merge``; drift 0
with token-in; the proxy's cost per call flat in the turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from _common import run_loop

HERE = Path(__file__).resolve().parent
SCRIPT = str(Path(__file__).resolve())
sys.path.insert(0, str(HERE))

from _common import JsonChild, child_args, emit, machine_info, percentile, stdin_commands  # noqa: E402

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
    from aglverl.cli.demo import _openai_client, word_reward

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


CHAT_ANSWER_TOKENS = 8


def _model_with(template: str, logs: Path) -> str:
    """``"tiny"`` for the plain template; else a copy of the tiny model with ``template`` (under ``logs``)."""
    if template == "plain":
        return "tiny"
    from aglverl.engine.tiny import tiny_model_path
    from aglverl.testing.chat_templates import TEMPLATES, with_chat_template

    target = logs / f"model-{template}"
    if not target.exists():
        with_chat_template(tiny_model_path(), target, TEMPLATES[template])
    return str(target)


def child(
    kind: str, turns: int, trajectory: str, steps: int, prompts: int, n: int, extra: dict[str, Any]
) -> None:
    """Train one variant; one JSON line per step on stdout, then ``{"done": ...}``."""
    import ray
    from transformers import AutoTokenizer

    from aglverl.algorithm import AsyncVERL
    from aglverl.cli.demo import TASKS, demo_config, demo_samples
    from aglverl.engine.tiny import tiny_model_path

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = time.monotonic()
    if kind == "learn":
        config = demo_config(steps, task="multiturn", trajectory=trajectory)
        seed = int(extra.get("seed", 0))
        config["data"]["seed"] = seed
        config["actor_rollout_ref"]["rollout"]["seed"] = seed
        config["actor_rollout_ref"]["actor"]["fsdp_config"] = {"seed": seed}
        agent = TASKS["multiturn"][0]
    elif kind == "chat":
        config = demo_config(
            steps, model=extra["model"], task="multiturn", trajectory="merge", prompts=prompts
        )
        config["data"].update({"max_prompt_length": 256, "max_response_length": 256})
        config["actor_rollout_ref"]["rollout"]["n"] = n
        config["aglverl"]["token_in"] = bool(extra["token_in"])
        if extra.get("rollout") == "vllm":
            config["actor_rollout_ref"]["rollout"]["name"] = "vllm"
        agent = TASKS["multiturn"][0]  # the demo's: an openai SDK agent that echoes text, no ids kept
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
    run_loop(algo.run, demo_samples(64))
    sys.stdout.buffer.write(orjson.dumps({"done": time.monotonic() - started}) + b"\n")


def summarize_chat(rows: list[dict[str, Any]], rollouts_per_step: int) -> dict[str, Any]:
    timed = rows[1:] or rows
    calls = _sum(rows, "batch/n_calls")
    names = [k for k in rows[-1]["metrics"] if k.startswith("proxy/token_in_")]
    totals = {k: _sum(rows, k) for k in names}  # proxy/* are per step: the run's are their sums
    counters = {k.removeprefix("proxy/token_in_"): v for k, v in totals.items() if v}
    return {
        "steps": len(rows),
        "drift_rate": round(_sum(rows, "batch/n_calls_drifted") / calls, 4) if calls else None,
        "rows_per_rollout": round(_sum(rows, "step/n_rows") / (len(rows) * rollouts_per_step), 3),
        "calls_per_rollout": round(calls / (len(rows) * rollouts_per_step), 3),
        "trainer_tokens_per_rollout": round(
            statistics.mean(r["metrics"]["step/trainer_tokens_per_rollout"] for r in rows), 1
        ),
        "per_call_tokens_per_rollout": round(
            statistics.mean(r["metrics"]["step/trainer_tokens_per_rollout_per_call"] for r in rows), 1
        ),
        "seconds_per_step": round(statistics.median(r["metrics"]["timing_s/step"] for r in timed), 3),
        "token_in_calls": counters,
        "reward": [round(r["metrics"].get("training/reward", 0.0), 3) for r in rows],
    }


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


# ---------------------------------------------------------------------------------------------- proxy cost
PROXY_SYSTEM = "You are a careful assistant. Use the tools when they help, answer in one word otherwise. "
PROXY_RESULT = "value 42, unit none, status ok, source cache, fetched from the primary store; "
#: The plain chat call straight to the backend (no proxy), timed in the same rotation as the proxies.
DIRECT = "direct"


async def _proxy_child(cfg: dict[str, Any]) -> None:
    """A benchmark child: a mock backend (``role: mock``) or a proxy (``role: proxy``) that claims rollouts on
    command (``{"claim": n}`` -> ``{"bases": [...], "token_in": {outcome: calls}}``); it leaves when its stdin
    closes. A proxy child may run an older aglverl (``PYTHONPATH``): the store's module moved in 5ae6905."""
    import anyio

    if cfg["role"] == "mock":
        from aglverl.testing import MockVLLM

        async with MockVLLM(
            completion_tokens=CHAT_ANSWER_TOKENS,
            record_requests=False,
            max_model_len=1 << 16,
            tokenizer=cfg.get("tokenizer", True),
        ) as mock:
            emit({"url": mock.url})
            async for _ in stdin_commands():
                pass
        return
    from aglverl.proxy import LLMProxy
    from aglverl.store import TaskStore  # a module before the house was regrouped (046b5eb), a package since

    store = TaskStore(lease_seconds=3600)
    proxy = LLMProxy(store, backends=[cfg["backend"]], token_in=cfg["token_in"])
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        emit({"url": proxy.url})
        async for command in stdin_commands():
            bases = []
            for i in range(int(command["claim"])):
                store.enqueue({"i": i})
                task = store.try_claim()
                assert task is not None and task.attempt_id is not None
                bases.append(proxy.llm_resource(cfg["model"]).get_base_url(task.rollout_id, task.attempt_id))
            outcomes = {}
            if proxy.token_in is not None:
                from aglverl.proxy.tokenin import OUTCOMES

                outcomes = {o: v for o in OUTCOMES if (v := proxy.token_in.m_calls.value(o))}
            emit({"bases": bases, "token_in": outcomes})
        tg.cancel_scope.cancel()


async def _chat_call(
    session: Any, url: str, model: str, messages: list[Any], tokens: int = CHAT_ANSWER_TOKENS
) -> tuple[float, str]:
    body = orjson.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
    )
    started = time.perf_counter()
    async with session.post(
        url + "/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as r:
        raw = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {raw[:300]!r}")
    elapsed = time.perf_counter() - started
    return elapsed, orjson.loads(raw)["choices"][0]["message"].get("content") or ""


async def _backend_requests(session: Any, backend: str) -> dict[str, float] | None:
    """The requests a vLLM backend has answered so far, by route (its ``http_requests_total``); ``None`` for a
    backend that does not count them (the mock)."""
    try:
        async with session.get(backend + "/metrics") as r:
            if r.status != 200:
                return None
            text = await r.text()
    except OSError:
        return None
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            handler = labels.split('handler="', 1)[1].split('"', 1)[0]
            counts[handler] = counts.get(handler, 0.0) + float(value)
    return counts


def _result_text(turn: int, repeat: int) -> str:
    return f"Result {turn}: " + (PROXY_RESULT * repeat if repeat else "ok.")


async def proxy_cost(
    turns_list: list[int],
    conversations: int,
    rounds: int,
    backend: str | None,
    model: str,
    result_repeat: int = 4,
    against: str | None = None,
    answer_tokens: int = CHAT_ANSWER_TOKENS,
) -> dict[str, Any]:
    """The proxy part (see the module docstring): per T, per mode (token-in, the text relay, ``against``'s
    token-in, the plain chat call straight to the backend), interleaved round by round: the later call's
    latency, the requests that reached the backend per call (vLLM's ``http_requests_total``), and the proxy
    process's CPU per call."""
    import aiohttp

    script = SCRIPT
    mock = None
    if backend is None:
        mock = await JsonChild.start(child_args(script, "proxy-child", {"role": "mock"}))
        backend, model = mock.info["url"], "mock"
    wanted: dict[str, tuple[bool, str | None]] = {"token_in": (True, None), "text": (False, None)}
    if against is not None:
        wanted[f"token_in_{Path(against).name}"] = (True, against)
    proxies = {}
    for mode, (token_in, pythonpath) in wanted.items():
        env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
        cfg = {"role": "proxy", "backend": backend, "token_in": token_in, "model": model}
        proxies[mode] = await JsonChild.start(child_args(script, "proxy-child", cfg), env=env)
    out: dict[str, Any] = {"backend": "mock" if mock is not None else backend, "modes": [*proxies, DIRECT]}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for turns in turns_list:
                histories: dict[str, list[list[Any]]] = {}
                bases: dict[str, list[str]] = {}
                for mode, proxy in proxies.items():
                    bases[mode] = (await proxy.request({"claim": conversations}))["bases"]
                    histories[mode] = [[{"role": "system", "content": PROXY_SYSTEM}, {"role": "user", "content": f"Question {i}?"}] for i in range(conversations)]  # fmt: skip
                    for turn in range(turns - 1):  # played, not timed
                        for base, history in zip(bases[mode], histories[mode], strict=True):
                            _, answer = await _chat_call(session, base, model, history, answer_tokens)
                            history += [{"role": "assistant", "content": answer}, {"role": "user", "content": _result_text(turn, result_repeat)}]  # fmt: skip
                bases[DIRECT] = [backend + "/v1"] * conversations
                histories[DIRECT] = histories["text"]
                modes = [*proxies, DIRECT]
                for mode in modes:  # warm-up, not timed: a proxy's first such call reads the template once
                    for base, history in zip(bases[mode], histories[mode], strict=True):
                        await _chat_call(session, base, model, history, answer_tokens)
                latency: dict[str, list[float]] = {m: [] for m in modes}
                cpu = dict.fromkeys(proxies, 0.0)
                reached: dict[str, dict[str, float]] = {m: {} for m in modes}
                for r in range(rounds):  # interleaved: each round every mode in turn, the order rotating
                    for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                        before = await _backend_requests(session, backend)
                        spent = proxies[mode].cpu_seconds() if mode in proxies else 0.0
                        for base, history in zip(bases[mode], histories[mode], strict=True):
                            call = await _chat_call(session, base, model, history, answer_tokens)
                            latency[mode].append(call[0])
                        if mode in proxies:
                            cpu[mode] += proxies[mode].cpu_seconds() - spent
                        after = await _backend_requests(session, backend)
                        if before is not None and after is not None:
                            for handler, n in after.items():
                                if n - before.get(handler, 0.0):
                                    reached[mode][handler] = reached[mode].get(handler, 0.0) + n - before.get(handler, 0.0)  # fmt: skip
                row: dict[str, Any] = {}
                calls = conversations * rounds
                for mode in modes:
                    per_call = {h: round(n / calls, 3) for h, n in sorted(reached[mode].items())}
                    row[mode] = {
                        "latency_ms_p50": round(percentile(latency[mode], 50) * 1000, 3),
                        "latency_ms_p90": round(percentile(latency[mode], 90) * 1000, 3),
                        "latency_ms_mean": round(statistics.mean(latency[mode]) * 1000, 3),
                        "requests_per_call": per_call or None,
                    }
                    if mode in proxies:
                        row[mode]["proxy_cpu_ms_per_call"] = round(cpu[mode] / calls * 1000, 3)
                        row[mode]["token_in_calls_so_far"] = (await proxies[mode].request({"claim": 0}))["token_in"]  # fmt: skip
                text_p50 = row["text"]["latency_ms_p50"]
                allowed = max(3.0, 0.1 * text_p50)
                row["token_in_extra_ms_p50"] = round(row["token_in"]["latency_ms_p50"] - text_p50, 3)
                row["token_in_extra_cpu_ms"] = round(
                    row["token_in"]["proxy_cpu_ms_per_call"] - row["text"]["proxy_cpu_ms_per_call"], 3
                )
                row["target_ms"] = round(allowed, 3)
                row["target_met"] = row["token_in_extra_ms_p50"] <= allowed
                text_cpu = row["text"]["proxy_cpu_ms_per_call"]
                row["cpu_target_ms"] = round(max(3.0, 0.1 * text_cpu), 3)
                row["cpu_target_met"] = row["token_in_extra_cpu_ms"] <= row["cpu_target_ms"]
                out[f"{turns}_turns"] = row
    finally:
        for child_ in [*proxies.values(), *([mock] if mock is not None else [])]:
            await child_.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="cost", choices=["cost", "learn", "chat"], help=argparse.SUPPRESS)
    parser.add_argument("--trajectory", default="merge", help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--parts", nargs="+", default=["cost", "chat", "proxy", "learn"], choices=["cost", "chat", "proxy", "learn"])  # fmt: skip
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--cost-steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step in the cost and chat runs")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt in the cost and chat runs")
    parser.add_argument("--chat-steps", type=int, default=4)
    parser.add_argument(
        "--chat-templates", nargs="+", default=["plain", "trim"], choices=["plain", "trim", "think"]
    )
    parser.add_argument(
        "--rollout", default="embedded", choices=["embedded", "vllm"], help="the chat runs' engine"
    )
    parser.add_argument("--proxy-turns", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--conversations", type=int, default=16, help="conversations per T in the proxy part")
    parser.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="rounds: timed sends of each conversation's last call per mode",
    )
    parser.add_argument(
        "--against",
        default=None,
        help="a directory holding an older aglverl (git archive REV aglverl): its token-in too",
    )
    parser.add_argument(
        "--result-repeat", type=int, default=4, help="tool result length per turn (x 14 words)"
    )
    parser.add_argument(
        "--proxy-backend",
        default=None,
        help="a vLLM URL instead of the mock (--enable-scale-out for --against)",
    )
    parser.add_argument("--model-name", default="tiny", help="the served model's name at --proxy-backend")
    parser.add_argument(
        "--proxy-answer-tokens",
        type=int,
        default=CHAT_ANSWER_TOKENS,
        help="max_tokens of the proxy part's calls",
    )
    parser.add_argument("--learn-steps", type=int, default=20, help="steps of the multiturn demo (0: skip)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per trajectory in the learning runs")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--logs", default="/tmp/aglverl-bench-multiturn")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the proxy part alone, 2 turns, 2 conversations, 2 rounds (a smoke run)",
    )
    args = parser.parse_args()
    if args.quick:
        args.parts, args.proxy_turns, args.conversations, args.repeats = ["proxy"], [2], 2, 2
    if args.child is not None:
        if args.child[:1] == ["proxy-child"]:
            run_loop(_proxy_child, orjson.loads(args.child[1]))
            return
        extra = orjson.loads(args.extra)
        child(args.kind, args.turns[0], args.trajectory, args.cost_steps, args.prompts, args.n, extra)
        return
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cost: dict[str, Any] = {}
    for turns in args.turns if "cost" in args.parts else ():
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
    chat: dict[str, Any] = {}
    for template in args.chat_templates if "chat" in args.parts else ():
        model = _model_with(template, logs)
        runs = {}
        for token_in in (True, False):
            extra = {"model": model, "token_in": token_in, "rollout": args.rollout}
            common = ["--kind", "chat", "--cost-steps", str(args.chat_steps)]
            common += [
                "--prompts",
                str(args.prompts),
                "--n",
                str(args.n),
                "--extra",
                orjson.dumps(extra).decode(),
            ]
            name = f"chat-{template}-{'token_in' if token_in else 'text'}"
            rows = run_child(common, logs / f"{name}.log")
            runs["token_in" if token_in else "text"] = summarize_chat(rows, args.prompts * args.n)
        chat[template] = runs
    proxy: dict[str, Any] = {}
    if "proxy" in args.parts:
        proxy = run_loop(
            proxy_cost,
            args.proxy_turns,
            args.conversations,
            args.repeats,
            args.proxy_backend,
            args.model_name,
            args.result_repeat,
            args.against,
            args.proxy_answer_tokens,
        )
    learning: dict[str, Any] = {}
    if args.learn_steps and "learn" in args.parts:
        for trajectory in ("merge", "per_call"):
            runs_ = []
            for seed in range(args.seeds):
                common = [
                    "--kind",
                    "learn",
                    "--trajectory",
                    trajectory,
                    "--cost-steps",
                    str(args.learn_steps),
                ]
                common += ["--extra", orjson.dumps({"seed": seed}).decode()]
                rows = run_child(common, logs / f"learn-{trajectory}-seed{seed}.log")
                runs_.append(summarize_learning(rows, args.target))
            finals = [r["rewards"][-1] for r in runs_]
            learning[trajectory] = {
                "seeds": runs_,
                "final_reward_mean": round(statistics.mean(finals), 3),
                "final_reward_stdev": round(statistics.stdev(finals), 3) if len(finals) > 1 else 0.0,
                "trainer_tokens_per_rollout_mean": round(
                    statistics.mean(r["trainer_tokens_per_rollout"] for r in runs_), 1
                ),
                "drift_rate_mean": round(statistics.mean(r["drift_rate"] for r in runs_), 4),
            }
    widest = cost.get(f"{max(args.turns)}_turns", {})
    emit(
        {
            "benchmark": "multiturn",
            "machine": machine_info(),
            "settings": {
                "parts": args.parts,
                "chat_steps": args.chat_steps,
                "chat_templates": args.chat_templates,
                "rollout": args.rollout,
                "proxy_turns": args.proxy_turns,
                "conversations": args.conversations,
                "repeats": args.repeats,
                "result_repeat": args.result_repeat,
                "against": args.against,
                "proxy_answer_tokens": args.proxy_answer_tokens,
                "seeds": args.seeds,
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
            "chat": chat,
            "proxy": proxy,
            "learning": learning,
            "targets": {
                "tokens_ratio_at_least": TARGET_TOKENS_RATIO,
                "step_speedup_at_least": TARGET_STEP_SPEEDUP,
                "turns": max(args.turns),
                "tokens_ratio_met": widest.get("tokens_ratio", 0.0) >= TARGET_TOKENS_RATIO,
                "step_speedup_met": widest.get("step_speedup", 0.0) >= TARGET_STEP_SPEEDUP,
                "token_in_drift_zero": all(r["token_in"]["drift_rate"] == 0 for r in chat.values())
                if chat
                else None,
            },
            "wall_s": round(time.monotonic() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
