"""`aglverl serve` as a real process: serves on loopback, needs its token, and stops cleanly on Ctrl-C/SIGTERM."""

from __future__ import annotations

import signal
import sys

import aiohttp
import anyio
import orjson
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["ctrl-c", "sigterm"]
)
async def test_serve_runs_the_daemon_and_shuts_down_on_signal(sig: signal.Signals, code: int) -> None:
    cmd = [sys.executable, "-m", "aglverl.cli", "serve", "--port", "0", "--proxy-port", "0", "--token", "tok"]
    process = await anyio.open_process(cmd)
    try:
        assert process.stdout is not None
        with anyio.fail_after(60):
            info = orjson.loads(await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 1 << 16))
        server_url, proxy_url = info["server_url"], info["proxy_url"]
        assert server_url.startswith("http://127.0.0.1:") and proxy_url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server_url}/healthz") as resp:
                assert resp.status == 200
            async with http.get(f"{server_url}/task") as resp:
                assert resp.status == 401
            headers = {"Authorization": "Bearer tok"}
            async with http.get(f"{server_url}/resources/latest", headers=headers) as resp:
                main_llm = orjson.loads(await resp.read())["resources"]["main_llm"]
            assert main_llm["resource_type"] == "proxy_llm"
            assert main_llm["endpoint"] == f"{proxy_url}/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1"
            # Parked long-polls must not hold shutdown up.
            async with anyio.create_task_group() as tg:

                async def park() -> None:
                    async with http.get(f"{server_url}/task?wait=60", headers=headers) as resp:
                        assert orjson.loads(await resp.read())["is_available"] is False

                tg.start_soon(park)
                await anyio.sleep(0.3)
                process.send_signal(sig)
                with anyio.fail_after(15):
                    await process.wait()
        assert process.returncode == code
        assert process.stderr is not None
        stderr = b""
        with anyio.fail_after(5):
            async for chunk in process.stderr:
                stderr += chunk
        assert b"Traceback" not in stderr, stderr.decode(errors="replace")
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", int(server_url.rsplit(":", 1)[1]))
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
