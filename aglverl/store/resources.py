"""Versions of the named resources agents use (:class:`ResourceVersions`): each published version keeps its id,
the latest is what a task without one gets, and every change is journaled (``resources`` records).

Single loop, no awaits; an unknown id to replace is a ``KeyError``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..models import NamedResources, ResourcesUpdate

__all__ = ["ResourceVersions"]


class ResourceVersions:
    """The published resources versions, oldest first; ``journal(record)`` writes a change down."""

    def __init__(self, journal: Callable[[Mapping[str, Any]], None]) -> None:
        self._journal = journal
        self._versions: dict[str, ResourcesUpdate] = {}
        self.latest_id: str | None = None

    def add(self, resources: NamedResources, resources_id: str | None = None) -> ResourcesUpdate:
        update = ResourcesUpdate(resources_id=resources_id or f"res-{uuid.uuid4().hex}", resources=resources)
        self._versions[update.resources_id] = update
        self.latest_id = update.resources_id
        self._journal({"kind": "resources", "update": update.model_dump(mode="json")})
        return update

    def replace(self, resources_id: str, resources: NamedResources) -> None:
        if resources_id not in self._versions:
            raise KeyError(f"unknown resources id {resources_id!r}")
        update = ResourcesUpdate(resources_id=resources_id, resources=resources)
        self._versions[resources_id] = update
        self._journal({"kind": "resources", "update": update.model_dump(mode="json"), "latest": False})

    def all(self) -> list[ResourcesUpdate]:
        return list(self._versions.values())

    def get(self, resources_id: str) -> ResourcesUpdate | None:
        return self._versions.get(resources_id)

    def records(self) -> Iterator[dict[str, Any]]:
        """The records that rebuild every version and which one is the latest."""
        for update in self._versions.values():
            latest = update.resources_id == self.latest_id
            yield {"kind": "resources", "update": update.model_dump(mode="json"), "latest": latest}

    def apply(self, record: Mapping[str, Any]) -> None:
        """Replay a ``resources`` record (not journaled again)."""
        update = ResourcesUpdate.model_validate(record["update"])
        self._versions[update.resources_id] = update
        if record.get("latest", True):
            self.latest_id = update.resources_id
