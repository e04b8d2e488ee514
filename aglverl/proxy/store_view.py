"""What the proxy needs of the store, as an interface: admitting an attempt's calls and keeping their records.

:class:`~aglverl.store.tasks.TaskStore` is one (the proxy in the daemon's process); a proxy shard in a process of its
own holds another (a table of the attempts pinned to it, pushed by the store, and the records of their calls,
taken by the store when an attempt finishes). The proxy never reaches the store by any other way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..store import LLMCall

__all__ = ["ProxyStore"]


class ProxyStore(Protocol):
    """The store as the proxy sees it. Every method is called on the proxy's event loop and returns at once."""

    @property
    def vocab_size(self) -> int | None:
        """Token ids at or above this are not valid ids (``None``: unchecked)."""
        ...

    def check_attempt(self, rollout_id: str, attempt_id: str) -> None:
        """Admit a call of this attempt, or raise :class:`~aglverl.store.StoreError` (its ``status`` and message
        say why: an unknown rollout or attempt is a 404, a finished rollout a 409)."""
        ...

    def record_calls(self, rollout_id: str, attempt_id: str, calls: Sequence[LLMCall]) -> bool:
        """Keep the records of one call of this attempt; ``False`` when the attempt is over (not kept)."""
        ...
