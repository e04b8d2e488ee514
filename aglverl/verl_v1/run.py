"""The run: TransferQueue, verl's V1 trainer, the daemon as its producer, ``fit``; and what the run asks verl's
trainer (its replicas' addresses, served model, tokenizer, sampling parameters) or frees (its Ray actors).

The run flows one way: :mod:`aglverl.algorithm` describes it whole (:class:`RunPlan`: the composed config, the
daemon's settings, the datasets, what to run beside ``fit``), this module starts verl's trainer and fills in
what only the trainer knows (:func:`daemon_config_for`), and the daemon runs on that config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, TextIO

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from .active_run import TRAIN_FILES, VAL_FILES, Run, activate
from .hooks import trainer_class
from .manager import DaemonAgentLoopManager
from .sink import TransferQueueSink

if TYPE_CHECKING:
    from ..daemon import AgentDaemon, DaemonConfig


logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """A training run as the algorithm describes it, complete but for what only verl's trainer knows.

    ``config``: the run's composed verl config (its data loader reads the run's datasets); ``daemon``: the
    daemon's settings, whose backends, served model name, vocabulary size, pad id (and, with proxy shards,
    backend nodes) :func:`daemon_config_for` fills in from the trainer; ``train`` / ``val``: the task inputs
    (``val`` ``None``: none); ``beside(daemon, trainer)``: an async context manager entered once the daemon
    serves and left when ``fit`` ends (agents, the caller's callbacks); ``on_step(step, metrics)``: called after
    each step's metrics are logged; ``progress``: the progress bar (a bool, or the text stream it goes to).
    """

    config: Any
    daemon: DaemonConfig
    train: list[dict[str, Any]]
    val: list[dict[str, Any]] | None = None
    beside: Callable[[AgentDaemon, Any], AbstractAsyncContextManager[None]] | None = None
    on_step: Sequence[Callable[[int, Mapping[str, float]], None]] = ()
    progress: bool | TextIO = True


# ---------------------------------------------------------------------------------------------- running
def backend_urls(trainer: Any) -> list[str]:
    """The inference servers agents use, as ``http://host:port``: the rollout replicas verl started in its
    actor workers, or with ``separate_async`` its standalone replicas (those in the training workers sleep
    while the trainer trains)."""
    manager = getattr(trainer, "standalone_server_manager", None) or trainer.llm_server_manager
    return [f"http://{address}" for address in manager.get_addresses()]


def backend_nodes(trainer: Any) -> dict[str, str]:
    """The Ray node id of each inference server (as :func:`backend_urls` names it): where the process that
    serves it runs (the worker hosting a hybrid replica's engine, else the replica's server actor); blocking."""
    import ray

    manager = getattr(trainer, "standalone_server_manager", None) or trainer.llm_server_manager
    replicas = manager.get_replicas()
    hosts = [replica.workers[0] if replica.workers else replica.server_handle for replica in replicas]
    nodes = ray.get([host.__ray_call__.remote(_node_id) for host in hosts])
    return {f"http://{replica.server_address}": node for replica, node in zip(replicas, nodes, strict=True)}


def _node_id(_actor: Any) -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def served_model_name(url: str) -> str:
    """The model name an OpenAI-compatible server answers to (its first ``/v1/models`` entry); blocking."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP(S)_PROXY
    with direct.open(f"{url}/v1/models", timeout=30) as response:
        return str(json.load(response)["data"][0]["id"])


def sampling_parameters(config: Any, *, validation: bool = False) -> dict[str, Any]:
    """The sampling parameters agents get in ``main_llm`` (verl's rollout / ``val_kwargs`` settings); the proxy
    fills them into calls that omit them and checks the calls that set them."""
    rollout = config.actor_rollout_ref.rollout
    source = rollout.val_kwargs if validation else rollout
    params: dict[str, Any] = {
        "temperature": float(source.temperature),
        "top_p": float(source.top_p),
        # each call's bound: verl's rollout.response_length, which is data.max_response_length unless set apart
        # (agl.VERL's trajectory aggregation: calls bounded by it, merged rows by data.max_response_length)
        "max_tokens": int(rollout.response_length),
    }
    if validation and not source.do_sample:
        params.update(temperature=0.0, top_p=1.0)
    if int(source.top_k) > 0:
        params["top_k"] = int(source.top_k)
    return params


def daemon_config_for(config: DaemonConfig, trainer: Any) -> DaemonConfig:
    """``config`` with what only the initialised trainer knows (blocking: asks its servers and Ray): the
    inference servers agents use and the model name they serve, the vocabulary size posted ids must fit, the
    pad id of training rows, and with proxy shards the node of each server."""
    pad = trainer.tokenizer.pad_token_id
    backends = backend_urls(trainer)
    nodes = backend_nodes(trainer) if config.proxy_shards != 1 else {}
    return dataclasses.replace(
        config,
        backends=tuple(backends),
        backend_nodes=nodes,
        model=served_model_name(backends[0]),
        store=dataclasses.replace(config.store, vocab_size=len(trainer.tokenizer)),
        batch=dataclasses.replace(config.batch, pad_token_id=int(pad if pad is not None else 0)),
    )


def close_trainer(trainer: Any) -> None:
    """Stop the trainer's Ray actors and free its placement groups (blocking; for a shared Ray session).

    That is the trainer's worker groups, every rollout replica's servers and workers, and the pools of both:
    a standalone replica (separate_async's rollout pool) makes its own pool and worker group
    (``RolloutReplica.init_standalone``), which the trainer's ``resource_pool_manager`` does not list; left
    behind in a Ray session the caller keeps, they hold its resources and the next run waits for them forever.
    """
    import ray
    from ray.util import remove_placement_group

    actors: list[Any] = []
    for name in ("actor_rollout_wg", "critic_wg", "ref_policy_wg"):
        group = getattr(trainer, name, None)
        if group is not None:
            actors += list(group.workers)
    pools = list(
        (getattr(getattr(trainer, "resource_pool_manager", None), "resource_pool_dict", {}) or {}).values()
    )
    for manager_name in ("llm_server_manager", "standalone_server_manager"):
        manager = getattr(trainer, manager_name, None)
        if manager is None:
            continue
        for replica in manager.get_replicas():
            actors += list(replica.servers) + list(getattr(replica, "workers", None) or [])
            pools.append(getattr(replica, "resource_pool", None))
        if getattr(manager, "global_load_balancer", None) is not None:
            actors.append(manager.global_load_balancer)
    actors += list(
        getattr(getattr(trainer, "reward_loop_manager", None), "reward_loop_worker_handles", None) or []
    )
    for actor in dict.fromkeys(actors):
        try:
            ray.kill(actor)
        except Exception as exc:  # already gone: nothing to stop
            logger.debug("ray.kill(%s): %s", actor, exc)
    # a hybrid replica shares the trainer's pool: each placement group is removed once
    groups = {pg.id: pg for pool in pools if pool is not None for pg in getattr(pool, "pgs", None) or []}
    for pg in groups.values():
        remove_placement_group(pg)


@asynccontextmanager
async def running(plan: RunPlan) -> AsyncIterator[tuple[Run, Any]]:
    """TransferQueue, verl's V1 trainer (initialised: workers, replicas, checkpoint loaded) and the daemon as
    its producer, serving on ``plan.daemon`` completed by :func:`daemon_config_for`; yields ``(run, trainer)``
    ready for ``trainer.fit(DaemonAgentLoopManager(run))``.

    On exit (also on error or cancellation) the daemon, the trainer's Ray actors and TransferQueue are shut
    down.
    """
    import transfer_queue as tq

    from ..daemon import AgentDaemon

    config = plan.config
    datasets = {TRAIN_FILES: plan.train, VAL_FILES: plan.val or plan.train}
    run = Run(
        config=config,
        signal=plan.daemon.signal,
        datasets=datasets,
        on_step=plan.on_step,
        progress=plan.progress,
    )
    run.token = anyio.lowlevel.current_token()
    with activate(run), _progress_bar(run):
        await anyio.to_thread.run_sync(tq.init, config.transfer_queue)
        trainer: Any = None
        try:
            trainer = trainer_class(config.trainer.v1.trainer_mode)(config=config)
            trainer._aglverl = run
            await anyio.to_thread.run_sync(trainer.init)
            settings = await anyio.to_thread.run_sync(daemon_config_for, plan.daemon, trainer)
            sink = TransferQueueSink(logprobs=settings.signal.request_logprobs)
            async with AgentDaemon(config=settings, trajectory_sink=sink) as daemon:
                run.daemon = daemon
                daemon.weight_version = int(trainer.global_steps)
                assert daemon.producer is not None
                daemon.producer.width_warning.names = ("data.max_prompt_length", "data.max_response_length")
                # validation's first, so that the latest resources (what agents get by default) are training's
                validation = sampling_parameters(config, validation=True)
                run.resources["val"] = daemon.update_resources({"main_llm": daemon.main_llm(validation)})
                training = sampling_parameters(config)
                run.resources["train"] = daemon.update_resources({"main_llm": daemon.main_llm(training)})
                yield run, trainer
        finally:
            run.daemon = None
            with anyio.CancelScope(shield=True):
                if trainer is not None:
                    await anyio.to_thread.run_sync(_finish_tracking, trainer)
                    await anyio.to_thread.run_sync(close_trainer, trainer)
                await anyio.to_thread.run_sync(tq.close)


async def train(plan: RunPlan) -> None:
    """Run verl's V1 trainer (``fit``) with the daemon as its producer (see :func:`running`), with
    ``plan.beside(daemon, trainer)`` entered around ``fit``. Cancellation stops after the blocking verl call in
    progress returns."""
    async with running(plan) as (run, trainer):
        assert run.daemon is not None
        if plan.beside is None:
            await anyio.to_thread.run_sync(trainer.fit, DaemonAgentLoopManager(run))
            return
        async with plan.beside(run.daemon, trainer):
            await anyio.to_thread.run_sync(trainer.fit, DaemonAgentLoopManager(run))


@contextmanager
def _progress_bar(run: Run) -> Iterator[None]:
    """verl's V1 loop draws its own ``tqdm`` bar (``trainer_base.py:434``); for the run it is aglverl's: named,
    on stderr, hidden without ``progress``, with the step's reward and generated tokens/s."""
    import sys

    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from tqdm import tqdm

    def bar(*args: Any, **kwargs: Any) -> Any:
        stream = run.progress if hasattr(run.progress, "write") else sys.stderr
        kwargs.update(desc="aglverl training", unit="step", file=stream, disable=not run.progress)
        run.bar = tqdm(*args, **kwargs)
        return run.bar

    original = trainer_base.tqdm
    trainer_base.tqdm = bar
    try:
        yield
    finally:
        trainer_base.tqdm = original
        if run.bar is not None:
            run.bar.close()


def _finish_tracking(trainer: Any) -> None:
    tracking = getattr(trainer, "logger", None)
    if tracking is not None:
        try:
            tracking.finish()
        except Exception as exc:  # a logger backend failing to flush must not hide the run's own outcome
            logger.warning("verl's Tracking.finish failed: %s", exc)
