"""``aglverl`` command line.

- ``aglverl serve`` runs the daemon (task server + LLM proxy) for external agents and inference servers;
  ``--local-model tiny|PATH`` also starts the embedded inference server and puts it behind the proxy. Tasks
  come from ``--tasks FILE`` (JSON lines, JSON or parquet, one task input per row) and from ``POST /tasks``
  on the task server (behind ``--token``); each finished rollout is printed as one JSON line
  ``{"rollout_id", "input", "status": "succeeded"|"failed", "final_reward", "error"}``.
- ``aglverl serve-model --model tiny|PATH`` runs the embedded inference server alone (what ``vllm serve`` is
  on a GPU).

Both print one JSON line with their URLs once serving (``serve``: then one per finished rollout), and stop
cleanly on Ctrl-C or SIGTERM. Every command runs on uvloop where it is installed (``--loop asyncio`` or
``AGLVERL_LOOP=asyncio``: asyncio's loop; :mod:`aglverl.cli.loop`).

- ``aglverl demo`` runs the embedded end-to-end training (verl's trainer on CPU, the tiny model, agents on the
  toy task); its last stdout line is a JSON summary (see :mod:`aglverl.cli.demo`).
- ``aglverl fit [--rollout embedded] SCRIPT [ARGS...]`` runs an Agent Lightning 0.2/0.3 program as it is,
  ``agl.VERL`` resolving to aglverl's ``VERL`` (see :mod:`aglverl.cli.fit`; needs agentlightning 0.3:
  ``make venv-agl03``); the program's own errors surface with their traceback, as under ``python SCRIPT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio
import orjson
from anyio.abc import TaskGroup

from .loop import LOOP_ENV, LOOPS, run

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
    p.add_argument(
        "--model",
        default=None,
        help="model name published in the main_llm resource (default: the local model's name, else 'default')",
    )
    p.add_argument(
        "--local-model",
        default=None,
        metavar="tiny|PATH",
        help="also run the embedded inference server on this model and add it as a backend",
    )
    p.add_argument("--local-model-port", type=int, default=0, help="port of the embedded inference server")
    p.add_argument(
        "--llm-resource",
        choices=["proxy", "plain"],
        default="proxy",
        help="publish main_llm as a per-rollout ProxyLLM, or as a plain LLM for Agent Lightning 0.1 clients",
    )
    p.add_argument("--token", default=None, help="bearer token required by the task server and the proxy")
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a --host that is not loopback without a --token (refused otherwise)",
    )
    p.add_argument("--lease-seconds", type=float, default=600.0, help="claim lease without heartbeat")
    p.add_argument("--max-attempts", type=int, default=3, help="claims per rollout before it fails")
    p.add_argument(
        "--tasks",
        action="append",
        default=[],
        metavar="FILE",
        help="queue one task per row of FILE (.jsonl, .json or .parquet; repeatable); more can be posted to "
        "POST /tasks. Each finished rollout is printed as a JSON line",
    )
    p.add_argument("--log-level", default="INFO")


def _serve_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve-model", help="run the embedded OpenAI-compatible inference server alone")
    p.add_argument(
        "--model", default="tiny", metavar="tiny|PATH", help="the built-in tiny model or a local HF dir"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8100, help="port (0: any free port)")
    p.add_argument("--model-name", default=None, help="name requests use (default: --model as given)")
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences generated together")
    p.add_argument(
        "--batch-wait-ms", type=float, default=2.0, help="how long an idle server gathers requests"
    )
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--log-level", default="INFO")


@dataclasses.dataclass
class _Serving:
    """What a command's ``run`` gets: the stack its servers are entered into, the task group that runs until
    the signal, and an event set once the command's JSON line is printed (later lines wait for it)."""

    stack: AsyncExitStack
    tg: TaskGroup
    announced: anyio.Event


async def _until_signalled(run: Callable[[_Serving], Awaitable[dict[str, Any]]]) -> None:
    """Start what ``run`` enters into the stack, print its JSON line, serve until SIGTERM (or Ctrl-C)."""
    async with anyio.create_task_group() as tg:

        async def stop_on_sigterm() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_sigterm)
        async with AsyncExitStack() as stack:
            serving = _Serving(stack, tg, anyio.Event())
            info = await run(serving)
            print(orjson.dumps(info).decode(), flush=True)
            serving.announced.set()
            await anyio.sleep_forever()


