"""``VERL``: Agent Lightning 0.2/0.3's ``agl.VERL`` algorithm, trained by aglverl.

A program written for ``agl.VERL`` changes one line (or none, under ``aglverl fit``)::

    import agentlightning as agl
    from aglverl.agent_lightning import VERL            # instead of agl.VERL

    @agl.rollout
    def my_agent(task, llm: agl.LLM) -> float: ...
    trainer = agl.Trainer(algorithm=VERL(config), n_runners=8)
    trainer.fit(my_agent, train_dataset=train, val_dataset=val)

:class:`VERL` is an ``agl.Algorithm``. It takes ``agl.VERL``'s config (verl's overrides, and the 0.2/0.3
``agentlightning:`` section mapped by :mod:`.config`), checked at construction by
:class:`~aglverl.algorithm.AsyncVERL`, which does the training: verl's V1 trainer, aglverl's daemon and proxy.
Inside ``Trainer.fit`` (its store, execution strategy, forked runners and tracer), :meth:`VERL.run` starts the
run and a :class:`~.store_bridge.LightningStoreBridge`: every aglverl rollout attempt becomes a rollout in the
Trainer's store, whose ``main_llm`` is aglverl's proxy URL of that attempt, and its end (the reward the agent
returned or emitted; or its failure) comes back to aglverl. ``fit`` returns when training ends, and the runners
stop with it (the Trainer's stop event). The Trainer awaits ``run`` (:meth:`VERL.is_async`); called with no
event loop running (``Trainer.fit_v0``, or a script), ``run`` runs the training to its end itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import agentlightning as agl
import anyio

from ..algorithm import AsyncVERL
from ..algorithm.config import nest_overrides
from ..algorithm.samples import rollouts_per_step
from ..config_errors import ConfigError
from .adapter import CallSelector, call_selector
from .config import map_verl_section
from .store_bridge import DequeueBell, LightningStoreBridge

__all__ = ["VERL"]

logger = logging.getLogger(__name__)

#: litellm (Agent Lightning's own LLMProxy) refuses to start keyless without it; aglverl's VERL never starts that
#: proxy, but a user's ``Trainer(llm_proxy=...)`` in the same program may.
_LITELLM_KEYLESS = "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY"


class VERL(agl.Algorithm):
    """``agl.VERL`` on aglverl (see the module docstring).

    ``config``: ``agl.VERL``'s dict (verl's overrides, nested or dotted, with the optional ``agentlightning:``
    section and an ``aglverl:`` section for aglverl's own options); every key is checked now
    (:class:`~aglverl.config_errors.ConfigError` names a key that is unknown or cannot be honoured).
    ``trainer_cls`` / ``daemon_cls`` (``agl.VERL``'s experimental overrides of its verl trainer and daemon
    classes) cannot be honoured: aglverl's trainer is verl's V1 trainer and its daemon is its own; any value is an
    error saying so. :attr:`config` is the composed verl config (as ``agl.VERL.config``), :attr:`algorithm` the
    :class:`~aglverl.algorithm.AsyncVERL` that trains.
    """

    #: The rollout engine every ``VERL`` of this process trains with in place of the one its config names
    #: (``actor_rollout_ref.rollout.name``); ``None``: the config's. Set by ``aglverl fit --rollout embedded``.
    rollout_override: ClassVar[str | None] = None

    def __init__(self, config: Mapping[str, Any], trainer_cls: Any = None, daemon_cls: Any = None) -> None:
        super().__init__()
        for name, value in (("trainer_cls", trainer_cls), ("daemon_cls", daemon_cls)):
            if value is not None:
                raise ConfigError(
                    f"VERL({name}={getattr(value, '__name__', value)!r}) cannot be honoured: it customises agl.VERL's "
                    "own verl trainer and AgentModeDaemon, which aglverl replaces (verl's V1 trainer, aglverl's "
                    "daemon); customise through verl's config and the aglverl: section instead"
                )
        if not isinstance(config, Mapping):
            raise ConfigError(
                f"VERL's config must be a mapping of verl's overrides, got {type(config).__name__}"
            )
        overrides = map_verl_section(nest_overrides(dict(config)))
        if self.rollout_override is not None:
            _override_rollout(overrides, self.rollout_override)
        self.algorithm = AsyncVERL(overrides)
        _check_span_exporter()
        self.config = self.algorithm.config
        #: The bridge of the run in progress (``None`` outside :meth:`run`).
        self.bridge: LightningStoreBridge | None = None
        #: The long-poll that keeps runners from sleeping between steps, while :meth:`run` runs.
        self.bell: DequeueBell | None = None
        #: The last step's metrics, once :meth:`run` has returned.
        self.metrics: dict[str, float] = {}
        #: The Trainer's adapter's choice of calls (``agent_match``), set when ``fit`` starts; ``None``: every
        #: recorded call trains.
        self.selector: CallSelector | None = None

    def set_adapter(self, adapter: Any) -> None:
        """The Trainer's adapter (``Trainer(adapter=...)``), handed over when ``fit`` starts, before anything is
        started: its choice of agents (``agent_match``) is honoured (:mod:`.adapter`); an adapter that cannot be
        is a :class:`~aglverl.config_errors.ConfigError` naming it."""
        self.selector = call_selector(adapter)
        super().set_adapter(adapter)

    def is_async(self) -> bool:
        """The Trainer awaits :meth:`run` (its event loop hosts the training)."""
        return True

    def run(self, train_dataset: Any = None, val_dataset: Any = None) -> Any:
        """Train on ``train_dataset`` (validating on ``val_dataset`` at verl's ``test_freq`` and, with
        ``val_before_train``, first), until verl's ``total_training_steps`` / ``total_epochs``.

        Inside an event loop (``Trainer.fit``, which awaits it) this returns the coroutine that trains; without
        one (``Trainer.fit_v0``, a script), it trains to the end before returning. Datasets are lists of task
        inputs (any sequence of dicts), or parquet / JSON-lines paths. Errors reach the caller as themselves
        (:class:`~aglverl.config_errors.ConfigError`, :class:`~aglverl.trajectory.groups.AgentsFailing`, ...).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            anyio.run(self.train, train_dataset, val_dataset)
            return None
        return self.train(train_dataset, val_dataset)

    async def train(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
        """The training (what :meth:`run` runs or returns)."""
        train = _as_rows(train_dataset, "train_dataset")
        val = _as_rows(val_dataset, "val_dataset")
        os.environ.setdefault(_LITELLM_KEYLESS, "true")
        try:
            store = self.get_store()
        except ValueError:
            store = None
        if store is None:
            # Trainer.fit_v0 (no store): agents are Agent Lightning 0.1 clients of aglverl's task server
            logger.info(
                "aglverl: no LightningStore set: serving Agent Lightning 0.1's protocol at the task server"
            )
            self.metrics = await self.algorithm.run(train, val)
            return
        self.metrics = await self._train_with_store(store, train, val)

    async def _train_with_store(self, store: agl.LightningStore, train: Any, val: Any) -> dict[str, float]:
        algorithm = self.algorithm
        options = algorithm.options
        concurrency = options.agents if options.agents else rollouts_per_step(algorithm.config)
        serving = anyio.Event()
        daemon_box: list[Any] = []
        bell = self.bell = DequeueBell()
        bell.install(store)

        def on_serving(daemon: Any) -> None:
            daemon_box.append(daemon)
            serving.set()

        def on_stopping(daemon: Any) -> None:
            bell.close()  # waiting runners are answered now: they see the Trainer's stop event

        async def bridge_when_serving(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            task_status.started()
            await serving.wait()
            self.bridge = LightningStoreBridge(
                daemon_box[0], store, concurrency=concurrency, bell=bell, selector=self.selector
            )
            await self.bridge.serve()

        algorithm.on_serving.append(on_serving)
        algorithm.on_stopping.append(on_stopping)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(bridge_when_serving)
                metrics = await algorithm.run(train, val)
                tg.cancel_scope.cancel()
        finally:
            algorithm.on_serving.remove(on_serving)
            algorithm.on_stopping.remove(on_stopping)
            bell.close()
        return metrics

    def get_client(self) -> Any:
        """An Agent Lightning 0.1 client of aglverl's task server (``agl.VERL.get_client``, deprecated there
        since 0.2): at the running task server, else at ``agentlightning.port`` / ``aglverl.port``."""
        url = self.algorithm.server_url or f"http://localhost:{self.algorithm.options.port}"
        return agl.AgentLightningClient(endpoint=url)


#: The first opentelemetry release whose OTLP/HTTP span exporter Agent Lightning 0.3.0's exporters cannot drive.
_SPANS_LOST_FROM = (1, 45)


def _check_span_exporter() -> None:
    """A warning when the installed opentelemetry loses every span Agent Lightning's tracer exports (so a reward
    an agent reports with ``agl.emit_reward`` would never reach training; one it returns still does)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("opentelemetry-exporter-otlp-proto-http")
    except PackageNotFoundError:
        return
    try:
        release = tuple(int(part) for part in installed.split(".")[:2])
    except ValueError:
        return
    if release >= _SPANS_LOST_FROM:
        logger.warning(
            "aglverl: opentelemetry-exporter-otlp-proto-http %s is installed: Agent Lightning 0.3.0's span exporters "
            "cannot send spans to its store with it, so a reward an agent reports with agl.emit_reward is lost (0.0 "
            "in training; a reward it returns still arrives). Install the 1.44 releases: pip install "
            "opentelemetry-api==1.44.0 opentelemetry-sdk==1.44.0 opentelemetry-exporter-otlp==1.44.0 "
            "opentelemetry-exporter-otlp-proto-http==1.44.0 (make venv-agl03 pins them)",
            installed,
        )


def _override_rollout(overrides: dict[str, Any], engine: str) -> None:
    """Put ``engine`` in place of the rollout engine the nested ``overrides`` name, with a line saying so."""
    rollout = overrides.setdefault("actor_rollout_ref", {}).setdefault("rollout", {})
    named = rollout.get("name")
    rollout["name"] = engine
    if named == engine:
        return
    logger.warning(
        "aglverl fit --rollout embedded: training with aglverl's embedded engine (actor_rollout_ref.rollout.name: "
        "%s) in place of %s",
        engine,
        f"{named!r}, which the program's config names" if named is not None else "the platform's default",
    )


def _as_rows(dataset: Any, name: str) -> Any:
    """An Agent Lightning ``Dataset`` (any sequence with ``__getitem__`` and ``__len__``) as a list of task
    inputs; a path or ``None`` as it is (aglverl reads files, and ``data.*_files``)."""
    if dataset is None or isinstance(dataset, (str, os.PathLike)):
        return dataset
    try:
        return [dataset[i] for i in range(len(dataset))]
    except TypeError as exc:
        raise ConfigError(
            f"{name} must be a sequence of task inputs or a parquet / JSON-lines path: {exc}"
        ) from None
