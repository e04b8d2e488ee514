"""Agent Lightning v1.0 on aglverl: its server API on aglverl's task server, its config section, its wire shapes.

Agents, controllers and trainers written for Agent Lightning v1.0 (``agentlightning==1.0.2``) talk to aglverl's
task server as they talk to Agent Lightning's server, at the same one base URL:

- :mod:`.api` — :class:`AgentLightningAPI`: the routes (rollouts, the terminal cursor, events, models, the
  proxy's pause / resume / state), mounted on every :class:`~aglverl.daemon.AgentDaemon`'s task server;
- :mod:`.rollouts` — :class:`AgentLightningRollouts`: Agent Lightning's rollouts as a view of aglverl's store
  (one Agent Lightning rollout per aglverl attempt: how retries appear, the state machine, the cursor);
- :mod:`.hop` — :class:`ProxyHop`: Agent Lightning's proxy path relayed to aglverl's LLM proxy;
- :mod:`.config` — the ``agentlightning:`` config section mapped onto aglverl's keys
  (:func:`map_section`), and :class:`AgentLightningSettings`;
- :mod:`.wire` — the JSON shapes.

The built-in runner that runs Agent Lightning agent classes (and any program) one process per rollout is
:mod:`aglverl.process_runner`.

Agent Lightning 0.2/0.3 (``agl.Trainer(algorithm=agl.VERL(config)).fit(agent)``, Python 3.11 with
``agentlightning==0.3.0`` installed): :class:`VERL` (:mod:`.verl`), an ``agl.Algorithm`` in ``agl.VERL``'s place;
:mod:`.verl_config` (its ``agentlightning:`` section); :mod:`.lightning_store` (aglverl's attempts as rollouts of
the Trainer's store). ``VERL`` is imported on first use: the rest of this package does not need agentlightning.
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


def __getattr__(name: str) -> object:
    if name == "VERL":  # needs agentlightning 0.2/0.3 installed: imported only when asked for
        from .verl import VERL

        return VERL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
