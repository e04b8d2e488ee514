"""What the proxy's memory pays for calls it refuses: clients that send a large body without the token.

Run: ``python benchmarks/proxy_memory.py [--clients 64] [--body-mib 32] [--against DIR [--against-clients 4]]``.
Prints ONE JSON object on stdout.

A proxy process (with ``--against``, also the ``aglverl`` package found in ``DIR``: ``git archive <rev> aglverl |
tar -x -C DIR``, run after this tree's, alone) serves with a token. This process opens ``clients`` connections at
once; each writes a head declaring a ``body_mib`` MiB body (within ``max_body_bytes``, 32 MiB), without the
token, then the body in 256 KiB writes as fast as the proxy takes them, and reads its answer, until the proxy
has answered and closed (or the whole body went). The proxy's resident memory (``VmRSS``) is read before the
clients connect and after every one of them is done (the proxy collected its garbage first), and its peak
(``VmHWM``, reset before the clients start where the kernel allows) over the run: ``added_mib`` and
``peak_added_mib``, with the answers' statuses, how much of its body a client got to send, and how long it
waited for its answer. Issue 48's bound: 64 clients of 32 MiB add less than 16 MiB.

019ee6f read and held each body whole before it checked the token (4 clients: +119 MiB, held): ``--against`` runs
that tree with ``--against-clients`` clients (4 by default; 64 x 32 MiB would be 2 GiB).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

import anyio
from _common import JsonChild, child_args, emit, machine_info, run_loop, status_kib, stdin_commands

TOKEN = "s3cret"
PIECE = 256 << 10
#: Bound, in seconds, on one client's exchange.
CLIENT_SECONDS = 60.0


# ---------------------------------------------------------------------------------------------- the proxy
async def _run_proxy(cfg: dict[str, Any]) -> None:
    from proxy import serving_proxy  # benchmarks/proxy.py: a proxy with its store and claimed rollouts

    import aglverl.proxy

    # No call is let in, so the backend is never reached.
    async with serving_proxy("http://127.0.0.1:9", rollouts=1, token=TOKEN) as (url, bases):
        emit({"url": url, "base": bases[0], "pid": os.getpid(), "module": aglverl.proxy.__file__})
        async for _ in stdin_commands():
            gc.collect()
            emit({"collected": True})


def _child_main(role: str, cfg: dict[str, Any]) -> None:
    if cfg.get("path"):  # another version's aglverl, found before this tree's
        sys.path.insert(0, cfg["path"])
    run_loop(_run_proxy, cfg)


# ---------------------------------------------------------------------------------------------- the clients
async def _client(address: tuple[str, int], target: str, body_bytes: int) -> dict[str, Any]:
    """One client without the token: its answer's status, how much of its body it sent, how long it waited."""
    reader, writer = await asyncio.open_connection(*address)
    head = (
        f"POST {target} HTTP/1.1\r\nHost: {address[0]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {body_bytes}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    sent = 0
    answer: dict[str, Any] = {}

    async def send() -> None:
        nonlocal sent
        writer.write(head)
        piece = b"x" * PIECE
        try:
            while sent < body_bytes and not answer:
                chunk = piece[: body_bytes - sent]
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
        except ConnectionError:
            pass  # the proxy answered and closed: the rest of the body is not wanted

    async def receive() -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            answer["status"] = 0
            return
        answer["status"] = int(head.split(maxsplit=2)[1])
        answer["seconds"] = time.monotonic() - started
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        await reader.readexactly(length)

    try:
        with anyio.fail_after(CLIENT_SECONDS):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                tg.start_soon(receive)
    finally:
        writer.close()
    return {"status": answer.get("status", 0), "sent": sent, "seconds": answer.get("seconds", CLIENT_SECONDS)}


def _reset_peak(pid: int) -> bool:
    """Reset the process's ``VmHWM`` to its RSS now (``/proc/<pid>/clear_refs``), where the kernel allows it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


async def measure(path: str | None, clients: int, body_mib: int) -> dict[str, Any]:
    proxy = await JsonChild.start(child_args(__file__, "proxy", {"path": path}))
    try:
        host, port = proxy.info["url"].removeprefix("http://").rsplit(":", 1)
        address = (host, int(port))
        target = proxy.info["base"].split(proxy.info["url"], 1)[1] + "/chat/completions"
        await _client(address, target, 1024)  # warm-up: the refusal's code paths loaded
        await proxy.request({"gc": True})
        pid = proxy.pid
        before = status_kib(pid, "VmRSS:")
        peak_reset = _reset_peak(pid)
        started = time.monotonic()
        results = await asyncio.gather(*(_client(address, target, body_mib << 20) for _ in range(clients)))
        elapsed = time.monotonic() - started
        peak = status_kib(pid, "VmHWM:")
        await proxy.request({"gc": True})
        after = status_kib(pid, "VmRSS:")
    finally:
        await proxy.stop()
    waits = [r["seconds"] for r in results]
    return {
        "module": proxy.info["module"],
        "clients": clients,
        "body_mib": body_mib,
        "rss_before_mib": round(before / 1024, 1),
        "rss_after_mib": round(after / 1024, 1),
        "added_mib": round((after - before) / 1024, 1),
        "peak_added_mib": round((peak - before) / 1024, 1) if peak_reset else None,
        "peak_rss_mib": round(peak / 1024, 1),
        "answers": {str(k): v for k, v in Counter(r["status"] for r in results).items()},
        "body_sent_mib_median": round(statistics.median(r["sent"] for r in results) / (1 << 20), 2),
        "answer_seconds_median": round(statistics.median(waits), 3),
        "answer_seconds_max": round(max(waits), 3),
        "seconds": round(elapsed, 2),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "machine": machine_info(),
        "this_tree": await measure(None, args.clients, args.body_mib),
    }
    if args.against:
        out["against"] = await measure(args.against, args.against_clients, args.body_mib)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="clients at once (this tree)")
    parser.add_argument("--body-mib", type=int, default=32, help="the body each client declares and sends")
    parser.add_argument("--against", metavar="DIR", help="also measure the aglverl package found in DIR")
    parser.add_argument("--against-clients", type=int, default=4, help="clients at once for --against's tree")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import json

        _child_main(args.child[0], json.loads(args.child[1]))
        return
    emit(run_loop(main_async, args))


if __name__ == "__main__":
    main()
