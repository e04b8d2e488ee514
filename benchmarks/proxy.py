"""Latency, throughput and CPU cost the LLM proxy adds over calling the backend directly.

Run: ``python benchmarks/proxy.py [--quick] [--proxy-uvloop] [--against DIR]``. Prints ONE JSON object on
stdout.

Separate processes, so each CPU figure belongs to one program:
- a :class:`~aglverl.testing.MockVLLM` backend (zero latency, 16 completion tokens, nothing recorded);
- an :class:`~aglverl.proxy.LLMProxy` in front of it, with its own :class:`~aglverl.store.tasks.TaskStore` holding
  claimed rollouts, so every proxied call takes the real path (attribution check, ``return_token_ids``
  injection, token capture, one ``LLMCall`` recorded per call);
- the floor: a bare aiohttp pass-through (one handler, one ``ClientSession``, nothing else), measured in the
  same sequential run, to tell what any aiohttp hop costs on this machine from what the proxy adds to it;
- this process: the aiohttp load generator, which calls the mock directly, through the proxy and through the
  floor with the same request bytes.

Added latency is ``percentile(proxied) - percentile(direct)`` (sequential calls interleave the targets so all
see the same machine state); time to first byte is measured to the first body chunk of a streamed chat
completion. CPU is read from ``/proc/<pid>/stat`` (utime + stime) around each phase. Every process runs on
uvloop where it is installed (``AGLVERL_LOOP=asyncio``: asyncio's loop; ``--proxy-uvloop`` forces uvloop for the
proxy and the floor).

``--against DIR`` measures only this proxy against another version of it, in the same run: a second proxy
child imports ``aglverl`` from ``DIR`` (e.g. ``git archive <rev> aglverl | tar -x -C DIR``), and sequential calls
and streams' first bytes go to the mock, this proxy and that one in turn, in blocks, so both proxies see the
same machine state; the spread between blocks is the noise the difference is judged against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import orjson
from _common import loop_name, run_loop

#: What the proxy must achieve (ms); the old designs for reference.
TARGETS_MS = {"added_latency_p50_idle": 0.5, "added_ttfb_p50": 1.0}
REFERENCE_MS = {"flask_proxy_added_latency": 5.0, "litellm_proxy_added_latency": 57.0}
COMPLETION_TOKENS = 16
ROLLOUTS = 256  # one per concurrent client at the highest concurrency
BODY = orjson.dumps(
    {
        "model": "mock",
        "messages": [{"role": "user", "content": "Say yes, please."}],
        "max_tokens": COMPLETION_TOKENS,
    }
)
STREAM_BODY = orjson.dumps({**orjson.loads(BODY), "stream": True})
#: The same call in the Responses API and in Anthropic Messages: the proxy translates each into BODY's chat
#: completion, so the backend does the same work and the difference is the translation.
TRANSLATED = {
    "responses": orjson.dumps(
        {"model": "mock", "input": "Say yes, please.", "max_output_tokens": COMPLETION_TOKENS}
    ),
    "messages": orjson.dumps(
        {
            "model": "mock",
            "max_tokens": COMPLETION_TOKENS,
            "messages": [{"role": "user", "content": "Say yes, please."}],
        }
    ),
}
HEADERS = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------------------------------- children
async def _until_terminated() -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


async def _run_mock() -> None:
    from aglverl.testing import MockVLLM

    async with MockVLLM(completion_tokens=COMPLETION_TOKENS, record_requests=False) as mock:
        print(json.dumps({"url": mock.url}), flush=True)
        await _until_terminated()


@asynccontextmanager
async def serving_proxy(
    backend: str, rollouts: int = ROLLOUTS, **options: Any
) -> AsyncIterator[tuple[str, list[str]]]:
    """An LLMProxy (``options``) in front of ``backend`` with ``rollouts`` claimed rollouts; yields its URL and
    their base URLs."""
    from aglverl.proxy import LLMProxy
    from aglverl.store import TaskStore

    store = TaskStore(lease_seconds=3600)
    proxy = LLMProxy(store, backends=[backend], **options)
    if hasattr(proxy, "overload") and "overload" not in options:
        # What a call costs, not whether a machine short of CPU gets it refused: the lag is measured, no call
        # is turned away (a tree from before the overload protection has nothing to turn off).
        proxy.overload.policy = dataclasses.replace(proxy.overload.policy, refuse=False)
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        bases = []
        for i in range(rollouts):
            store.enqueue({"i": i})
            task = store.try_claim()
            assert task is not None and task.attempt_id is not None
            bases.append(proxy.llm_resource("mock").get_base_url(task.rollout_id, task.attempt_id))
        yield proxy.url, bases
        tg.cancel_scope.cancel()


async def _run_proxy(backend: str) -> None:
    import aglverl.proxy

    async with serving_proxy(backend) as (url, bases):
        print(json.dumps({"url": url, "bases": bases, "module": aglverl.proxy.__file__}), flush=True)
        await _until_terminated()


async def _run_bare(backend: str) -> None:
    async with bare_hop(backend) as url:
        print(json.dumps({"url": url}), flush=True)
        await _until_terminated()


#: What a recording proxy adds to a chat call (the floor asks the same, so the backend does the same work).
RECORDED_FIELDS = b',"return_token_ids":true,"logprobs":true}'


@asynccontextmanager
async def bare_hop(backend: str, *, recorded_work: bool = False) -> AsyncIterator[str]:
    """The floor: an aiohttp server that forwards the body to the backend with one ClientSession, nothing else.

    A streamed answer is relayed read by read (each read written at once); with ``recorded_work`` the request
    asks for what a recording proxy asks for (token ids, log-probs), so the floor moves the same bytes."""
    from aiohttp import web

    from aglverl._net import bind_listener, url_of

    # idle connections kept below the backend's own keep-alive (5 s), as the proxy keeps them: a connection the
    # backend is closing is never reused (a hop idle between blocks would otherwise answer 500s)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if recorded_work:
                body = body.rstrip()[:-1] + RECORDED_FIELDS
            url = f"{backend}/v1/{request.match_info['path']}"
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as upstream:
                if upstream.content_length is not None:
                    data = await upstream.read()
                    return web.Response(status=upstream.status, body=data, content_type="application/json")
                content_type = upstream.headers.get("Content-Type", "")
                response = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
                await response.prepare(request)
                while chunk := await upstream.content.readany():
                    await response.write(chunk)
                await response.write_eof()
                return response

        app = web.Application()
        app.router.add_post("/v1/{path:.*}", forward)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        sock = bind_listener("127.0.0.1", 0)
        await web.SockSite(runner, sock).start()
        try:
            yield url_of(sock)
        finally:
            await runner.cleanup()


def _child_main(role: str, backend: str | None, use_uvloop: bool) -> None:
    if role == "mock":
        run_loop(_run_mock)
        return
    assert backend is not None
    run_loop(_run_bare if role == "bare" else _run_proxy, backend, loop="uvloop" if use_uvloop else None)


class Child:
    """A benchmark server in its own process; its first stdout line is a JSON object describing it."""

    def __init__(self, *args: str, pythonpath: str | None = None) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
        env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark child {args} exited before starting")
        self.info: dict[str, Any] = json.loads(line)

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------- load
async def call(session: aiohttp.ClientSession, url: str, body: bytes = BODY) -> float:
    started = time.perf_counter()
    async with session.post(url, data=body, headers=HEADERS) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")
    return time.perf_counter() - started


async def first_byte(session: aiohttp.ClientSession, url: str, body: bytes = STREAM_BODY) -> float:
    started = time.perf_counter()
    async with session.post(url, data=body, headers=HEADERS) as response:
        await response.content.readany()
        elapsed = time.perf_counter() - started
        await response.read()
    return elapsed


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary_ms(samples: list[float]) -> dict[str, float]:
    return {
        "p50": round(pct(samples, 50) * 1e3, 3),
        "p99": round(pct(samples, 99) * 1e3, 3),
        "mean": round(statistics.fmean(samples) * 1e3, 3),
    }


def added_ms(direct: dict[str, float], proxied: dict[str, float]) -> dict[str, float]:
    return {k: round(proxied[k] - direct[k], 3) for k in ("p50", "p99")}


async def alternating(n: int, *targets: Callable[[], Awaitable[float]]) -> list[list[float]]:
    """``n`` calls to each target, interleaved (rotating who goes first) so all see the same machine state."""
    samples: list[list[float]] = [[] for _ in targets]
    for i in range(n):
        for k in range(len(targets)):
            j = (i + k) % len(targets)
            samples[j].append(await targets[j]())
    return samples


async def concurrent(
    session: aiohttp.ClientSession, urls: list[str], clients: int, per_client: int
) -> tuple[list[float], float]:
    latencies: list[float] = []

    async def client(i: int) -> None:
        url = urls[i % len(urls)]
        for _ in range(per_client):
            latencies.append(await call(session, url))

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(clients):
            tg.start_soon(client, i)
    return latencies, time.perf_counter() - started


async def measure(mock: Child, proxy: Child, bare: Child, quick: bool) -> dict[str, Any]:
    direct_url = f"{mock.info['url']}/v1/chat/completions"
    bare_url = f"{bare.info['url']}/v1/chat/completions"
    bases: list[str] = proxy.info["bases"]
    proxied_urls = [f"{b}/chat/completions" for b in bases]
    seq_n, ttfb_n = (300, 150) if quick else (2000, 600)
    per_client = {64: 10 if quick else 40, 256: 4 if quick else 12}
    out: dict[str, Any] = {}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as ds,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as ps,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as bs,
    ):
        await alternating(  # warm-up
            200, lambda: call(ds, direct_url), lambda: call(ps, proxied_urls[0]), lambda: call(bs, bare_url)
        )
        proxy_cpu, mock_cpu, proxied_calls, direct_calls = 0.0, 0.0, 0, 0

        def cpu() -> tuple[float, float]:
            return proxy.cpu_seconds(), mock.cpu_seconds()

        c0, b0 = cpu(), bare.cpu_seconds()
        d, p, b = await alternating(
            seq_n, lambda: call(ds, direct_url), lambda: call(ps, proxied_urls[0]), lambda: call(bs, bare_url)
        )
        c1, b1 = cpu(), bare.cpu_seconds()
        proxy_cpu += c1[0] - c0[0]
        proxied_calls += seq_n
        mock_cpu += c1[1] - c0[1]
        direct_calls += 3 * seq_n  # the mock answered every side
        ds_ms, ps_ms, bs_ms = summary_ms(d), summary_ms(p), summary_ms(b)
        out["sequential"] = {
            "calls": seq_n,
            "direct_ms": ds_ms,
            "proxied_ms": ps_ms,
            "added_ms": added_ms(ds_ms, ps_ms),
            "proxy_cpu_ms_per_request": round((c1[0] - c0[0]) / seq_n * 1e3, 4),
        }
        out["floor_bare_aiohttp_hop"] = {
            "what": "a minimal aiohttp server + ClientSession pass-through in its own process, same sequential run",
            "added_ms": added_ms(ds_ms, bs_ms),
            "cpu_ms_per_request": round((b1 - b0) / seq_n * 1e3, 4),
        }

        for clients in (64, 256):
            k = per_client[clients]
            d, d_wall = await concurrent(ds, [direct_url], clients, k)
            c0 = cpu()
            p, p_wall = await concurrent(ps, proxied_urls, clients, k)
            c1 = cpu()
            proxy_cpu += c1[0] - c0[0]
            proxied_calls += clients * k
            ds_ms, ps_ms = summary_ms(d), summary_ms(p)
            out[f"concurrent_{clients}"] = {
                "calls": clients * k,
                "direct_ms": ds_ms,
                "proxied_ms": ps_ms,
                "added_ms": added_ms(ds_ms, ps_ms),
                "direct_rps": round(len(d) / d_wall, 1),
                "proxied_rps": round(len(p) / p_wall, 1),
                "proxy_cpu_ms_per_request": round((c1[0] - c0[0]) / (clients * k) * 1e3, 4),
            }

        c0 = cpu()
        d, p = await alternating(
            ttfb_n, lambda: first_byte(ds, direct_url), lambda: first_byte(ps, proxied_urls[0])
        )
        c1 = cpu()
        proxy_cpu += c1[0] - c0[0]
        proxied_calls += ttfb_n
        ds_ms, ps_ms = summary_ms(d), summary_ms(p)
        out["stream_first_byte"] = {
            "calls": ttfb_n,
            "tokens_per_stream": COMPLETION_TOKENS,
            "direct_ms": ds_ms,
            "proxied_ms": ps_ms,
            "added_ms": added_ms(ds_ms, ps_ms),
        }
        out["proxy_cpu_ms_per_request_all_phases"] = round(proxy_cpu / proxied_calls * 1e3, 4)
        out["mock_cpu_ms_per_request_sequential"] = round(mock_cpu / direct_calls * 1e3, 4)
    return out


async def measure_one_process(quick: bool) -> dict[str, Any]:
    """The same sequential and first-byte comparisons with client, proxy, floor and mock on ONE event loop.

    Across processes every hop also pays for waking another process (on this 2-vCPU VM about as much as the
    hop's own work); on one loop what remains is the work the proxy does per call.
    """
    from aglverl.testing import MockVLLM

    seq_n, ttfb_n = (300, 150) if quick else (2000, 600)
    async with (
        MockVLLM(completion_tokens=COMPLETION_TOKENS, record_requests=False) as mock,
        serving_proxy(mock.url) as (_, bases),
        bare_hop(mock.url) as bare,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        direct_url, proxied_url = f"{mock.url}/v1/chat/completions", f"{bases[0]}/chat/completions"
        bare_url = f"{bare}/v1/chat/completions"
        targets = (
            lambda: call(session, direct_url),
            lambda: call(session, proxied_url),
            lambda: call(session, bare_url),
        )
        await alternating(200, *targets)  # warm-up
        d, p, b = (summary_ms(x) for x in await alternating(seq_n, *targets))
        fd, fp = (
            summary_ms(x)
            for x in await alternating(
                ttfb_n, lambda: first_byte(session, direct_url), lambda: first_byte(session, proxied_url)
            )
        )
        translated = await measure_translated(session, direct_url, bases[1], seq_n, ttfb_n)
    return {
        "what": "client, proxy, bare hop and mock on one asyncio loop in this process",
        "sequential": {"direct_ms": d, "proxied_ms": p, "added_ms": added_ms(d, p)},
        "floor_bare_aiohttp_hop_added_ms": added_ms(d, b),
        "stream_first_byte": {"direct_ms": fd, "proxied_ms": fp, "added_ms": added_ms(fd, fp)},
        "translated": translated,
    }


async def measure_translated(
    session: aiohttp.ClientSession, direct_url: str, base: str, seq_n: int, ttfb_n: int
) -> dict[str, Any]:
    """Added latency of a chat call, a Responses call and an Anthropic Messages call (same backend work), all
    interleaved against the same direct chat call; then the same for the first byte of their streams."""
    urls = {
        "chat": f"{base}/chat/completions",
        "responses": f"{base}/responses",
        "messages": f"{base}/messages",
    }
    bodies = {"chat": BODY, **TRANSLATED}
    streams = {api: orjson.dumps({**orjson.loads(body), "stream": True}) for api, body in bodies.items()}
    apis = list(urls)
    json_targets = [lambda: call(session, direct_url)]
    json_targets += [lambda api=api: call(session, urls[api], bodies[api]) for api in apis]  # type: ignore[misc]
    ttfb_targets = [lambda: first_byte(session, direct_url)]
    ttfb_targets += [lambda api=api: first_byte(session, urls[api], streams[api]) for api in apis]  # type: ignore[misc]
    await alternating(100, *json_targets, *ttfb_targets)  # warm-up
    direct, *proxied = (summary_ms(x) for x in await alternating(seq_n, *json_targets))
    direct_fb, *proxied_fb = (summary_ms(x) for x in await alternating(ttfb_n, *ttfb_targets))
    return {
        "what": "the same call as chat, Responses and Anthropic Messages through the proxy (attributed, recorded)",
        "direct_chat_ms": direct,
        "added_ms": {api: added_ms(direct, p) for api, p in zip(apis, proxied, strict=True)},
        "stream_first_byte_added_ms": {
            api: added_ms(direct_fb, p) for api, p in zip(apis, proxied_fb, strict=True)
        },
    }


async def measure_against(mock: Child, new: Child, old: Child, quick: bool) -> dict[str, Any]:
    """Added latency of two proxy versions, interleaved call by call, in blocks (see the module docstring)."""
    direct_url = f"{mock.info['url']}/v1/chat/completions"
    new_url, old_url = (f"{c.info['bases'][0]}/chat/completions" for c in (new, old))
    blocks, seq_n, ttfb_n = (3, 200, 100) if quick else (6, 500, 200)
    per_block: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
    per_block_ttfb: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
    cpu = {"new": 0.0, "old": 0.0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        json_targets = [lambda url=url: call(session, url) for url in (direct_url, new_url, old_url)]
        ttfb_targets = [lambda url=url: first_byte(session, url) for url in (direct_url, new_url, old_url)]
        await alternating(200, *json_targets, *ttfb_targets)  # warm-up
        for _ in range(blocks):
            c0 = new.cpu_seconds(), old.cpu_seconds()
            d, n, o = (summary_ms(x) for x in await alternating(seq_n, *json_targets))
            fd, fn, fo = (summary_ms(x) for x in await alternating(ttfb_n, *ttfb_targets))
            c1 = new.cpu_seconds(), old.cpu_seconds()
            cpu["new"] += c1[0] - c0[0]
            cpu["old"] += c1[1] - c0[1]
            per_block["new"].append(added_ms(d, n))
            per_block["old"].append(added_ms(d, o))
            per_block_ttfb["new"].append(added_ms(fd, fn))
            per_block_ttfb["old"].append(added_ms(fd, fo))

    def spread(blocks_ms: list[dict[str, float]]) -> dict[str, Any]:
        return {
            q: {
                "median": round(statistics.median(b[q] for b in blocks_ms), 3),
                "min": min(b[q] for b in blocks_ms),
                "max": max(b[q] for b in blocks_ms),
            }
            for q in ("p50", "p99")
        }

    calls = blocks * (seq_n + ttfb_n)
    return {
        "what": "added latency of this proxy (new) and the one imported from --against (old), same run, "
        "calls interleaved direct/new/old; per block of calls, then median/min/max over blocks",
        "blocks": blocks,
        "calls_per_block": {"json": seq_n, "stream_first_byte": ttfb_n},
        "added_ms": {"new": spread(per_block["new"]), "old": spread(per_block["old"])},
        "stream_first_byte_added_ms": {
            "new": spread(per_block_ttfb["new"]),
            "old": spread(per_block_ttfb["old"]),
        },
        "proxy_cpu_ms_per_call": {k: round(v / calls * 1e3, 4) for k, v in cpu.items()},
        "per_block_added_p50_ms": {k: [b["p50"] for b in v] for k, v in per_block.items()},
    }


def report(results: dict[str, Any], use_uvloop: bool) -> dict[str, Any]:
    one = results["one_process"]
    measured = {
        "added_latency_p50_idle": one["sequential"]["added_ms"]["p50"],
        "added_ttfb_p50": one["stream_first_byte"]["added_ms"]["p50"],
    }
    return {
        "benchmark": "aglverl LLMProxy overhead vs direct calls to MockVLLM (loopback, separate processes)",
        "route": "attributed: /rollout/{id}/attempt/{id}/v1/chat/completions (token capture + LLMCall recorded)",
        "event_loop": {
            "proxy": "uvloop" if use_uvloop else loop_name(),
            "mock_and_client": "asyncio",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "aiohttp": aiohttp.__version__,
        },
        "mock": {"latency_s": 0.0, "completion_tokens": COMPLETION_TOKENS},
        **results,
        "targets_measured_on": "one_process (the proxy's own work; cross-process figures above add process wake-ups)",
        "targets_ms": {
            name: {"target": target, "measured": measured[name], "met": measured[name] <= target}
            for name, target in TARGETS_MS.items()
        },
        "reference_ms": REFERENCE_MS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--proxy-uvloop", action="store_true", help="run the proxy child on uvloop")
    parser.add_argument("--against", metavar="DIR", help="compare with the aglverl package found in DIR")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child_main(args.child[0], args.child[1] if len(args.child) > 1 else None, args.proxy_uvloop)
        return
    mock = Child("mock")
    children = [mock]
    if args.against:
        try:
            new = Child("proxy", mock.info["url"])
            children.append(new)
            old = Child("proxy", mock.info["url"], pythonpath=os.path.abspath(args.against))
            children.append(old)
            result = run_loop(measure_against, mock, new, old, args.quick)
        finally:
            for child in reversed(children):
                child.stop()
        machine = {"cpus": os.cpu_count(), "loadavg_1_5_15": list(os.getloadavg())}
        print(
            json.dumps(
                {
                    "benchmark": "LLMProxy added latency, this tree vs --against",
                    "machine": machine,
                    "against": os.path.abspath(args.against),
                    "modules": {"new": new.info["module"], "old": old.info["module"]},
                    **result,
                },
                indent=2,
            )
        )
        return
    try:
        extra = ["--proxy-uvloop"] if args.proxy_uvloop else []
        proxy = Child("proxy", mock.info["url"], *extra)
        children.append(proxy)
        bare = Child("bare", mock.info["url"], *extra)
        children.append(bare)
        results = run_loop(measure, mock, proxy, bare, args.quick)
    finally:
        for child in reversed(children):
            child.stop()
    results["one_process"] = run_loop(measure_one_process, args.quick)
    print(json.dumps(report(results, args.proxy_uvloop), indent=2))


if __name__ == "__main__":
    main()
