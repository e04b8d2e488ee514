"""``AsyncVERL``: the whole training run around verl's V1 trainer (see the package docstring)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import ExitStack, asynccontextmanager
from typing import Any, TextIO

import anyio
import anyio.abc
import anyio.to_thread

from ..agl10.config import (
    AgentLightningSettings,
    map_section,
    refuse_verl_keys,
    rollout_config_for,
)
from ..client import AgentFn, check_agent, run_agents
from .config import compose_config, daemon_config, nest_overrides, run_config, user_set
from .runtime import (
    VerlRuntime,
    latest_checkpoint,
    save_step_metrics,
    saved_step_metrics,
    total_steps,
    verl_runtime,
    worker_group_class,
)
from .samples import Samples, check_prompt_widths, load_samples, rollouts_per_step
from .validation import ConfigError, check_rollout_engine

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- AsyncVERL
class AsyncVERL:
    """Train agents with verl's V1 PPO trainer, an :class:`~aglverl.daemon.AgentDaemon` as its trajectory producer.

    ``config``: verl overrides plus an ``aglverl:`` section (see the module docstring). ``agent``: an agent
    function as for :func:`~aglverl.client.run_agents` (``async def agent(task_input, llm) -> reward |
    Rollout``); without it, agents connect from elsewhere to the task server URL that is logged (and in
    :attr:`server_url` once running). ``progress``: a progress bar on stderr (or on the text stream given).

    Construction checks everything it can before anything starts: every value of the config and of the
    ``aglverl:`` section (:class:`ConfigError` naming the key, the value and what is allowed), that the rollout
    engine the config names can be imported here (``rollout.name: vllm`` without vLLM), and the agent
    (``TypeError``: a plain ``def``, or a function that does not take ``(task_input, llm)``). It also fits
    verl's GPU-sized batch defaults the user left alone, logging one line per key it sets. :meth:`run` does
    the work.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        agent: AgentFn | None = None,
        *,
        progress: bool | TextIO = True,
    ) -> None:
        if agent is not None:
            check_agent(agent)
        # Agent Lightning's section (and its two verl keys) in aglverl's terms (aglverl.agl10.config)
        nested = nest_overrides(dict(config or {}))
        refuse_verl_keys(nested)  # agl.VERL's (0.2/0.3) section is aglverl.agl03.VERL's
        overrides, job_template = map_section(nested)
        check_rollout_engine(
            overrides
        )  # the engine the user named: at once, before verl's config is composed
        self.config, self.options = compose_config(overrides)
        check_rollout_engine(self.config)  # the platform's default engine (vllm with GPUs) too
        self._overrides = overrides
        if agent is not None and self.options.processes.enabled:
            raise ConfigError(
                "AsyncVERL got both agent= and agents to run as processes (aglverl.processes or "
                "agentlightning.local.agent_class): a run has one kind of built-in agent; drop one of them"
            )
        #: What the daemon's Agent Lightning API says of this run's rollouts (their controller config...).
        self.agent_lightning = AgentLightningSettings(
            rollout_config=rollout_config_for(self.options.processes, job_template),
            reward_fillna_value=self.options.processes.reward_fillna_value,
            trainer_owns_gate=True,
            accept_rollouts=self.options.accept_outside_rollouts,
        )
        #: The built-in runner of agent processes, while it runs (``aglverl.processes``).
        self.process_runner: Any = None
        self.agent = agent
        self.progress = progress
        self.daemon: Any = None
        self.trainer: Any = None
        #: Called with the daemon once it serves (its URLs are known), before the first step.
        self.on_serving: list[Callable[[Any], None]] = []
        #: Called with ``(step, metrics)`` after each training step's metrics are logged.
        self.on_step: list[Callable[[int, Mapping[str, float]], None]] = []
        #: Called with the daemon when training has ended (or failed), before the daemon stops serving: the
        #: place to stop agents of your own while the task server still answers them (awaited when it returns
        #: an awaitable; shielded from cancellation, for up to ``STOPPING_SECONDS``).
        self.on_stopping: list[Callable[[Any], Awaitable[None] | None]] = []

    @property
    def server_url(self) -> str | None:
        """The task server agents connect to (once :meth:`run` has started the daemon)."""
        return self.daemon.server_url if self.daemon is not None else None

    async def run(self, train_dataset: Samples = None, val_dataset: Samples = None) -> dict[str, float]:
        """Run the whole training; returns the last step's metrics (with the final validation, if any).

        Datasets are lists of task-input dicts or parquet / JSON-lines paths (default: ``data.train_files`` /
        ``data.val_files``); without a validation set there is no validation. Before Ray starts, the data is
        checked against the config (:class:`ConfigError`: an empty dataset, fewer tasks than a batch), prompts
        the task inputs carry are measured against ``data.max_prompt_length`` (a warning when they do not
        fit), and verl's checkpoint directory is looked at: a resume is announced with its step and
        directory, and a run whose checkpoint already is its last step says so and returns that step's
        metrics (saved beside the checkpoint) without starting anything.

        Errors reach the caller as themselves (:class:`~aglverl.trajectory.groups.AgentsFailing`, ``ConfigError``...),
        not wrapped in the exception groups of the task groups they crossed. Cancellation stops training after
        the blocking verl call in progress returns, then shuts the daemon, the agents, verl's workers and (if
        started here) Ray down.
        """
        try:
            return await self._run(train_dataset, val_dataset)
        except BaseExceptionGroup as group:
            error = _the_error(group)
            if error is None:
                raise
        raise error  # outside the handler: the error's own traceback and context, not the groups'

    async def _run(self, train_dataset: Samples, val_dataset: Samples) -> dict[str, float]:
        train = load_samples(train_dataset, self.config.data.train_files)
        val = load_samples(val_dataset, self.config.data.val_files)
        if not train:
            raise ConfigError("the training dataset is empty (pass train_dataset or set data.train_files)")
        config = run_config(self.config, has_validation=bool(val))
        total = total_steps(config, len(train))
        checkpoint = latest_checkpoint(config)
        if checkpoint is not None:
            step, path = checkpoint
            if step >= total:
                logger.warning(
                    "aglverl: nothing left to train: the checkpoint %s is step %d of %d; returning its metrics "
                    "(to train again, remove %s or set trainer.resume_mode: disable)",
                    path,
                    step,
                    total,
                    config.trainer.default_local_dir,
                )
                return await anyio.to_thread.run_sync(saved_step_metrics, path)
            logger.warning(
                "aglverl: resuming from step %d of %d: %s (trainer.resume_mode: %s; 'disable' starts over)",
                step,
                total,
                path,
                config.trainer.resume_mode,
            )
        width_given = user_set(self._overrides, "data.max_prompt_length")
        await anyio.to_thread.run_sync(check_prompt_widths, config, width_given, train)
        if self.options.processes.enabled and self.options.agents != 0:
            from ..runners import check_agent

            await check_agent(self.options.processes)  # before Ray: a missing program or class is named now
        stack = ExitStack()
        try:
            runtime = await anyio.to_thread.run_sync(stack.enter_context, verl_runtime(config))
            return await self._train(config, train, val, runtime)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stack.close)

    async def _train(
        self, config: Any, train: list[dict[str, Any]], val: list[dict[str, Any]] | None, runtime: VerlRuntime
    ) -> dict[str, float]:
        from .. import verl_v1
        from ..verl_plugin.patches import use_worker_group

        use_worker_group(worker_group_class(runtime.env, runtime.rendezvous_dir))
        last: dict[str, float] = {}

        def remember(step: int, metrics: Mapping[str, float]) -> None:
            last.clear()
            last.update(metrics)
            save_step_metrics(config, step, metrics)

        # blocking: it makes the journal's directory
        settings = await anyio.to_thread.run_sync(daemon_config, config, self.options)
        settings = dataclasses.replace(settings, agent_lightning=self.agent_lightning)
        given = user_set(self._overrides, "aglverl.proxy.overload.refuse")
        if self.agent is not None and settings.proxy_shards == 1 and not given:
            # The agents run on this event loop beside the proxy: a late loop is their own work, and a 429 would
            # only fail their rollouts (it frees nothing), so unless the config says otherwise the proxy measures
            # its lag and turns no call away.
            measuring = dataclasses.replace(settings.proxy.overload, refuse=False)
            settings = dataclasses.replace(
                settings, proxy=dataclasses.replace(settings.proxy, overload=measuring)
            )
        plan = verl_v1.RunPlan(
            config=config,
            daemon=settings,
            train=train,
            val=val,
            beside=self._beside_fit,
            on_step=[*self.on_step, remember],
            progress=self.progress,
        )
        await verl_v1.train(plan)
        return last

    @asynccontextmanager
    async def _beside_fit(self, daemon: Any, trainer: Any) -> AsyncIterator[None]:
        """What runs while verl's ``fit`` does: the agents (with ``agent=``) and the caller's callbacks."""
        self.daemon, self.trainer = daemon, trainer
        logger.info("aglverl: agents connect to %s", daemon.server_url)
        for callback in self.on_serving:
            callback(daemon)
        async with anyio.create_task_group() as tg:
            agents = agent_count(self.config, self.options)
            if self.agent is not None and agents:
                tg.start_soon(self._run_agents, agents)
            if self.options.processes.enabled and agents:
                await tg.start(self._run_processes, daemon, self.config, agents)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(STOPPING_SECONDS):
                    for stopping in self.on_stopping:
                        result = stopping(daemon)
                        if inspect.isawaitable(result):
                            await result
                tg.cancel_scope.cancel()

    async def _run_processes(
        self, daemon: Any, config: Any, concurrency: int, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        from ..runners import ProcessRunner

        processes = self.options.processes
        log_dir = processes.log_dir or os.path.join(str(config.trainer.default_local_dir), "agent_logs")
        self.process_runner = ProcessRunner(daemon, processes, concurrency=concurrency, log_dir=log_dir)
        logger.info(
            "aglverl: up to %d agent processes at once; their output goes to %s", concurrency, log_dir
        )
        await self.process_runner.serve(task_status=task_status)

    async def _run_agents(self, concurrency: int) -> None:
        assert self.agent is not None and self.daemon is not None
        await run_agents(
            self.daemon.server_url, self.agent, concurrency=concurrency, token=self.options.token
        )


#: How long :attr:`AsyncVERL.on_stopping` callbacks may take, all together, before the daemon stops anyway.
STOPPING_SECONDS = 60.0


def agent_count(config: Any, options: Any) -> int:
    """How many agents a run starts: ``aglverl.agents`` when set; else, for agent functions, every rollout of a
    step at once; for agent processes, that bounded by the machine's cores and memory
    (:func:`aglverl.runners.default_concurrency`: a process per rollout of a large step would be hundreds of
    interpreters at each step's start)."""
    if options.agents is not None:
        return int(options.agents)
    rollouts = rollouts_per_step(config)
    if options.processes.enabled:
        from ..runners import default_concurrency
        from ..runners.forkserver import python_agent

        forked = options.processes.fork_server and python_agent(options.processes) is not None
        return default_concurrency(rollouts, forked=forked)
    return rollouts


def _the_error(group: BaseExceptionGroup) -> BaseException | None:
    """The error a group of errors stands for: its only one (cancellations aside), or else its only aglverl
    error; ``None`` when it holds several (the group is raised as it is then)."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        elif not isinstance(error, cancelled):
            leaves.append(error)

    collect(group)
    if len(leaves) == 1:
        return leaves[0]
    ours = [error for error in leaves if type(error).__module__.startswith("aglverl.")]
    return ours[0] if len(ours) == 1 else None
