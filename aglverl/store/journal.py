"""Write-ahead journal: what the store accepted, appended before the agent is told, replayed after a restart.

Format: an append-only file of JSON lines (orjson), one record per accepted change: a task queued, an
attempt started, a result accepted (with the LLM calls it needs), a rollout failed, resources published, a
step opened or handed over, rollouts forgotten. Why not SQLite in WAL mode: the access pattern is append-only
and replay is one sequential read, so a plain file needs no schema, no extra dependency and one ``write``
per record; SQLite would add a B-tree and a WAL to get the same guarantee.

Guarantees: every record is written with one ``os.write`` on an ``O_APPEND`` descriptor before the store's
method returns, so it survives the process being killed (the data is in the kernel's page cache). With
``fsync=True`` it also survives power loss: :meth:`Journal.commit` waits for an ``fsync`` that covers the
record (group commit in a worker thread: one ``fsync`` for every record written before it started) and, after
the file was replaced by a compaction, for an ``fsync`` of its directory (without it the rename, and every
record appended to the new file, could be lost with the power). A torn last line (the process died mid-write)
is ignored on replay.

The file is compacted when it is opened and whenever it grows past ``compact_bytes`` (or past ``COMPACT_FLOOR``
and ``COMPACT_RATIO`` times the size of the last compacted state): it is rewritten with
only the records still needed (unfinished steps and owner-less rollouts, the latest resources), then renamed
over the old one, so it stays proportional to the work in flight, not to the length of the run. While serving
(:meth:`Journal.serve`) a compaction never blocks the event loop: the live state is snapshotted on the loop
(it is the loop's state), encoded, written and fsynced in a worker thread; records appended meanwhile go to the
old file and are kept aside, then appended to the new file before it is renamed over the old one. A
descriptor an ``fsync`` is still using is closed only once that ``fsync`` returned.
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
from anyio.abc import TaskStatus

__all__ = ["Journal"]

logger = logging.getLogger(__name__)

#: Rewrite the journal with only live records once it grows past this many bytes.
COMPACT_BYTES = 256 << 20
#: ... or, once past ``COMPACT_FLOOR`` bytes, past ``COMPACT_RATIO`` times what the last rewrite kept: the file
#: stays proportional to the live state (the work since the last checkpoint), at O(1) amortised cost per record.
COMPACT_FLOOR = 1 << 20
COMPACT_RATIO = 4.0


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
        self._live_size = 0  # bytes the last rewrite kept
        self._written = 0
        self._synced = 0
        self._syncing: anyio.Event | None = None
        #: bumped when the file is replaced: an ``fsync`` of the previous file no longer makes records durable
        self._generation = 0
        #: the generation whose rename is durable (its directory fsynced, ``fsync=True`` only)
        self._dir_synced = 0
        self._retired: list[int] = []  # descriptors of replaced files, closed once no fsync uses them
        self._compact_wanted: anyio.Event | None = None  # set by maybe_compact while serve() runs
        self._tail: list[bytes] | None = None  # records appended while a compaction rewrites the file
        self.compactions = 0
        self._compacted = anyio.Event()

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
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()

    @property
    def _tmp(self) -> Path:
        return self.path.with_name(self.path.name + ".tmp")

    def _rewrite(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Replace the file with ``records``, blocking (before serving: the rename is made durable here)."""
        self._write_tmp([_encode(record) for record in records])
        self._install([])
        if self.fsync:
            generation = self._generation
            self._fsync_dir()
            self._dir_synced = generation

    def _fsync_dir(self) -> None:
        """Make the journal's directory entry durable (a rename is only as durable as its directory)."""
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _sync(self, fd: int, directory: bool) -> None:
        """The worker thread's part of :meth:`commit`: the file's ``fsync``, then its directory's if it was
        replaced since the last one."""
        os.fsync(fd)
        if directory:
            self._fsync_dir()

    def _write_tmp(self, lines: Iterable[bytes]) -> None:
        """Write ``lines`` to the temporary file and make them durable (blocking: a worker thread's job)."""
        with self._tmp.open("wb") as f:
            for line in lines:
                f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def _install(self, tail: list[bytes]) -> None:
        """Append ``tail`` to the temporary file, rename it over the journal and write to it from now on."""
        fd = os.open(self._tmp, os.O_WRONLY | os.O_APPEND)
        for line in tail:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
        os.replace(self._tmp, self.path)
        old, self._fd = self._fd, fd
        self._generation += 1
        # the tail is in the new file but not yet fsynced there
        self._synced = min(self._synced, self._written - len(tail))
        self._size = os.fstat(fd).st_size
        self._live_size = self._size
        if old >= 0:
            if self._syncing is not None:
                self._retired.append(old)  # an fsync is running on it
            else:
                os.close(old)

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
        if self._tail is not None:
            self._tail.append(data)

    @property
    def size(self) -> int:
        """Bytes in the journal file now."""
        return self._size

    def maybe_compact(self) -> None:
        """Compact once the file has grown past ``compact_bytes``: in :meth:`serve`'s worker thread while it
        runs (this returns at once), right here otherwise (before serving, in tests)."""
        if not self._due() or self.live_records is None or self._tail is not None:
            return
        if self._compact_wanted is not None:
            self._compact_wanted.set()
            return
        before = self._size
        self._rewrite(self.live_records())
        self.compactions += 1
        logger.info("journal %s compacted: %d -> %d bytes", self.path, before, self._size)

    def _due(self) -> bool:
        if self._size > self.compact_bytes:
            return True
        return (
            self._size > min(self.compact_bytes, COMPACT_FLOOR)
            and self._size > COMPACT_RATIO * self._live_size
        )

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Compact off the event loop whenever :meth:`maybe_compact` asks, until cancelled (a rewrite in
        progress finishes first; the old file stays valid until the new one is complete)."""
        self._compact_wanted = anyio.Event()
        task_status.started()
        try:
            while True:
                await self._compact_wanted.wait()
                self._compact_wanted = anyio.Event()
                if self._due() and self.live_records is not None:
                    await self._compact()
        finally:
            self._compact_wanted = None
            self._tail = None

    async def _compact(self) -> None:
        assert self.live_records is not None
        before = self._size
        snapshot = list(self.live_records())  # the loop's state, read on the loop
        self._tail = []
        try:
            await anyio.to_thread.run_sync(self._write_tmp, map(_encode, snapshot))
            tail, self._tail = self._tail, None
            self._install(tail)
        finally:
            self._tail = None
        self.compactions += 1
        self._compacted.set()
        self._compacted = anyio.Event()
        logger.info("journal %s compacted off the loop: %d -> %d bytes", self.path, before, self._size)

    async def wait_compacted(self, seen: int) -> int:
        """Return once :attr:`compactions` exceeds ``seen`` (at once if it does); returns it."""
        while self.compactions <= seen:
            await self._compacted.wait()
        return self.compactions

    async def commit(self) -> None:
        """Return once every record written so far is durable (``fsync=True``): the file's ``fsync``, and its
        directory's when a compaction renamed a new file into place since the last one; at once otherwise.

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
            upto, fd, generation = self._written, self._fd, self._generation
            directory = self._dir_synced < generation  # renamed by a compaction since: not durable yet
            try:
                await anyio.to_thread.run_sync(self._sync, fd, directory)
                if directory:
                    self._dir_synced = max(self._dir_synced, generation)
                if generation == self._generation:  # else the file was replaced: fsync the new one
                    self._synced = max(self._synced, upto)
            finally:
                self._syncing = None
                while self._retired:
                    os.close(self._retired.pop())
                event.set()