def _local_server(model: str, *, host: str, port: int, **options: Any) -> Any:
    """The embedded inference server (loads the model: a blocking call of a few seconds, before serving)."""
    from ..engine.server import InferenceServer  # imports torch and transformers (~3 s)

    return InferenceServer(model, host=host, port=port, **options)


async def _serve(args: argparse.Namespace) -> None:
    from .._net import refuse_open_address
    from ..algorithm import ConfigError, load_samples
    from ..daemon import AgentDaemon  # imports verl (~4 s); keep `aglverl --help` instant

    try:
        refuse_open_address(
            args.host,
            args.token,
            allow_unauthenticated=args.allow_unauthenticated,
            keys="--allow-unauthenticated",
        )
    except ValueError as exc:
        raise SystemExit(f"aglverl serve: --host {exc}") from None
    files: list[tuple[str, list[dict[str, Any]]]] = []
    for path in args.tasks:
        try:
            rows = await anyio.to_thread.run_sync(load_samples, path)
        except (ConfigError, ValueError) as exc:  # a missing file, an unknown format, a malformed line
            raise SystemExit(f"aglverl serve: --tasks {path}: {exc}") from None
        files.append((path, rows or []))

    async def run(serving: _Serving) -> dict[str, Any]:
        backends = list(args.backend)
        info: dict[str, Any] = {}
        model, vocab_size = args.model or "default", None
        if args.local_model is not None:
            server = _local_server(args.local_model, host=args.host, port=args.local_model_port)
            await serving.stack.enter_async_context(server)
            backends.append(server.url)
            model, vocab_size = args.model or server.served_model_name, server.vocab_size
            info["model_url"] = server.url
        daemon = AgentDaemon(
            host=args.host,
            port=args.port,
            proxy_port=args.proxy_port,
            backends=backends,
            model=model,
            vocab_size=vocab_size,
            llm_resource=args.llm_resource,
            token=args.token,
            lease_seconds=args.lease_seconds,
            max_attempts=args.max_attempts,
            allow_unauthenticated=args.allow_unauthenticated,
        )
        await serving.stack.enter_async_context(daemon)
        results = _Results(daemon, serving)
        daemon.server.accept_tasks = True
        daemon.server.on_tasks_queued.append(results.follow)
        for path, rows in files:
            ids = [await daemon.queue_task(row) for row in rows]
            results.follow(ids, rows, source=str(path))
        info["queued"] = sum(len(rows) for _, rows in files)
        return {"server_url": daemon.server_url, "proxy_url": daemon.proxy_url, "backends": backends} | info

    await _until_signalled(run)


class _Results:
    """Prints each followed rollout's result as a JSON line on stdout once it finishes (after the command's
    own line), and logs one line when every task of a ``--tasks`` file has finished."""

    def __init__(self, daemon: Any, serving: _Serving) -> None:
        self.daemon = daemon
        self.serving = serving

    def follow(self, rollout_ids: list[str], inputs: list[Any], source: str | None = None) -> None:
        tally = _Tally(source, len(rollout_ids)) if source is not None else None
        for rollout_id, value in zip(rollout_ids, inputs, strict=True):
            self.serving.tg.start_soon(self._report, rollout_id, value, tally)

    async def _report(self, rollout_id: str, value: Any, tally: _Tally | None) -> None:
        rollout = await self.daemon.wait_for_rollout(rollout_id)
        await self.serving.announced.wait()
        error = rollout.metadata.get("error") if rollout.metadata else None
        status = rollout.status
        line = {
            "rollout_id": rollout_id,
            "input": value,
            "status": status,
            "final_reward": rollout.final_reward,
            "error": error,
        }
        print(orjson.dumps(line).decode(), flush=True)
        if tally is not None:
            tally.add(status, rollout.final_reward)


@dataclasses.dataclass
class _Tally:
    """How the rollouts of one ``--tasks`` file ended; one log line when the last one has."""

    source: str
    total: int
    succeeded: int = 0
    failed: int = 0
    rewards: float = 0.0

    def add(self, status: str, reward: float | None) -> None:
        if status == "failed":
            self.failed += 1
        else:
            self.succeeded += 1
            self.rewards += reward or 0.0
        if self.succeeded + self.failed == self.total:
            mean = f" (mean reward {self.rewards / self.succeeded:.3f})" if self.succeeded else ""
            logging.getLogger("aglverl.cli").info(
                "all %d tasks of %s finished: %d succeeded%s, %d failed",
                self.total,
                self.source,
                self.succeeded,
                mean,
                self.failed,
            )


