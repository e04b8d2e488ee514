"""``AsyncVERL``: the whole training run — verl's config, Ray, verl's workers, the daemon and (optionally) agents.

::

    algo = AsyncVERL({"actor_rollout_ref": {"model": {"path": "tiny"}, "rollout": {"n": 8}},
                      "data": {"train_batch_size": 16}, "trainer": {"total_training_steps": 20},
                      "aglverl": {"agents": 32}}, agent=my_agent)
    metrics = await algo.run(train_dataset=[{"question": ...}, ...], val_dataset=[...])

The config is verl's own: the user's overrides (nested mappings, or dotted keys as on verl's command line)
are merged onto verl's packaged ``ppo_trainer.yaml``, composed by Hydra exactly as
``python -m verl.trainer.main_ppo`` composes it, plus an ``aglverl:`` section for the daemon
(:class:`DaemonOptions`). A key verl's YAML does not have is an error naming it (free-form mappings such as
``model.override_config`` accept any key), and so is a value of the wrong type, out of its range or not one of
verl's registered choices (:mod:`aglverl.algorithm.validation`). verl's defaults that only fit GPU-sized batches are
fitted or flagged, one line each (:func:`_batch_defaults`); a run is named after its script, so its
checkpoints are its own (:func:`_run_names`). On a machine without a GPU the CPU platform and the embedded
rollout are selected (:data:`CPU_DEFAULTS`, each of which the user may override); with GPUs, verl's vLLM rollout.

``run`` starts or joins Ray (``RAY_ADDRESS``; a Ray started here listens on loopback only), starts verl's V1
trainer (``trainer.v1.trainer_mode``: its workers, inference replicas and TransferQueue), hosts an
:class:`AgentDaemon` (and the agents, if ``agent=`` was given) on the caller's loop as the trainer's trajectory
producer, and runs verl's ``fit`` (:mod:`aglverl.verl_v1`). Blocking Ray and torch calls run in worker threads.

The rooms: :mod:`.config` (the config, composed and fitted), :mod:`.options` (the ``aglverl:`` section),
:mod:`.validation` (every value checked), :mod:`.samples` (task inputs), :mod:`.runtime` (Ray and verl's
processes), :mod:`.vllm_tools` (tool calling on verl's vLLM rollout) and :mod:`.async_verl` (``AsyncVERL``).
"""

from __future__ import annotations

from .async_verl import AsyncVERL
from .config import CPU_DEFAULTS, GPU_DEFAULTS, VLLM_CPU_ROLLOUT, VLLM_TOKEN_IN, compose_config
from .options import DaemonOptions
from .runtime import PLATFORM_ENV, VerlRuntime, verl_runtime
from .samples import Samples, load_samples
from .validation import ConfigError

__all__ = [
    "CPU_DEFAULTS",
    "GPU_DEFAULTS",
    "PLATFORM_ENV",
    "VLLM_CPU_ROLLOUT",
    "VLLM_TOKEN_IN",
    "AsyncVERL",
    "ConfigError",
    "DaemonOptions",
    "Samples",
    "VerlRuntime",
    "compose_config",
    "load_samples",
    "verl_runtime",
]
