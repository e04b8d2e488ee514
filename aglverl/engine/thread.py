"""An :class:`~aglverl.engine.server.InferenceServer` on a thread of its own, with its own asyncio loop.

For processes whose event loop is not ours (verl's Ray worker, a synchronous script): the server is served on
a dedicated thread; :meth:`InferenceServerThread.start` returns once it accepts connections and
:meth:`~InferenceServerThread.stop` shuts it down and joins the thread.
"""

from __future__ import annotations

import asyncio
import threading

from .server import InferenceServer, call_soon

__all__ = ["LOOP_THREAD_NAME", "InferenceServerThread"]

#: Name of :class:`InferenceServerThread`'s event-loop thread.
LOOP_THREAD_NAME = "aglverl-inference-loop"


class InferenceServerThread:
    """Hosts an :class:`InferenceServer` on a dedicated thread with its own asyncio loop.

    For processes whose event loop is not ours (verl's Ray worker): :meth:`start` returns once the server
    accepts connections (re-raising whatever stopped it from starting), :meth:`stop` shuts it down and joins
    the thread. The server's thread-safe methods (``load_weights``, ``sleep``, ``wake_up``, ``stats``) and
    ``generate_ids`` (from any asyncio loop) are used directly on :attr:`server`. Also a context manager.
    """

    def __init__(self, server: InferenceServer, *, name: str = LOOP_THREAD_NAME) -> None:
        self.server = server
        self.name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, timeout: float = 60.0) -> str:
        """Start serving on the thread; returns the URL. Raises ``RuntimeError`` if it fails to start."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"the inference server did not start within {timeout} s")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"the inference server failed to start: {self._error}") from self._error
        return self.server.url

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server (in-flight requests get ``SHUTDOWN_GRACE`` seconds) and join the thread."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None:
            call_soon(loop, stop.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"the inference server thread did not stop within {timeout} s")
        self._thread = self._loop = self._stop = None

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); a thread has nowhere else to raise
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.server:
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> InferenceServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
