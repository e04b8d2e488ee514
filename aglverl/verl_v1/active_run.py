"""The run verl's callbacks belong to: verl builds aglverl's dataset, sampler and trainer classes itself, from
names, so they find the daemon and the run's settings here (one active run per process)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

if TYPE_CHECKING:
    from ..daemon import AgentDaemon
    from ..trajectory.signals import SignalConfig


logger = logging.getLogger(__name__)


#: ``data.train_files`` / ``data.val_files`` naming the task inputs of the current run (see SampleDataset).
TRAIN_FILES, VAL_FILES = "aglverl://train", "aglverl://val"


#: The dataset column that carries each task input (verl requires ``raw_prompt``: it counts prompts by it).
INPUT_KEY = "raw_prompt"


# ---------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Run:
    """What verl's callbacks into this module need (verl builds our classes itself, from names)."""

    config: Any
    signal: SignalConfig
    datasets: dict[str, list[dict[str, Any]]]
    token: Any = None
    daemon: AgentDaemon | None = None
    resources: dict[str, str] = dataclasses.field(default_factory=dict)
    on_step: Sequence[Callable[[int, Mapping[str, float]], None]] = ()
    progress: Any = True  # a bool, or the text stream the bar goes to
    bar: Any = None

    def on_loop(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func(*args)`` on the daemon's event loop from verl's thread and return its result."""
        return anyio.from_thread.run_sync(func, *args, token=self.token)

    def await_on_loop(self, func: Callable[..., Any], *args: Any) -> Any:
        """Await ``func(*args)`` on the daemon's event loop from verl's thread (blocks this thread only)."""
        return anyio.from_thread.run(func, *args, token=self.token)

    @property
    def producer(self) -> Any:
        if self.daemon is None or self.daemon.producer is None:
            raise RuntimeError("the aglverl daemon is not serving yet")
        return self.daemon.producer


_ACTIVE: Run | None = None


def current_run() -> Run:
    if _ACTIVE is None:
        raise RuntimeError("no aglverl training run is active in this process (use aglverl.AsyncVERL)")
    return _ACTIVE


@contextmanager
def activate(run: Run) -> Iterator[Run]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("an aglverl training run is already active in this process")
    _ACTIVE = run
    try:
        yield run
    finally:
        _ACTIVE = None
