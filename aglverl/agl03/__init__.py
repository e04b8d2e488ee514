"""Agent Lightning 0.2/0.3 on aglverl: ``agl.Trainer(algorithm=VERL(config)).fit(agent)`` trained by aglverl.

A room above :mod:`aglverl.algorithm` (it trains with :class:`~aglverl.algorithm.AsyncVERL`) and so above
everything the daemon is built of; nothing below imports it:

- :mod:`.verl` — :class:`VERL`, an ``agl.Algorithm`` in ``agl.VERL``'s place;
- :mod:`.config` — ``agl.VERL``'s ``agentlightning:`` section (0.2/0.3) mapped onto aglverl's keys
  (:func:`map_verl_section`);
- :mod:`.store_bridge` — :class:`LightningStoreBridge`: aglverl's rollout attempts as rollouts of the Trainer's
  ``LightningStore`` (what its runners dequeue), and :class:`DequeueBell` (the runners' dequeue as a long-poll).

:mod:`.verl` and :mod:`.store_bridge` need ``agentlightning==0.3.0`` (or 0.2) installed, and are imported on
first use: ``from aglverl.agl03 import VERL``. The documented ``from aglverl.agent_lightning import VERL`` gives the
same class. :mod:`.config` needs nothing beyond aglverl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .verl import VERL

__all__ = ["VERL"]


def __getattr__(name: str) -> Any:
    if name == "VERL":  # needs agentlightning 0.2/0.3 installed: imported only when asked for
        from .verl import VERL

        return VERL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
