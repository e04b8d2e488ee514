"""Agent Lightning on aglverl, as documented: the public names of both adapters in one import path.

- Agent Lightning v1.0 (``agentlightning==1.0.2``: its server API on the task server, its config section, its
  controllers' contract) is :mod:`aglverl.agl10`; its names are re-exported here
  (:class:`AgentLightningAPI`, :class:`AgentLightningSettings`, ...).
- Agent Lightning 0.2/0.3 (``agl.Trainer(algorithm=agl.VERL(config)).fit(agent)``) is :mod:`aglverl.agl03`:
  ``from aglverl.agent_lightning import VERL`` gives its :class:`~aglverl.agl03.verl.VERL`, imported on first use
  (it needs ``agentlightning==0.3.0`` installed; nothing else here does).

This package stands above both and holds no code of its own: aglverl's own modules import :mod:`aglverl.agl10`
or :mod:`aglverl.agl03` directly, never this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..agl10 import (
    AgentLightningAPI,
    AgentLightningRollouts,
    AgentLightningSettings,
    ProxyHop,
    map_section,
    retry_id,
    rollout_config_for,
)

if TYPE_CHECKING:
    from ..agl03.verl import VERL

__all__ = [
    "VERL",
    "AgentLightningAPI",
    "AgentLightningRollouts",
    "AgentLightningSettings",
    "ProxyHop",
    "map_section",
    "retry_id",
    "rollout_config_for",
]


def __getattr__(name: str) -> Any:
    if name == "VERL":  # needs agentlightning 0.2/0.3 installed: imported only when asked for
        from ..agl03.verl import VERL

        return VERL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
