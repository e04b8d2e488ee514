"""Agent Lightning v1.0 on aglverl: its server API on aglverl's task server, its config section, its wire shapes.

Agents, controllers and trainers written for Agent Lightning v1.0 (``agentlightning==1.0.2``) talk to aglverl's
task server as they talk to Agent Lightning's server, at the same one base URL:

- :mod:`.api` — :class:`AgentLightningAPI`: the routes (rollouts, the terminal cursor, events, models, the
  proxy's pause / resume / state), mounted on every :class:`~aglverl.daemon.AgentDaemon`'s task server;
- :mod:`.rollouts` — :class:`AgentLightningRollouts`: Agent Lightning's rollouts as a view of aglverl's store
  (one Agent Lightning rollout per aglverl attempt: how retries appear, the state machine), holding its parts:
  :mod:`.slot` (one rollout), :mod:`.cursor` (the terminal cursor; how long ended API rollouts are kept),
  :mod:`.events` (the bounds on posted events; the events made from aglverl's records), :mod:`.errors`;
- :mod:`.hop` — :class:`ProxyHop`: Agent Lightning's proxy path relayed to aglverl's LLM proxy;
- :mod:`.config` — the ``agentlightning:`` config section mapped onto aglverl's keys
  (:func:`map_section`), and :class:`AgentLightningSettings`;
- :mod:`.wire` — the JSON shapes.

The built-in runner that runs Agent Lightning agent classes (and any program) one process per rollout is
:mod:`aglverl.process_runner`.

Agent Lightning 0.2/0.3 is :mod:`aglverl.agl03`, a room above :mod:`aglverl.algorithm`; the documented import
surface of both is :mod:`aglverl.agent_lightning`. Nothing here imports either.
"""

from __future__ import annotations

from .api import AgentLightningAPI
from .config import AgentLightningSettings, map_section, rollout_config_for
from .hop import ProxyHop
from .rollouts import AgentLightningRollouts, retry_id

__all__ = [
    "AgentLightningAPI",
    "AgentLightningRollouts",
    "AgentLightningSettings",
    "ProxyHop",
    "map_section",
    "retry_id",
    "rollout_config_for",
]
