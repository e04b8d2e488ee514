"""One attempt's output (:class:`AgentLog`): what its processes write to their standard output and error, read
from a pipe and written to the attempt's log file up to a cap."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import IO

import anyio
import anyio.to_thread

__all__ = ["AgentLog"]

logger = logging.getLogger(__name__)

#: How much of the latest output is kept in memory, for the last line a failure's message quotes.
_TAIL_BYTES = 4096
_CHUNK = 1 << 16


class AgentLog:
    """The log of one attempt at ``path``: at most ``max_bytes`` of its output (what comes after is counted and
    dropped, and a last line says how much), the latest few KiB kept for :meth:`last_line`. Lines aglverl
    writes itself (:meth:`open`'s notice, the drop count) are not counted against the cap.

    :meth:`pump` the read end of the pipe the processes write to (it opens the file first, in a worker thread,
    with :attr:`notice` first, unless :meth:`open` did; it returns at the end of their output: every write end
    closed), then :meth:`close`.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.written = 0
        self.dropped = 0
        self._tail = bytearray()
        self._file: IO[bytes] | None = None
        #: aglverl's own lines, written first when :meth:`pump` opens the file.
        self.notice = ""

    async def open(self, notice: str = "") -> None:
        """Create (or empty) the file; write ``notice`` (aglverl's own lines) first."""
        await anyio.to_thread.run_sync(self.open_blocking, notice)

    def open_blocking(self, notice: str = "") -> None:
        """:meth:`open`, blocking (for a worker thread that prepares more than the log)."""
        self._file = _create(self.path, notice.encode())

    async def pump(self, fd: int) -> None:
        """Copy the pipe ``fd`` into the log until its end (then close ``fd``), the file opened first if it is not
        (meanwhile the processes' output waits in the pipe; a file that cannot be made is said in this process's
        log, and the output is read and dropped). Cancellation stops the copy (what was read is written) and
        closes ``fd``."""
        os.set_blocking(fd, False)
        try:
            if self._file is None:
                try:
                    await anyio.to_thread.run_sync(self.open_blocking, self.notice)
                except OSError as exc:
                    logger.warning("the log of an agent's process cannot be written: %s", exc)
            while True:
                await anyio.wait_readable(fd)
                try:
                    data = os.read(fd, _CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    return
                self._tail += data
                del self._tail[:-_TAIL_BYTES]
                keep = data[: max(0, self.max_bytes - self.written)]
                self.dropped += len(data) - len(keep)
                if keep and self._file is not None:
                    self.written += len(keep)
                    # an append of at most 64 KiB to a local file (the page cache): on the loop, as the journal's
                    self._file.write(keep)
        finally:
            os.close(fd)

    def last_line(self) -> str:
        """The last non-empty line of the output, shortened."""
        lines = [line.strip() for line in self._tail.decode(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""

    async def close(self) -> None:
        """Say how much was dropped (if anything), close the file."""
        await anyio.to_thread.run_sync(self.close_blocking)

    def close_blocking(self) -> None:
        """:meth:`close`, blocking (for a worker thread)."""
        file, self._file = self._file, None
        if file is None:
            return
        note = b""
        if self.dropped:
            note = (
                f"\naglverl: {self.dropped:,} more bytes of output were dropped: the log keeps the first "
                f"{self.max_bytes:,} (aglverl.processes.log_max_bytes)\n"
            ).encode()
        _finish(file, note)


def _create(path: Path, notice: bytes) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "wb", buffering=0)  # closed by AgentLog.close
    if notice:
        file.write(notice)
    return file


def _finish(file: IO[bytes], note: bytes) -> None:
    try:
        if note:
            file.write(note)
    finally:
        file.close()
