"""The README's shell session run as the text shows it, so that the README cannot drift from the code.

The README's first commands (``make demo``, ``make test``, ``make test-vllm``) are what ``.ci/run`` runs; its
``AsyncVERL`` snippet runs in ``tests/test_examples.py``; this runs the ``aglverl serve --tasks`` session.
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import anyio
import orjson
import pytest

from aglverl.testing.readme import README, shell_block

pytestmark = pytest.mark.anyio

#: The README sentence the session follows.
SESSION = "Its first stdout line gives the URLs; every later line is a finished rollout. A whole session:"
#: The port the session names. The one change made to the text: another free port where it is taken.
SESSION_PORT = "8000"


def _free_port() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.skipif(shutil.which("curl") is None, reason="the session uses curl")
async def test_the_serve_session_runs_as_written(tiny_model: Path, tmp_path: Path) -> None:
    """The session, in a fresh directory holding the checkout's ``examples/`` and this venv as ``.venv``: the
    daemon queues the file's three tasks, ``POST /tasks`` a fourth, the example's agents answer all four, and
    ``kill`` stops agents and daemon cleanly."""
    script = shell_block(SESSION)
    assert SESSION_PORT in script
    port = SESSION_PORT
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as probe:
        if probe.connect_ex(("127.0.0.1", int(SESSION_PORT))) == 0:  # taken on this machine
            port = _free_port()
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (tmp_path / "examples").symlink_to(README.parent / "examples")
    (tmp_path / "session.sh").write_text(script.replace(SESSION_PORT, port))
    with anyio.fail_after(300):
        result = await anyio.run_process(["bash", "-e", "session.sh"], cwd=tmp_path, check=False)
    output = result.stdout.decode()
    assert result.returncode == 0, output + result.stderr.decode()[-3000:]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    serving = orjson.loads(lines[0])
    assert serving["server_url"] == f"http://127.0.0.1:{port}" and serving["queued"] == 3
    rollouts = [orjson.loads(line) for line in lines[1:]]
    assert len(rollouts) == 4 and {r["status"] for r in rollouts} == {"succeeded"}
    assert sorted(r["input"]["prompt"] for r in rollouts) == ["Answer with one word: yes."] * 3 + ["Say yes."]
    assert '"status":"ok"' in output and '"queued":3' in output  # what curl and head printed
