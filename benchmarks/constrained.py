"""Cost per generated token of constrained decoding (tool_choice "required") on the embedded engine.

Runs the tiny model in-process through :meth:`InferenceServer.generate_ids`-equivalent HTTP-free calls of the
engine, the same prompts with and without the Hermes structural tag, and prints JSON: seconds per generated
token for each (engine busy time / generated tokens), the grammar compile time, and the ratio. Run it on a quiet
machine (``python benchmarks/constrained.py --requests 32``); ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from _common import run_loop

from aglverl.engine.chat_template import ChatTemplate
from aglverl.engine.constrained import hermes_structural_tag
from aglverl.engine.server import InferenceServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    }
]


async def _run(
    server: InferenceServer, prompt: list[int], requests: int, constrained: bool
) -> dict[str, float]:
    structured = {"structural_tag": hermes_structural_tag(TOOLS, "required")} if constrained else None
    before = server.engine.stats.generated_tokens, server.engine.stats.busy_seconds
    compile_seconds = 0.0
    constraints = []
    if structured is not None:
        started = time.perf_counter()
        constraints = [server.constraints.constraint(structured) for _ in range(requests)]
        compile_seconds = (time.perf_counter() - started) / requests
    from aglverl.engine.generation import GenSequence, SamplingParams

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    left = requests

    def notify(seq: GenSequence, count: int) -> None:
        nonlocal left
        if seq.finished:
            left -= 1
            if left == 0:
                done.set()

    params = SamplingParams(max_tokens=120, temperature=1.0, seed=None)
    seqs = [
        GenSequence(
            prompt, params, loop=loop, notify=notify, constraint=constraints[i] if constraints else None
        )
        for i in range(requests)
    ]
    started = time.perf_counter()
    server.engine.submit(seqs)
    await done.wait()
    wall = time.perf_counter() - started
    tokens = server.engine.stats.generated_tokens - before[0]
    busy = server.engine.stats.busy_seconds - before[1]
    return {
        "generated_tokens": tokens,
        "wall_seconds": wall,
        "busy_seconds_per_token": busy / max(tokens, 1),
        "compile_seconds_per_request": compile_seconds,
    }


async def main(requests: int) -> None:
    async with InferenceServer("tiny", served_model_name="tiny", seed=0) as server:
        prompt = ChatTemplate(server.tokenizer).render([{"role": "user", "content": "Weather?"}], tools=TOOLS)
        await _run(server, prompt, 2, True)  # warm-up: tokenizer wrap, first grammar
        plain = await _run(server, prompt, requests, False)
        constrained = await _run(server, prompt, requests, True)
    ratio = constrained["busy_seconds_per_token"] / plain["busy_seconds_per_token"]
    print(
        json.dumps(
            {
                "requests": requests,
                "batch": requests,
                "library": "llguidance",
                "unconstrained": plain,
                "constrained": constrained,
                "cost_ratio_per_token": ratio,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a smoke run (4 requests)")
    args = parser.parse_args()
    run_loop(main, 4 if args.quick else args.requests)
