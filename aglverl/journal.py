"""Write-ahead journal: what the store accepted, appended before the agent is told, replayed after a restart.

Format: an append-only file of JSON lines (orjson), one record per accepted change: a task queued, an
attempt started, a result accepted (with the LLM calls it needs), a rollout failed, resources published, a
step opened or handed over, rollouts forgotten. Why not SQLite in WAL mode: the access pattern is append-only
and replay is one sequential read, so a plain file needs no schema, no extra dependency and one ``write``
per record; SQLite would add a B-tree and a WAL to get the same guarantee.

Guarantees: every record is written with one ``os.write`` on an ``O_APPEND`` descriptor before the store's
method returns, so it survives the process being killed (the data is in the kernel's page cache). With
``fsync=True`` it also survives power loss: :meth:`Journal.commit` waits for an ``fsync`` that covers the
record (group commit in a worker thread: one ``fsync`` for every record written before it started). A torn
last line (the process died mid-write) is ignored on replay.

The file is compacted when it is opened and whenever it grows past ``compact_bytes``: it is rewritten with
only the records still needed (unfinished steps and owner-less rollouts, the latest resources), then renamed
over the old one, so it stays proportional to the work in flight, not to the length of the run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import orjson

__all__ = ["Journal"]

logger = logging.getLogger(__name__)

#: Rewrite the journal with only live records once it grows past this many bytes.
COMPACT_BYTES = 256 << 20


def _encode(record: Mapping[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a journal file in order; a torn or corrupt trailing line ends the replay."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                logger.warning("journal %s: line %d is torn or corrupt; replay stops there", path, n)
                return


class Journal:
    """An append-only JSON-lines journal (see the module docstring). Single event loop; not thread-safe.

    ``live_records`` is a callback returning the records that describe the current state; it is used to
    compact the file (the store provides it).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, fsync: bool = False, compact_bytes: int = COMPACT_BYTES
    ):
        self.path = Path(path)
        self.fsync = fsync
        self.compact_bytes = compact_bytes
        self.live_records: Callable[[], Iterable[Mapping[str, Any]]] | None = None
        self._fd = -1
        self._size = 0
        self._written = 0
        self._synced = 0
        self._syncing: anyio.Event | None = None

    def replay(self) -> list[dict[str, Any]]:
        """Read every record of the existing file (before :meth:`open`)."""
        return list(read_records(self.path))

    def open(self, initial: Iterable[Mapping[str, Any]] = ()) -> None:
        """Start a fresh file holding ``initial`` (the compacted state), atomically replacing the old one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rewrite(initial)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _rewrite(self, records: Iterable[Mapping[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("wb") as f:
            for record in records:
                f.write(_encode(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record; it has reached the kernel when this returns."""
        if self._fd < 0:
            raise RuntimeError(f"journal {self.path} is not open")
        data = _encode(record)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self._size += len(data)
        self._written += 1

    def maybe_compact(self) -> None:
        """Rewrite the file with only live records once it has grown past ``compact_bytes``."""
        if self._size > self.compact_bytes and self.live_records is not None:
            before = self._size
            self._rewrite(self.live_records())
            logger.info("journal %s compacted: %d -> %d bytes", self.path, before, self._size)

    async def commit(self) -> None:
        """Return once every record written so far is durable (``fsync=True``); at once otherwise.

        Concurrent callers share one ``fsync``. Cancellation only stops the wait; the ``fsync`` goes on.
        """
        if not self.fsync:
            return
        target = self._written
        while self._synced < target:
            if self._syncing is not None:
                await self._syncing.wait()
                continue
            self._syncing = event = anyio.Event()
            upto = self._written
            try:
                await anyio.to_thread.run_sync(os.fsync, self._fd)
                self._synced = max(self._synced, upto)
            finally:
                self._syncing = None
                event.set()
