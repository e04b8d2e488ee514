"""What the proxy's hand-written retry loop, metrics registry and HTTP client cost next to the maintained libraries.

Run: ``PYTHONPATH=<dir with stamina> python benchmarks/proxy_libraries.py [metrics] [retry] [client]
[--against DIR] [--quick]`` (all three parts when none is named). Prints ONE JSON object on stdout.

- Metrics: the updates one proxied call makes (``_finish``: the outcome counter, three latency histograms, the
  generated-tokens counter) with :mod:`aglverl.metrics` and with ``prometheus_client`` (its own
  ``CollectorRegistry``, the same names, labels and buckets), and rendering the proxy's series as ``/metrics``.
- Retry: the cost per call of the retry machinery when the first try succeeds (the common case: it runs on
  every call) — the proxy's own loop over :class:`~aglverl.proxy.RetryPolicy` and ``stamina.retry_context``
  (and ``tenacity.AsyncRetrying``, which stamina wraps), each around the same awaited no-op try, on one asyncio
  loop; and a call whose first try fails once (``wait_initial=0``: the machinery, not the backoff).

- Client: the proxy's HTTP/1.1 client to its backends (:class:`~aglverl.proxy.upstream.Upstream`) and
  ``aiohttp.ClientSession`` (as the proxy used it: no cookies, nothing decompressed), each making ``CLIENT_CALLS``
  calls in a row to a :class:`~aglverl.testing.MockVLLM` in a child process (so that this process's CPU clock
  counts the client only): a JSON answer of 256 tokens with their ids and log-probs (25 kB, what a recorded call
  gets), and streams of 64 SSE events (per event); in turn, ``CLIENT_ROUNDS`` rounds, the median. With
  ``--against DIR`` (``git archive REV aglverl | tar -x -C DIR``), the client of that tree too
  (``upstream_against``: its ``aglverl/proxy/upstream.py``, loaded on its own), in the same rounds.

Libraries that are not importable are reported as such.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import timeit
from collections.abc import Awaitable, Callable
from typing import Any

from _common import run_loop

from aglverl.metrics import LATENCY_BUCKETS, Registry
from aglverl.proxy import RetryPolicy

CALLS = 20_000
#: Calls each client makes per round, and the rounds (in turn).
CLIENT_CALLS = 500
CLIENT_ROUNDS = 3
#: The mock backend, in a child process: prints its URL, serves until its stdin closes.
_MOCK = """
import asyncio, sys
from aglverl.testing import MockVLLM
async def main():
    async with MockVLLM(completion_tokens=256, record_requests=False) as mock:
        print(mock.url, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


class _Unreachable(Exception):
    pass


def _best_us(fn: Callable[[], object], number: int | None = None, repeat: int = 5) -> float:
    number = number or CALLS
    return round(min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6, 3)


# ---------------------------------------------------------------------------------------------- metrics
def metrics() -> dict[str, Any]:
    r = Registry()
    calls = r.counter("aglverl_proxy_calls_total", "calls", ["outcome"])
    generated = r.counter("aglverl_proxy_generated_tokens_total", "tokens")
    hists = [r.histogram(f"aglverl_proxy_{n}_seconds", n) for n in ("upstream", "first_byte", "added")]
    for i in range(14):  # the proxy registers 20 series in all
        r.counter(f"aglverl_proxy_other_{i}_total", "other")

    def ours() -> None:
        calls.inc(1, "ok")
        for h in hists:
            h.observe(0.0123)
        generated.inc(256)

    out: dict[str, Any] = {
        "aglverl.metrics": {"us_per_call_updates": _best_us(ours), "us_per_render": _best_us(r.render, 2000)}
    }
    try:
        import prometheus_client as pc
    except ImportError:
        out["prometheus_client"] = "not installed"
        return out
    reg = pc.CollectorRegistry()
    p_calls = pc.Counter("aglverl_proxy_calls", "calls", ["outcome"], registry=reg)
    p_generated = pc.Counter("aglverl_proxy_generated_tokens", "tokens", registry=reg)
    p_hists = [
        pc.Histogram(f"aglverl_proxy_{n}_seconds", n, buckets=LATENCY_BUCKETS, registry=reg)
        for n in ("upstream", "first_byte", "added")
    ]
    for i in range(14):
        pc.Counter(f"aglverl_proxy_other_{i}", "other", registry=reg)
    ok = p_calls.labels("ok")

    def theirs() -> None:
        p_calls.labels("ok").inc()
        for h in p_hists:
            h.observe(0.0123)
        p_generated.inc(256)

    def theirs_bound() -> None:  # the label child looked up once, as a careful caller would
        ok.inc()
        for h in p_hists:
            h.observe(0.0123)
        p_generated.inc(256)

    out["prometheus_client"] = {
        "version": importlib.metadata.version("prometheus_client"),
        "us_per_call_updates": _best_us(theirs),
        "us_per_call_updates_label_bound_once": _best_us(theirs_bound),
        "us_per_render": _best_us(lambda: pc.generate_latest(reg), 2000),
    }
    return out


# ---------------------------------------------------------------------------------------------- retry
async def _per_call_us(run: Callable[[], Awaitable[object]], calls: int | None = None) -> float:
    calls = calls or CALLS
    for _ in range(min(500, calls)):
        await run()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            await run()
        best = min(best, time.perf_counter() - started)
    return round(best / calls * 1e6, 3)


def _with_stamina(
    try_once: Callable[[], Awaitable[int]], policy: RetryPolicy
) -> Callable[[], Awaitable[int]]:
    import stamina

    async def run() -> int:
        async for attempt in stamina.retry_context(
            on=_Unreachable,
            attempts=policy.attempts,
            timeout=policy.total_timeout,
            wait_initial=0.0,
            wait_max=policy.backoff_max,
            wait_jitter=0.0,
        ):
            with attempt:
                return await try_once()
        raise AssertionError("unreachable")

    return run


def _with_tenacity(
    try_once: Callable[[], Awaitable[int]], policy: RetryPolicy
) -> Callable[[], Awaitable[int]]:
    import tenacity

    async def run() -> int:
        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(_Unreachable),
            stop=tenacity.stop_after_attempt(policy.attempts),
            reraise=True,
        ):
            with attempt:
                return await try_once()
        raise AssertionError("unreachable")

    return run


