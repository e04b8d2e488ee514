"""The quiet console of a training run: a progress bar and a few numbers on the screen, the rest in files.

::

    algo = AsyncVERL(config, agent=agent)
    summary = anyio.run(Console("one_word-out").run, algo, train_tasks)
    print(f"reward {summary['first_reward']:.2f} -> {summary['final_reward']:.2f}")

While :meth:`Console.run` trains, the console shows aglverl's progress bar (step, reward, generated
tokens/s) and aglverl's own warnings (a setting it fitted, a resume, an agent's error the first time it is
seen); in ``out``:

- ``metrics.jsonl``: one JSON object per step (``step``, ``reward``, ``response_length``, ``wall_s`` and every
  metric of verl's and aglverl's for that step). Every figure is the step's own except ``wall_s`` (seconds
  since the run started): ``proxy/*`` count what the proxy did since the previous step (validation's calls
  included), ``step/generated_tokens`` the tokens of the step, so a column plots per step as it is;
- ``train.log``: everything verl, Ray and TransferQueue print or log in this process meanwhile (verl's console
  logger prints ~200 metrics a step), and the warnings Python raises;
- ``reward.png``: the mean training reward per step (with ``plot``).

``aglverl demo`` and the examples run through it. ``json_lines=True`` prints each step's JSON object on stdout
instead of drawing the bar (for scripts that read the run).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, TextIO

import anyio
import orjson

__all__ = ["Console", "plot_rewards"]

#: The reward a summary reports the first step reaching (``first_step_reaching_0.9``, ``seconds_to_0.9``).
REWARD_MARK = 0.9


class Console:
    """Runs an :class:`~aglverl.algorithm.AsyncVERL` quietly (see the module docstring) and sums it up.

    ``out``: the directory for the files (created). ``json_lines``: a JSON line per step on stdout instead of
    the bar. ``plot``: draw ``reward.png`` (``title`` above it). ``log``: the libraries' log file (a relative
    path is in ``out``); ``None``: nothing is redirected (the libraries print where they would).
    """

    def __init__(
        self,
        out: str | Path,
        *,
        json_lines: bool = False,
        plot: bool = True,
        title: str = "aglverl: mean training reward per step",
        log: str | Path | None = "train.log",
    ) -> None:
        self.out = Path(out)
        self.json_lines = json_lines
        self.plot = plot
        self.title = title
        self.log_path = self.out / log if log is not None else None
        self.rewards: list[float] = []
        self._stdout, self._stderr = sys.stdout, sys.stderr  # the console, whatever is redirected later

    def say(self, message: str) -> None:
        """A line on the console (stderr, above the progress bar), also while the libraries' output goes to
        the log file: for the script's own news during the run."""
        from tqdm import tqdm

        tqdm.write(message, file=self._stderr)

    async def run(self, algo: Any, train: Any = None, val: Any = None) -> dict[str, Any]:
        """Train (``algo.run(train, val)``) with the quiet console; returns the summary.

        The summary: ``first_reward``, ``final_reward``, ``max_reward``, ``steps``, ``wall_s``, ``startup_s``,
        ``seconds_per_step``, ``first_step_reaching_0.9``, ``seconds_to_0.9``, ``metrics`` (what ``run``
        returned: the last step's metrics), ``out`` and ``log``. A run with nothing left to train (its
        checkpoint is its last step) has no steps and its ``final_reward`` from the returned metrics. The
        algorithm's errors propagate unchanged (the files keep what was written).
        """
        started = time.monotonic()
        await anyio.Path(self.out).mkdir(parents=True, exist_ok=True)
        console_out, console_err = self._stdout, self._stderr
        first_step_at: list[float] = []
        walls: list[float] = []
        self.rewards = []
        # the bar keeps the console when the libraries' output is redirected; JSON lines replace it
        algo.progress = False if self.json_lines else console_err

        with (
            (self.out / "metrics.jsonl").open("wb") as log,
            _libraries_to(self.log_path),
            _warnings_to(console_err),
        ):

            def on_step(step: int, metrics: Mapping[str, float]) -> None:
                now = time.monotonic()
                if not first_step_at:
                    first_step_at.append(now - metrics.get("timing_s/step", 0.0))
                reward = float(metrics.get("training/reward", math.nan))
                self.rewards.append(reward)
                walls.append(now - started)
                row = {
                    "step": step,
                    "reward": reward,
                    "response_length": metrics.get("response_length/mean", 0.0),
                    "wall_s": now - started,
                    **metrics,
                }
                line = orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY)
                log.write(line + b"\n")
                log.flush()
                if self.json_lines:
                    console_out.write(line.decode() + "\n")
                    console_out.flush()

            algo.on_step.append(on_step)
            try:
                metrics = await algo.run(train, val)
            finally:
                algo.on_step.remove(on_step)
                if self.plot and self.rewards:
                    await anyio.to_thread.run_sync(
                        plot_rewards, self.rewards, self.out / "reward.png", self.title
                    )
        return self._summary(metrics, started, first_step_at, walls)

    def _summary(
        self, metrics: Mapping[str, float], started: float, first_step_at: list[float], walls: list[float]
    ) -> dict[str, Any]:
        rewards = self.rewards
        wall = time.monotonic() - started
        startup = (first_step_at[0] - started) if first_step_at else wall
        final = rewards[-1] if rewards else float(metrics.get("training/reward", math.nan))
        return {
            "first_reward": rewards[0] if rewards else math.nan,
            "final_reward": final,
            "max_reward": max(rewards) if rewards else math.nan,
            "steps": len(rewards),
            "wall_s": round(wall, 2),
            "startup_s": round(startup, 2),
            "seconds_per_step": round((wall - startup) / len(rewards), 3) if rewards else math.nan,
            f"first_step_reaching_{REWARD_MARK}": next(
                (i + 1 for i, r in enumerate(rewards) if r >= REWARD_MARK), None
            ),
            f"seconds_to_{REWARD_MARK}": next(
                (round(w, 2) for w, r in zip(walls, rewards, strict=True) if r >= REWARD_MARK), None
            ),
            "metrics": dict(metrics),
            "out": str(self.out),
            "log": str(self.log_path) if self.log_path is not None else None,
        }

    def describe(self, summary: Mapping[str, Any]) -> str:
        """One line for the end of a run: the reward from first to last step, steps, seconds, where the rest is."""
        where = f"metrics: {self.out / 'metrics.jsonl'}"
        if self.log_path is not None:
            where += f"; verl's, Ray's and TransferQueue's output: {self.log_path}"
        if not summary["steps"]:
            return f"no step trained (nothing left: see above); final reward {summary['final_reward']:.3f}"
        return (
            f"reward {summary['first_reward']:.3f} -> {summary['final_reward']:.3f} (max {summary['max_reward']:.3f}) "
            f"in {summary['steps']} steps, {summary['wall_s']:.0f} s ({where})"
        )