async def _serve_model(args: argparse.Namespace) -> None:
    async def run(serving: _Serving) -> dict[str, Any]:
        server = _local_server(
            args.model,
            host=args.host,
            port=args.port,
            served_model_name=args.model_name,
            max_batch_size=args.max_batch_size,
            batch_wait=args.batch_wait_ms / 1000,
            torch_threads=args.torch_threads,
        )
        await serving.stack.enter_async_context(server)
        return {"url": server.url, "model": server.served_model_name, "model_path": str(server.model_path)}

    await _until_signalled(run)


def _demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="train the tiny model end to end on CPU (verl's trainer, embedded inference, toy agents)"
    )
    p.add_argument("--steps", type=int, default=25, help="training steps (default 25)")
    p.add_argument("--agents", type=int, default=None, help="agent loops (default: every rollout of a step)")
    p.add_argument("--out", default="demo-out", help="directory for metrics.jsonl and reward.png")
    p.add_argument("--model", default="tiny", metavar="tiny|PATH", help="the model to train (default: tiny)")
    p.add_argument(
        "--json", action="store_true", help="one JSON line per step on stdout instead of a progress bar"
    )
    p.add_argument(
        "--rejection-sampling",
        action="store_true",
        help="drop GRPO groups whose rewards are all equal (aglverl.signal.rejection_sampling)",
    )
    p.add_argument(
        "--mode",
        default="sync",
        choices=["sync", "colocate_async", "separate_async"],
        help="verl's trainer mode (trainer.v1.trainer_mode; default: sync)",
    )
    p.add_argument(
        "--task",
        default="one_word",
        choices=["one_word", "multiturn"],
        help="one_word: one call per rollout; multiturn: three calls with a tool message between (default: one_word)",
    )
    p.add_argument(
        "--trajectory",
        default="merge",
        choices=["merge", "per_call"],
        help="a conversation's calls as one merged row, or one row per call (aglverl.signal.trajectory)",
    )
    p.add_argument("--log-level", default="WARNING")


async def _demo(args: argparse.Namespace) -> None:
    import warnings
    from pathlib import Path

    from .demo import run_demo

    warnings.simplefilter("ignore")  # verl's deprecation and optional-engine notices are noise for a demo
    out = Path(args.out)
    await anyio.Path(out).mkdir(parents=True, exist_ok=True)
    summary = await run_demo(
        steps=args.steps,
        agents=args.agents,
        out=out,
        model=args.model,
        json_lines=args.json,
        rejection_sampling=args.rejection_sampling,
        mode=args.mode,
        library_log=Path(
            "train.log"
        ),  # in ``out`` (the console's rule): what verl, Ray and TransferQueue print
        task=args.task,
        trajectory=args.trajectory,
    )
    print(f"verl's, Ray's and TransferQueue's output: {summary['log']}", file=sys.stderr, flush=True)
    print(orjson.dumps(summary).decode(), flush=True)


def _fit_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .fit import ROLLOUTS

    p = sub.add_parser(
        "fit",
        help="run an Agent Lightning 0.2/0.3 program unchanged, agl.VERL resolving to aglverl's VERL",
    )
    p.add_argument(
        "--rollout",
        choices=sorted(ROLLOUTS),
        default=None,
        help="embedded: train with aglverl's embedded engine (CPU) in place of the engine the program's config "
        "names (actor_rollout_ref.rollout.name: vllm on a machine without vLLM)",
    )
    p.add_argument("script", help="the program (run as `python SCRIPT ARGS...` would run it)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the program's own arguments")
    p.add_argument("--log-level", default="INFO")


def _fit(args: argparse.Namespace) -> int:
    """Run the program; only what ``aglverl fit`` refuses before it runs is reported here (exit 2): the
    program's own exceptions propagate with their traceback, as under ``python SCRIPT``."""
    from .fit import FitError, run_script

    try:
        run_script(args.script, args.args, rollout=args.rollout)
    except FitError as exc:
        print(f"aglverl fit: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aglverl", description=__doc__)
    parser.add_argument(
        "--loop",
        choices=LOOPS,
        default=None,
        help=f"event loop: auto (uvloop where installed, the default), uvloop or asyncio (also ${LOOP_ENV})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _serve_model_parser(sub)
    _demo_parser(sub)
    _fit_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "fit":  # the program runs its own event loops (Trainer.fit)
        return _fit(args)
    commands = {"serve": _serve, "serve-model": _serve_model, "demo": _demo}
    try:
        run(commands[args.command], args, loop=args.loop)
    except KeyboardInterrupt:
        print("aglverl: interrupted; shut down cleanly", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