async def retry() -> dict[str, Any]:
    policy = RetryPolicy()
    failures = {"left": 0}

    async def try_once() -> int:
        if failures["left"]:
            failures["left"] -= 1
            raise _Unreachable
        return 200

    async def bare() -> int:
        return await try_once()

    async def ours() -> int:  # the shape of the proxy's Relay.attempts, backend picking left out
        deadline = time.monotonic() + policy.total_timeout
        failure: Exception | None = None
        for attempt in range(policy.attempts):
            if attempt:
                delay = 0.0 * policy.backoff(attempt)  # wait_initial=0 below: the machinery, not the wait
                if time.monotonic() + delay > deadline:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
            try:
                return await try_once()
            except _Unreachable as exc:
                failure = exc
        raise RuntimeError("all tries failed") from failure

    async def fail_once(run: Callable[[], Awaitable[int]]) -> int:
        failures["left"] = 1
        return await run()

    base = await _per_call_us(bare)

    async def row(package: str | None, run: Callable[[], Awaitable[int]]) -> dict[str, Any]:
        """What ``run`` adds to the bare try, when it succeeds and when one try fails first."""
        version = {"version": importlib.metadata.version(package)} if package else {}
        return {
            **version,
            "us_added_per_call": round(await _per_call_us(run) - base, 3),
            "us_added_per_call_one_failure": round(await _per_call_us(lambda: fail_once(run)) - base, 3),
        }

    out: dict[str, Any] = {"bare_try_us": base, "proxy_loop": await row(None, ours)}
    for package, wrap in (("stamina", _with_stamina), ("tenacity", _with_tenacity)):
        try:
            run = wrap(try_once, policy)
        except ImportError:
            out[package] = "not installed"
        else:
            out[package] = await row(package, run)
    return out


