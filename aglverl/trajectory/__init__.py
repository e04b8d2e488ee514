"""From finished rollouts to training rows: the one trajectory path both trainers' producers share.

A finished rollout goes down one path, floor by floor (each module imports only the ones above it)::

    store record --rollouts--> FinishedRollout --chains, rows--> jagged Rows --+--> sink (TransferQueue), as they are
                                                                              +--batch--> padded DataProto

- :mod:`.signals` — the training-signal controls (compact filtering, rejection sampling, step-wise advantage,
  turn weighting: :func:`~aglverl.trajectory.signals.plan_rows`) and the math a trainer runs on the rows
  (GRPO advantages with weighted group members, per-rollout weights, the engine's log-probs against the
  trainer's);
- :mod:`.rollouts` — :class:`~aglverl.trajectory.rollouts.FinishedRollout`, what the row builder takes, read
  from the store's record of a terminal rollout (its turns, rewards, logprobs, weight versions, why it ended);
- :mod:`.chains` — which calls make each row: calls that extend each other chain, a chain is cut to the width;
- :mod:`.rows` — :func:`~aglverl.trajectory.rows.build_rows`: finished rollouts become jagged rows, each only
  as long as its ids (prompt, response, the response mask, its calls, weight versions, logprobs, score);
- :mod:`.batch` — :func:`~aglverl.trajectory.batch.build_batch`: the rows padded into a verl ``DataProto``
  (the only place anything is padded);
- :mod:`.groups` — :class:`~aglverl.trajectory.groups.TrajectoryProducer`: a sampling trainer's prompts (verl
  V1's) become GRPO groups of rollouts, each finished group's jagged rows handed to a sink;
- :mod:`.steps` — :class:`~aglverl.trajectory.steps.RolloutCollector`: ``AgentDaemon.submit``'s steps become
  padded batches in ``AgentDaemon.batches``, for trainers of your own.
"""
