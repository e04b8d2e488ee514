"""aglverl on verl's V1 trainer: the daemon as the trainer's trajectory producer. Every V1-specific call is here.

verl's V1 trainer (``verl/trainer/ppo/v1``, the default of verl's ``ppo_trainer.yaml``) runs its own loop,
modes (``trainer.v1.trainer_mode``: sync, colocate_async, separate_async), checkpoints and resume. aglverl
plugs into its extension points and adds what only it can (agents it does not control, over HTTP):

- :class:`DaemonAgentLoopManager` — what verl's trainer calls ``generate_sequences(prompts)`` on: the prompts
  go to the daemon's :class:`~aglverl.trajectory.groups.TrajectoryProducer` (``n`` tasks each) and the call returns at
  once, as verl's ``AgentLoopManagerTQ`` does.
- :class:`TransferQueueSink` — the producer's sink: each finished group's rows go into TransferQueue the way
  verl's ``AgentLoopWorkerTQ`` files them (one key per row, ``{uid}_{session}_{turn}`` with the turn of the
  row's first call: a merged chain of calls is one row; verl's fields, the tags ``status``, lengths,
  ``global_steps``, ``min_global_steps`` / ``max_global_steps`` over the weight versions the proxy recorded for
  the row's calls), then the prompt's group status (``running`` at dispatch, ``finished`` / ``failure``).
- :class:`EventReplayBuffer` / :class:`EventReplayBufferAsync` — verl's replay buffers, installed through
  ``trainer.v1.sampler.custom_sampler``, that wait for the producer's next finished group (an event) where
  verl's sleep ``poll_interval`` seconds (``replay_buffer.py:144``); aglverl's rejection sampling is verl's
  DAPO group filter fed by the producer's classification.
- :func:`trainer_class` — verl's trainer for the configured mode with hooks: the proxy holds and drains the
  agents' calls before the replicas sleep and lets them on after the weights are updated (calls then carry
  the new weight version); advantages with aglverl's training-signal controls, on whole groups
  (``_compute_advantage``); aglverl's step metrics (``_compute_metrics``); the journal trimmed after every
  checkpoint (``_save_checkpoint``).
- :class:`SampleDataset` — task inputs as verl's dataset (``data.custom_cls``): verl's stateful data loader
  samples, shuffles and checkpoints them; each item's ``raw_prompt`` is the task input agents get.
- :func:`running` / :func:`train` — the run a :class:`RunPlan` describes (the algorithm's, complete but for what
  only the trainer knows, which :func:`daemon_config_for` fills in): TransferQueue, the trainer, the daemon
  (and what runs beside ``fit``, e.g. agents), ``fit``.

verl's blocking calls run in a worker thread (``anyio.to_thread``); everything that touches the daemon goes
back to the event loop with ``anyio.from_thread`` and an explicit loop token. Checked against verl 0.9.1 and
TransferQueue 0.1.11 (:mod:`aglverl.verl_plugin.patches` refuses other releases).

The rooms: :mod:`.active_run` (the run verl's callbacks find), :mod:`.dataset`, :mod:`.manager`, :mod:`.sink`,
:mod:`.sampler`, :mod:`.hooks` (the trainer class with aglverl's hooks and phases) and :mod:`.run`.
"""

from __future__ import annotations

from .active_run import INPUT_KEY, TRAIN_FILES, VAL_FILES
from .dataset import SampleDataset
from .hooks import trained_uids, trainer_class
from .manager import DaemonAgentLoopManager
from .run import (
    RunPlan,
    backend_nodes,
    backend_urls,
    close_trainer,
    daemon_config_for,
    running,
    sampling_parameters,
    served_model_name,
    train,
)
from .sampler import EventReplayBuffer, EventReplayBufferAsync, sampler_name
from .sink import TransferQueueSink

__all__ = [
    "INPUT_KEY",
    "MODULE_PATH",
    "TRAIN_FILES",
    "VAL_FILES",
    "DaemonAgentLoopManager",
    "EventReplayBuffer",
    "EventReplayBufferAsync",
    "RunPlan",
    "SampleDataset",
    "TransferQueueSink",
    "backend_nodes",
    "backend_urls",
    "close_trainer",
    "daemon_config_for",
    "running",
    "sampler_name",
    "sampling_parameters",
    "served_model_name",
    "train",
    "trained_uids",
    "trainer_class",
]

#: This package, as verl's ``load_module`` names one (``trainer.v1.sampler.custom_sampler.path`` and
#: ``data.custom_cls.path``: the classes verl builds by name are re-exported here).
MODULE_PATH = f"pkg://{__name__}"