def _upstream_of(tree: str) -> Any:
    """The ``Upstream`` class of the aglverl in ``tree``, its module loaded under a name of its own (it imports
    nothing of aglverl's)."""
    path = os.path.join(tree, "aglverl", "proxy", "upstream.py")
    spec = importlib.util.spec_from_file_location("_upstream_against", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--against {tree}: no {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.Upstream


async def client(against: str | None = None) -> dict[str, Any]:
    import aiohttp
    import orjson

    from aglverl.proxy.upstream import Upstream

    mock = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _MOCK, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert mock.stdout is not None and mock.stdin is not None
    url = (await mock.stdout.readline()).decode().strip()
    target = "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    asked = {"model": "mock", "messages": [{"role": "user", "content": "Tell me a story."}]}
    whole = orjson.dumps({**asked, "max_tokens": 256, "logprobs": True, "return_token_ids": True})
    stream = orjson.dumps({**asked, "max_tokens": 64, "stream": True})
    upstream = Upstream(keepalive=30.0, connect_timeout=5.0, request_timeout=60.0)
    upstreams = {"upstream": upstream}
    if against is not None:
        upstreams["upstream_against"] = _upstream_of(against)(
            keepalive=30.0, connect_timeout=5.0, request_timeout=60.0
        )
    session = aiohttp.ClientSession(
        auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",)
    )

    def ours(client: Any) -> Callable[[bytes], Awaitable[int]]:
        async def run(body: bytes) -> int:
            response = await client.request("POST", url, target, headers.items(), body)
            size = 0
            while data := await response.readany():
                size += len(data)
            return size

        return run

    async def theirs(body: bytes) -> int:
        async with session.post(url + target, data=body, headers=headers) as response:
            size = 0
            while data := await response.content.readany():
                size += len(data)
            return size

    clients = {name: ours(c) for name, c in upstreams.items()}
    clients["aiohttp"] = theirs
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in clients}
    try:
        for _ in range(CLIENT_ROUNDS):
            for name, run in clients.items():
                for kind, body, units in (("json", whole, 1), ("stream", stream, 64)):
                    for _ in range(10):  # warm: connections made, paths taken once
                        await run(body)
                    cpu = time.thread_time()
                    for _ in range(CLIENT_CALLS):
                        await run(body)
                    per = (time.thread_time() - cpu) / (CLIENT_CALLS * units) * 1e6
                    runs[name].setdefault(kind, []).append(per)
    finally:
        await session.close()
        for each in upstreams.values():
            await each.close()
        mock.stdin.close()
        await mock.wait()
    out: dict[str, Any] = {
        "calls_per_round": CLIENT_CALLS,
        "rounds": CLIENT_ROUNDS,
        "aiohttp_version": importlib.metadata.version("aiohttp"),
        "httptools_version": importlib.metadata.version("httptools"),
    }
    if against is not None:
        out["against"] = against
    for name, kinds in runs.items():
        out[name] = {
            "us_cpu_per_json_call": round(statistics.median(kinds["json"]), 1),
            "us_cpu_per_sse_event": round(statistics.median(kinds["stream"]), 2),
        }
    return out


PARTS = ("metrics", "retry", "client")


def main() -> None:
    global CALLS, CLIENT_CALLS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"{', '.join(PARTS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="a hundredth of the calls (a smoke run)")
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="also measure the HTTP client of the aglverl in DIR (git archive REV)",
    )
    args = parser.parse_args()
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"no such part: {', '.join(sorted(unknown))} (parts: {', '.join(PARTS)})")
    if args.quick:
        CALLS //= 100
        CLIENT_CALLS //= 50
    parts = args.parts or PARTS
    started = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "the proxy's retry loop, metrics registry and HTTP client vs maintained libraries (per-call cost)"
    }
    if "metrics" in parts:
        result["metrics"] = metrics()
    if "retry" in parts:
        result["retry"] = run_loop(retry)
    if "client" in parts:
        result["client"] = run_loop(client, os.path.abspath(args.against) if args.against else None)
    result["run_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
