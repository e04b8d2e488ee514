"""A live verl V1 trainer for a test module: Ray, TransferQueue, verl's workers and replicas, and the daemon
serving as its producer (``aglverl.verl_v1.running``), as ``AsyncVERL`` sets them up, minus ``fit``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import ExitStack, asynccontextmanager
from typing import Any

from aglverl.algorithm import (
    VerlRuntime,
    _daemon_kwargs,
    _run_config,
    _worker_group_class,
    compose_config,
    verl_runtime,
)
from aglverl.verl_plugin.patches import use_worker_group
from aglverl.verl_v1 import DaemonAgentLoopManager, running


@asynccontextmanager
async def live_trainer(
    overrides: Mapping[str, Any], train: list[dict[str, Any]]
) -> AsyncIterator[tuple[Any, Any, VerlRuntime]]:
    """``(run, trainer, runtime)``: the trainer initialised (weights synced, replicas awake) and set up as
    verl's ``fit`` sets it up for step 1, its agent-loop manager the daemon's."""
    config, options = compose_config(overrides)
    config = _run_config(config, has_validation=False)
    with ExitStack() as stack:
        runtime = stack.enter_context(verl_runtime(config))
        use_worker_group(_worker_group_class(runtime.env, runtime.rendezvous_dir))
        async with running(
            config, options, train, None, daemon_kwargs=lambda t: _daemon_kwargs(config, options, t), progress=False
        ) as (run, trainer):
            trainer.agent_loop_manager = DaemonAgentLoopManager(run)
            trainer.global_steps = 1
            trainer.curr_step_profile, trainer.timing_raw = False, {}  # what verl's fit() sets for a step
            yield run, trainer, runtime
