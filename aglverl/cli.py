"""``aglverl`` command line: ``aglverl serve`` runs the daemon standalone for external agents and backends."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import anyio
import orjson

__all__ = ["main"]


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the daemon (task server + LLM proxy) until Ctrl-C / SIGTERM")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="task server port (0: any free port)")
    p.add_argument("--proxy-port", type=int, default=8001, help="LLM proxy port (0: any free port)")
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="OpenAI-compatible inference server, e.g. http://127.0.0.1:8100 (repeatable)",
    )
    p.add_argument("--model", default="default", help="model name published in the main_llm resource")
    p.add_argument(
        "--llm-resource",
        choices=["proxy", "plain"],
        default="proxy",
        help="publish main_llm as a per-rollout ProxyLLM, or as a plain LLM for Agent Lightning 0.1 clients",
    )
    p.add_argument("--token", default=None, help="bearer token required by the task server and the proxy")
    p.add_argument("--lease-seconds", type=float, default=600.0, help="claim lease without heartbeat")
    p.add_argument("--max-attempts", type=int, default=3, help="claims per rollout before it fails")
    p.add_argument("--log-level", default="INFO")


async def _serve(args: argparse.Namespace) -> None:
    from .daemon import AgentDaemon  # imports verl (~4 s); keep `aglverl --help` instant

    daemon = AgentDaemon(
        host=args.host,
        port=args.port,
        proxy_port=args.proxy_port,
        backends=args.backend,
        model=args.model,
        llm_resource=args.llm_resource,
        token=args.token,
        lease_seconds=args.lease_seconds,
        max_attempts=args.max_attempts,
    )
    async with anyio.create_task_group() as tg:

        async def stop_on_sigterm() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_sigterm)
        async with daemon:
            info = {"server_url": daemon.server_url, "proxy_url": daemon.proxy_url, "backends": args.backend}
            print(orjson.dumps(info).decode(), flush=True)
            await anyio.sleep_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aglverl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        anyio.run(_serve, args)
    except KeyboardInterrupt:
        logging.getLogger("aglverl").info("interrupted; shut down cleanly")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
