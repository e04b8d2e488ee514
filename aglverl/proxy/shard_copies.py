"""Each shard's copy of a resources version: its LLM endpoints rebased on that shard's URL.

:class:`ResourceCopies` is :class:`~aglverl.proxy.shards.ProxyShards`' part for the resources ids it hands
out: an attempt pinned to shard k gets the resources id ``<id>@shard<k>-<epoch>``, and an Agent Lightning client
that fetches it by id (:meth:`ResourceCopies.get`, synchronous) gets the store's version ``<id>`` with every
:class:`~aglverl.models.LLM` endpoint that named a shard (any URL a shard ever served on:
:meth:`ResourceCopies.served_on`) rebased on shard k's URL now, so that it calls its own shard. A copy is kept
while its base version and its shard's URL are unchanged. An id that is not a copy, or names no shard or no
stored version, is ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..models import LLM, ResourcesUpdate
from ..store import TaskStore
from .shard_handle import ShardHandle

__all__ = ["COPY_MARK", "ResourceCopies"]

#: The mark between a resources id and the shard it was copied for.
COPY_MARK = "@shard"


class ResourceCopies:
    """The shards' copies of the store's resources versions (see the module docstring)."""

    def __init__(self, store: TaskStore, shards: Sequence[ShardHandle]) -> None:
        self._store = store
        self._shards = shards
        self._urls: set[str] = set()  # every URL a shard ever served on (resources name them)
        self._copies: dict[str, tuple[ResourcesUpdate, ResourcesUpdate]] = {}

    @staticmethod
    def copy_id(resources_id: str, shard: ShardHandle) -> str:
        """The id of ``shard``'s copy of the version ``resources_id`` (its epoch in it)."""
        return f"{resources_id}{COPY_MARK}{shard.index}-{shard.epoch}"

    def served_on(self, url: str) -> None:
        """A shard serves on ``url``: endpoints naming it are rebased from now on."""
        self._urls.add(url)

    def get(self, resources_id: str) -> ResourcesUpdate | None:
        """A shard's copy of a resources version (the id :meth:`copy_id` gave), its LLM endpoints on that
        shard."""
        base_id, mark, tail = resources_id.rpartition(COPY_MARK)
        index, _, _ = tail.partition("-")
        if not mark or not index.isdigit() or int(index) >= len(self._shards):
            return None
        base = self._store.resources(base_id)
        if base is None:
            return None
        shard = self._shards[int(index)]
        cached = self._copies.get(resources_id)
        if cached is not None and cached[0] is base and self._endpoint_of(cached[1]) in ("", shard.url):
            return cached[1]
        copy = ResourcesUpdate(
            resources_id=resources_id,
            resources={name: self._rebased(resource, shard.url) for name, resource in base.resources.items()},
        )
        self._copies[resources_id] = (base, copy)
        return copy

    def _rebased(self, resource: Any, url: str) -> Any:
        if not isinstance(resource, LLM):
            return resource
        for old in self._urls:
            if resource.endpoint == old or resource.endpoint.startswith(old + "/"):
                return resource.model_copy(update={"endpoint": url + resource.endpoint[len(old) :]})
        return resource

    def _endpoint_of(self, update: ResourcesUpdate) -> str:
        for resource in update.resources.values():
            if isinstance(resource, LLM):
                for old in self._urls:
                    if resource.endpoint.startswith(old + "/"):
                        return old
        return ""