@contextmanager
def _libraries_to(path: Path | None) -> Iterator[None]:
    """Send what verl, Ray and TransferQueue print or log in this process to ``path`` for the block.

    Their ``print``s go to ``sys.stdout``, their log records and Python warnings to handlers that write to the
    process's streams (some created during the block, e.g. by ``ray.init``): for the block, ``sys.stdout`` and
    ``sys.stderr`` are the file, every stream handler writing to the console writes to the file, and warnings
    are logged. Streams captured before the block (the console's) keep writing to the console. ``None``:
    nothing is redirected.
    """
    if path is None:
        yield
        return
    with path.open("a", buffering=1) as sink:
        handlers: list[tuple[logging.StreamHandler, Any]] = []
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(logger, "handlers", ()):
                if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
                    try:
                        handlers.append((handler, handler.setStream(sink)))
                    except AttributeError:  # a handler whose stream is fixed (logging's last resort)
                        continue
        root = logging.getLogger()
        added = logging.StreamHandler(sink)
        added.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(added)
        logging.captureWarnings(True)
        with redirect_stdout(sink), redirect_stderr(sink):
            try:
                yield
            finally:
                logging.captureWarnings(False)
                root.removeHandler(added)
                for handler, stream in handlers:
                    handler.setStream(stream)


class _AboveTheBar(logging.Handler):
    """aglverl's warnings on the console, written above the progress bar (``tqdm.write``), not through it."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.WARNING)
        self.stream = stream
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # a closed console must not break the run
            self.handleError(record)


@contextmanager
def _warnings_to(stream: TextIO) -> Iterator[None]:
    """aglverl's own warnings (a setting fitted, a resume, an agent's first error) on the console for the block."""
    handler = _AboveTheBar(stream)
    logger = logging.getLogger("aglverl")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def plot_rewards(
    rewards: list[float], path: Path, title: str = "aglverl: mean training reward per step"
) -> None:
    """Mean training reward per step, as a PNG (blocking)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o", markersize=3)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
