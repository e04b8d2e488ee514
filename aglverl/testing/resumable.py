"""Resumable training runs in a process of their own, for the SIGKILL tests and the training soak.

:func:`resumable_config` is the one-word task's ``AsyncVERL`` overrides for such a run (2 samples x 2 rollouts
a step, checkpoints and the daemon's journal under one directory, ``resume_mode: auto``); :func:`end_session`
ends whatever a killed run left behind in its session (Ray's processes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

__all__ = ["end_session", "resumable_config"]


def resumable_config(
    directory: Path,
    *,
    mode: str = "sync",
    steps: int = 4,
    save_freq: int = 1,
    aglverl: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Overrides of a resumable run in ``directory``; ``aglverl`` adds keys to the ``aglverl`` section."""
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 4, "shuffle": False},
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "v1": {"trainer_mode": mode},
            "total_training_steps": steps,
            "save_freq": save_freq,
            "test_freq": -1,
            "val_before_train": False,
            "resume_mode": "auto",
            "default_local_dir": str(directory / "checkpoints"),
            "logger": [],
        },
        "ray_kwargs": {"ray_init": {"log_to_driver": False}},
        "aglverl": {"journal": "auto", **(aglverl or {})},
    }


def end_session(session: int) -> None:
    """Kill every process left in the session ``session`` (a run started with ``start_new_session``)."""
    survivors = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == session:
                survivors.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    for proc in survivors:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(survivors, timeout=30)
