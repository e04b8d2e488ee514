"""Embedded inference server throughput against ``model.generate``, the in-process ceiling. Prints one JSON object.

For each concurrency C (default 1, 8, 32): C clients (aiohttp, in this process, over loopback HTTP) each send
``--requests`` chat completions back to back, every one asking for exactly ``--max-tokens`` tokens
(``ignore_eos``, temperature 1) so the work per request is fixed; the server's figure is generated tokens per
wall-clock second over the whole run. The ceiling is ``model.generate`` in the same process on a batch of C
copies of the same prompt, sampling the same number of tokens (``min_new_tokens`` = ``max_new_tokens``): what
the model alone does at that batch size with no HTTP, no scheduling and no detokenization. ``ratio`` is
server / ceiling (target >= 0.8 at each concurrency), the median over ``--repeats`` back-to-back pairs.

Both sides run with the same torch thread count (``--torch-threads``, process-wide; default: torch's) and the
same weights (the built-in tiny model unless ``--model``), after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import aiohttp
import anyio
import orjson
import torch
from _common import run_loop

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import machine_info, summary_ms

from aglverl import InferenceServer

PROMPT = [{"role": "user", "content": "Count from one to ten, then say yes."}]


async def clients(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """``concurrency`` clients x ``requests`` chat calls; tokens/s over the run and per-request latency."""
    body = orjson.dumps(
        {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
    )
    latencies: list[float] = []
    tokens = 0
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as http:

        async def client() -> None:
            nonlocal tokens
            for _ in range(requests):
                t0 = time.perf_counter()
                async with http.post(f"{url}/v1/chat/completions", data=body, headers=headers) as resp:
                    answer = orjson.loads(await resp.read())
                if resp.status != 200:
                    raise RuntimeError(f"server answered {resp.status}: {answer}")
                latencies.append(time.perf_counter() - t0)
                tokens += answer["usage"]["completion_tokens"]

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(client)
        wall = time.perf_counter() - started
    return {
        "tokens_per_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "latency_ms": summary_ms(latencies),
    }


def ceiling(server: InferenceServer, batch: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """``model.generate`` on ``batch`` copies of the chat prompt, ``rounds`` times; tokens/s."""
    prompt = server.chat_template.render(PROMPT)
    ids = torch.tensor([prompt] * batch)
    mask = torch.ones_like(ids)
    kwargs = {
        "attention_mask": mask,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_new_tokens": max_tokens,
        "min_new_tokens": max_tokens,
        "pad_token_id": server.tokenizer.pad_token_id,
    }
    with torch.inference_mode():
        server.model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        started = time.perf_counter()
        for _ in range(rounds):
            out = server.model.generate(ids, **kwargs)
        wall = time.perf_counter() - started
    generated = (out.shape[1] - ids.shape[1]) * batch * rounds
    return {"tokens_per_s": generated / wall, "tokens": generated, "wall_s": wall}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Per concurrency, ``--repeats`` pairs of (server run, ceiling run) back to back.

    Pairing matters on a shared machine: a pair sees the same background load, so the median of the pairs'
    ratios is the figure to trust; the best server and ceiling runs are reported beside it.
    """
    server = InferenceServer(
        args.model,
        max_batch_size=args.max_batch_size,
        batch_wait=args.batch_wait_ms / 1000,
        torch_threads=args.torch_threads,
        seed=0,
    )
    results: dict[str, Any] = {}
    async with server:
        await clients(server.url, server.served_model_name, 2, 2, 8)  # warm-up: connections, shapes
        for c in args.concurrency:
            pairs = []
            for _ in range(args.repeats):
                before = server.stats()
                run = await clients(server.url, server.served_model_name, c, args.requests, args.max_tokens)
                run["engine"] = _engine_delta(before, server.stats(), run["wall_s"])
                pairs.append((run, ceiling(server, c, args.max_tokens, args.requests)))
            results[str(c)] = _summary(pairs)
    return results


def _engine_delta(before: Any, after: Any, wall: float) -> dict[str, Any]:
    steps = after.decode_steps - before.decode_steps
    return {
        "prefill_batches": after.prefill_batches - before.prefill_batches,
        "decode_steps": steps,
        "mean_batch": round((after.generated_tokens - before.generated_tokens) / max(steps, 1), 2),
        "engine_busy_share": round((after.busy_seconds - before.busy_seconds) / wall, 3),
    }


def _summary(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    ratios = sorted(s["tokens_per_s"] / c["tokens_per_s"] for s, c in pairs)
    best = max(pairs, key=lambda p: p[0]["tokens_per_s"])[0]
    return {
        "ratio": round(ratios[len(ratios) // 2], 3),
        "server_tokens_per_s": round(best["tokens_per_s"], 1),
        "ceiling_tokens_per_s": round(max(c["tokens_per_s"] for _, c in pairs), 1),
        "pairs_tokens_per_s": [(round(s["tokens_per_s"]), round(c["tokens_per_s"])) for s, c in pairs],
        "request_latency_ms": best["latency_ms"],
        "engine": best["engine"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument(
        "--quick", action="store_true", help="concurrency 1 and 2, one request, 8 tokens (a smoke run)"
    )
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.max_tokens, args.repeats = [1, 2], 1, 8, 1
    results = run_loop(measure, args)
    target = 0.8
    out = {
        "benchmark": "inference",
        "config": vars(args),
        "torch_threads": torch.get_num_threads(),
        "results": results,
        "target_ratio": target,
        "met": all(r["ratio"] >= target for r in results.values()),
        "machine": machine_info(),
    }
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
