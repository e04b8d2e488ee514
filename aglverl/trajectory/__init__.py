"""From finished rollouts to training rows: the trajectory path both trainers' producers share.

- :mod:`.batch` — a finished rollout's recorded calls become rows (merged chains of calls, or one per call),
  padded into a verl ``DataProto``;
- :mod:`.signals` — the training-signal controls (compact filtering, rejection sampling, step-wise advantage,
  turn weighting) and the advantage and log-prob math a trainer calls;
- :mod:`.groups` — :class:`~aglverl.trajectory.groups.TrajectoryProducer`: a sampling trainer's prompts
  (verl V1's) become GRPO groups of rollouts, each finished group's rows handed to a sink;
- :mod:`.steps` — :class:`~aglverl.trajectory.steps.RolloutCollector`: ``AgentDaemon.submit``'s steps become
  padded batches in ``AgentDaemon.batches``, for trainers of your own.
"""
