"""`aglverl serve` and `aglverl serve-model` as real processes: serve on loopback, stop cleanly on Ctrl-C/SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import anyio
import anyio.abc
import orjson
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def children_take_ctrl_c():  # type: ignore[no-untyped-def]
    """A test run started in the background of a shell without job control (``cmd &``, ``nohup``) inherits
    SIGINT ignored, and so would the servers it starts (Python keeps an inherited SIG_IGN, as a shell's
    background jobs expect). Ctrl-C is what these tests send, so the children start with it at its default:
    a Python handler in this process is reset to SIG_DFL across ``exec``."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


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
        await _assert_stopped_cleanly(process, code, [server_url])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _start(cmd: list[str]) -> tuple[anyio.abc.Process, dict]:
    process = await anyio.open_process(cmd)
    assert process.stdout is not None
    with anyio.fail_after(90):
        info = orjson.loads(await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 1 << 16))
    return process, info


async def _stop(process: anyio.abc.Process, sig: signal.Signals, code: int, urls: list[str]) -> None:
    """Send ``sig``, wait for the exit, and check it was clean (see :func:`_assert_stopped_cleanly`)."""
    process.send_signal(sig)
    with anyio.fail_after(30):
        await process.wait()
    await _assert_stopped_cleanly(process, code, urls)


async def _assert_stopped_cleanly(process: anyio.abc.Process, code: int, urls: list[str]) -> None:
    """The exited process returned ``code``, printed no traceback, and no longer listens at ``urls``."""
    assert process.returncode == code
    assert process.stderr is not None
    stderr = b""
    with anyio.fail_after(5):
        async for chunk in process.stderr:
            stderr += chunk
    assert b"Traceback" not in stderr, stderr.decode(errors="replace")
    for url in urls:
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", _port(url))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_serve_model_runs_the_inference_server_alone(tiny_model: Path) -> None:
    cmd = [sys.executable, "-m", "aglverl.cli", "serve-model", "--model", "tiny", "--port", "0"]
    process, info = await _start(cmd)
    try:
        url = info["url"]
        assert url.startswith("http://127.0.0.1:") and info["model"] == "tiny"
        assert info["model_path"] == str(tiny_model)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["tiny"]
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4}
            async with http.post(
                f"{url}/v1/chat/completions", json=body | {"return_token_ids": True}
            ) as resp:
                answer = await resp.json()
            assert resp.status == 200 and 1 <= len(answer["choices"][0]["token_ids"]) <= 4
        await _stop(process, signal.SIGTERM, 0, [url])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_serve_with_a_local_model_puts_it_behind_the_proxy(tiny_model: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "aglverl.cli",
        "serve",
        "--port",
        "0",
        "--proxy-port",
        "0",
        "--local-model",
        "tiny",
    ]
    process, info = await _start(cmd)
    try:
        assert info["backends"] == [info["model_url"]]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{info['server_url']}/resources/latest") as resp:
                main_llm = (await resp.json())["resources"]["main_llm"]
            assert main_llm["model"] == "tiny"
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4}
            async with http.post(f"{info['proxy_url']}/v1/chat/completions", json=body) as resp:
                answer = await resp.json()
            assert resp.status == 200 and answer["model"] == "tiny"
        await _stop(process, signal.SIGINT, 130, [info["server_url"], info["proxy_url"], info["model_url"]])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_serve_hands_out_tasks_from_a_file_and_the_route_and_prints_each_result(tmp_path: Path) -> None:
    """`aglverl serve --tasks FILE` queues the file's rows, `POST /tasks` more, and every finished rollout is a
    JSON line on stdout after the command's own; agents run anywhere (here: run_agents in this process)."""
    from aglverl import run_agents

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(orjson.dumps({"x": x}).decode() + "\n" for x in (0.25, 0.5, 0.75)))
    cmd = [sys.executable, "-m", "aglverl.cli", "serve", "--port", "0", "--proxy-port", "0", "--token", "tok"]
    process = await anyio.open_process([*cmd, "--tasks", str(tasks)])
    try:
        assert process.stdout is not None
        lines = BufferedByteReceiveStream(process.stdout)
        with anyio.fail_after(60):
            info = orjson.loads(await lines.receive_until(b"\n", 1 << 16))
        assert info["queued"] == 3

        async def agent(task_input: dict, llm: object) -> float:
            return float(task_input["x"])

        headers = {"Authorization": "Bearer tok"}
        async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
            tg.start_soon(lambda: run_agents(info["server_url"], agent, concurrency=2, token="tok"))
            body = orjson.dumps({"inputs": [{"x": 1.0}]})
            async with http.post(f"{info['server_url']}/tasks", data=body, headers=headers) as resp:
                assert resp.status == 200
                (posted,) = (await resp.json())["rollout_ids"]
            with anyio.fail_after(30):
                results = [orjson.loads(await lines.receive_until(b"\n", 1 << 16)) for _ in range(4)]
            tg.cancel_scope.cancel()
        assert sorted((r["input"]["x"], r["final_reward"], r["status"]) for r in results) == [
            (x, x, "succeeded") for x in (0.25, 0.5, 0.75, 1.0)
        ]
        assert posted in {r["rollout_id"] for r in results}
        await _stop(process, signal.SIGTERM, 0, [info["server_url"], info["proxy_url"]])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_serve_refuses_a_tasks_file_it_cannot_read_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"x": 1}\nnot json\n')
    for path, named in ((tmp_path / "missing.jsonl", "does not exist"), (bad, "line 2: not JSON")):
        cmd = [
            sys.executable,
            "-m",
            "aglverl.cli",
            "serve",
            "--port",
            "0",
            "--proxy-port",
            "0",
            "--tasks",
            str(path),
        ]
        done = await anyio.run_process(cmd, check=False)
        assert done.returncode == 1
        assert f"--tasks {path}" in done.stderr.decode() and named in done.stderr.decode()


async def test_demo_runs_as_the_makefile_runs_it(tiny_model: Path, tmp_path: Path) -> None:
    """``make demo`` is ``.venv/bin/aglverl demo --out demo-out``: a relative ``--out``, from the directory the
    command is run in. Everything it writes lands in that one directory (046b5eb joined the library log's path
    onto ``--out`` twice and crashed with ``demo-out/demo-out/train.log``). One step is enough: this checks the
    command, `make demo` in CI checks that the reward rises."""
    command = Path(sys.executable).with_name("aglverl")
    result = await anyio.run_process(
        [str(command), "demo", "--out", "demo-out", "--steps", "1", "--json"], cwd=tmp_path, check=False
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    summary = orjson.loads(result.stdout.decode().strip().splitlines()[-1])
    out = tmp_path / "demo-out"
    assert summary["steps"] == 1 and summary["out"] == "demo-out"
    assert Path(summary["log"]) == Path("demo-out/train.log")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "reward.png", "train.log"]
    assert (out / "train.log").stat().st_size > 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_fit_names_a_script_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from aglverl.cli import main

    assert main(["fit", str(tmp_path / "train.py")]) == 2
    assert "aglverl fit: no such script" in capsys.readouterr().err


def test_fit_without_agentlightning_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a venv without Agent Lightning (``.venv``), ``aglverl fit`` names the venv that has it; the script
    never runs."""
    import importlib.util

    if importlib.util.find_spec("agentlightning") is not None:
        pytest.skip("agentlightning is installed here")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    from aglverl.cli import main

    assert main(["fit", str(script)]) == 2
    assert "make venv-agl03" in capsys.readouterr().err


def _fit_command(tmp_path: Path, program: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``aglverl fit [ARGS] train.py`` as a user runs it (``program``: the script's text), in ``tmp_path``."""
    script = tmp_path / "train.py"
    script.write_text(program)
    aglverl = Path(sys.executable).with_name("aglverl")
    return subprocess.run(
        [str(aglverl), "fit", *args, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.agl03
def test_fit_lets_the_programs_own_exception_surface_with_its_traceback_and_exit_code(tmp_path: Path) -> None:
    """A ``FileNotFoundError`` raised inside the program (its dataset is missing) is the program's: its traceback
    and exit code 1, as ``python train.py`` gives, not aglverl's "no such script"; its ``SystemExit`` code is the
    command's."""
    missing = "def load():\n    return open('data/train.jsonl')\n\n\nload()\n"
    done = _fit_command(tmp_path, missing)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback (most recent call last)" in done.stderr
    assert f'File "{tmp_path / "train.py"}", line 2, in load' in done.stderr
    assert "FileNotFoundError: [Errno 2] No such file or directory: 'data/train.jsonl'" in done.stderr
    assert "aglverl fit:" not in done.stderr
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n")
    from aglverl.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["fit", str(tmp_path / "exits.py")])
    assert exited.value.code == 3


#: A program whose config names verl's vLLM rollout, as every ``agl.VERL`` example does; it constructs its
#: algorithm and stops there.
_VLLM_PROGRAM = """\
import agentlightning as agl

algorithm = agl.VERL({
    "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 4},
    "actor_rollout_ref": {"rollout": {"name": "vllm", "n": 2, "gpu_memory_utilization": 0.8},
                          "actor": {"ppo_mini_batch_size": 2}, "model": {"path": "tiny"}},
})
print("constructed", algorithm.config.actor_rollout_ref.rollout.name)
"""


@pytest.mark.agl03
def test_fit_refuses_a_rollout_engine_that_cannot_be_imported_before_ray_and_rollout_embedded_replaces_it(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """``rollout.name: vllm`` where vLLM cannot be imported: the program's ``VERL(config)`` raises, naming the
    key and the fix, before Ray starts (seconds after start, not minutes later in a Ray worker);
    ``aglverl fit --rollout embedded`` constructs the same program with the embedded engine, saying so."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    started = time.monotonic()
    done = _fit_command(tmp_path, _VLLM_PROGRAM)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-2000:]
    assert "ConfigError: actor_rollout_ref.rollout.name: vllm needs vLLM" in done.stderr
    assert "`aglverl fit --rollout embedded SCRIPT`" in done.stderr
    assert "constructed" not in done.stdout and "Ray" not in done.stderr  # refused before anything started
    print(f"refused {elapsed:.1f} s after start")
    from aglverl.cli import main

    capsys.readouterr()
    assert main(["fit", "--rollout", "embedded", str(tmp_path / "train.py")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "constructed aglverl"
    assert "training with aglverl's embedded engine" in caplog.text
    assert "in place of 'vllm', which the program's config names" in caplog.text
