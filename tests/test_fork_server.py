"""The fork server (issue 39): a Python agent imported once by a template process, each attempt a fork of it with
its own process, group, environment, working directory, streams and limits; a template that dies is started
again, a changed agent file is imported anew, an agent whose import starts a thread is spawned instead, and the
option that turns it off spawns every attempt. Real processes against a real daemon on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import sysconfig
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aglverl import AgentDaemon
from aglverl.process_runner import ProcessOptions, ProcessRunner
from aglverl.testing.mock_vllm import MockVLLM

pytestmark = pytest.mark.anyio

HELPERS = Path(__file__).parent / "helpers"


@pytest.fixture
def agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on the agents' PYTHONPATH holding a copy of the probe agent (a test may change it), and the
    helpers; imports are counted in ``tmp_path / "imports"``; the runner's environment has a secret."""
    home = tmp_path / "agents"
    home.mkdir()
    (home / "probe_agent.py").write_text((HELPERS / "forked_agents.py").read_text())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(home), str(HELPERS)]))
    monkeypatch.setenv("IMPORT_LOG", str(tmp_path / "imports"))
    monkeypatch.setenv("WANDB_API_KEY", "a-secret-of-the-runner")
    return home


@asynccontextmanager
async def runner(
    tmp_path: Path, options: Mapping[str, Any]
) -> AsyncIterator[tuple[AgentDaemon, ProcessRunner]]:
    section = {"env_allow": ["PATH", "PYTHONPATH", "IMPORT_LOG"], **options}
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock") as daemon,
    ):
        run = ProcessRunner(
            daemon, ProcessOptions.from_mapping(section), concurrency=2, log_dir=tmp_path / "logs"
        )
        async with anyio.create_task_group() as tg:
            await tg.start(run.serve)
            yield daemon, run
            tg.cancel_scope.cancel()


async def attempt(daemon: AgentDaemon, tmp_path: Path, task: Any = None) -> tuple[Any, dict[str, Any]]:
    """Run one rollout to its end; its record and what its agent printed."""
    rollout_id = await daemon.queue_task(task if task is not None else {"n": 1})
    with anyio.fail_after(60):
        await daemon.store.wait_terminal([rollout_id])
    record = daemon.store.record(rollout_id)
    lines = (tmp_path / "logs" / f"{rollout_id}.log").read_text().splitlines()
    return record, json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


def _probe_template(tmp_path: Path, **options: Any) -> Any:
    """A template of the probe agent (started by the caller), with ``options`` (``answer_seconds``)."""
    from aglverl.runners.template import Template

    return Template(
        [sys.executable],
        "class",
        ["probe_agent:Probe"],
        env=dict(os.environ),
        cwd=str(tmp_path),
        name="the probe",
        **options,
    )


def imports(tmp_path: Path) -> list[int]:
    path = tmp_path / "imports"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


async def test_an_agent_class_is_imported_once_and_each_attempt_is_a_fork_of_its_own(
    tmp_path: Path, agents: Path
) -> None:
    """One template imports the class's module (one import in all); each attempt is a process of its own (not
    the template), leading its own process group in a session of its own, in the configured working
    directory, with its input on stdin, the configured limits, and none of the runner's secrets. What an
    attempt imported as it ran is imported by the template before later forks. A killed template is started
    again; a changed agent file is imported anew, and its new code runs."""
    work = tmp_path / "work"
    work.mkdir()
    options = {"agent_class": "probe_agent:Probe", "cwd": str(work), "limits": {"nofile": 256}}
    async with runner(tmp_path, options) as (daemon, run):
        fork_server: Any = run.launcher
        template = fork_server._holder.current
        seen = []
        for n in range(3):
            record, printed = await attempt(daemon, tmp_path, {"n": n})
            assert record.state == "completed" and record.result.final_reward == 0.25
            seen.append(printed)
        assert imports(tmp_path) == [template.pid]  # imported once, by the template
        for n, printed in enumerate(seen):
            assert printed["pid"] != template.pid and printed["pgid"] == printed["pid"]
            assert printed["sid"] not in (
                printed["pid"],
                os.getsid(0),
                template.pid,
            )  # its supervisor's session
            assert printed["cwd"] == str(work) and json.loads(printed["stdin"]) == {"n": n}
            assert printed["nofile"] == [256, 256] and printed["secret"] is None
            assert printed["argv"] == ["-c", "probe_agent:Probe"]
        assert len({p["pid"] for p in seen}) == 3
        assert [p["lazy_was_imported"] for p in seen] == [False, True, True]  # learned from the first attempt
        assert "json.tool" in fork_server.learned

        os.kill(template.pid, signal.SIGKILL)
        with anyio.fail_after(20):
            await template._gone.wait()
        record, printed = await attempt(daemon, tmp_path)
        assert record.state == "completed" and fork_server.starts == 2
        assert len(imports(tmp_path)) == 2 and printed["lazy_was_imported"]  # the new one preloaded it too

        source = agents / "probe_agent.py"
        source.write_text(source.read_text().replace("REWARD = 0.25", "REWARD = 0.75"))
        stamp = source.stat()
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # a new mtime, whatever the clock
        record, _ = await attempt(daemon, tmp_path)
        assert record.result.final_reward == 0.75 and fork_server.starts == 3 and len(imports(tmp_path)) == 3


async def test_attempts_starting_together_wait_for_one_preload_of_what_the_first_imported(
    tmp_path: Path, agents: Path
) -> None:
    """What the first attempt imported as it ran is imported by the template once: the attempts that start
    together after it (two workers, four rollouts) wait for that one preload, and each finds the module there."""
    async with runner(tmp_path, {"agent_class": "probe_agent:Probe"}) as (daemon, run):
        fork_server: Any = run.launcher
        record, printed = await attempt(daemon, tmp_path)
        assert record.state == "completed" and not printed["lazy_was_imported"]
        ids = [await daemon.queue_task({"n": n}) for n in range(4)]
        with anyio.fail_after(60):
            await daemon.store.wait_terminal(ids)
        template = fork_server._holder.current
        assert fork_server.starts == 1 and template.preloads == 1
        for rollout_id in ids:
            assert daemon.store.record(rollout_id).state == "completed"
            printed = json.loads((tmp_path / "logs" / f"{rollout_id}.log").read_text().splitlines()[-1])
            assert printed["lazy_was_imported"]


async def test_a_python_script_command_is_forked_too(tmp_path: Path, agents: Path) -> None:
    """``python script.py args``: the template imports what the script imports at its top level; each attempt
    runs the script as ``__main__`` with its arguments in a fork."""
    script = agents / "script_agent.py"
    script.write_text(
        "import json, os, sys\nimport probe_agent\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv, 'pid': os.getpid()}), flush=True)\n"
        "    open(os.environ['AGL_REWARD_FILE'], 'w').write(str(probe_agent.REWARD))\n"
    )
    import sys

    async with runner(tmp_path, {"command": [sys.executable, "-u", str(script), "--flag"]}) as (daemon, run):
        results = [await attempt(daemon, tmp_path) for _ in range(2)]
        fork_server: Any = run.launcher
        assert fork_server.off is None and fork_server.starts == 1
        template_pid = fork_server._holder.current.pid
    assert [r.result.final_reward for r, _ in results] == [0.25, 0.25]
    assert all(p["argv"] == [str(script), "--flag"] for _, p in results)
    assert imports(tmp_path) == [template_pid]  # probe_agent imported by the template alone


async def test_an_agent_whose_import_starts_a_thread_is_spawned_and_the_option_turns_forking_off(
    tmp_path: Path, agents: Path
) -> None:
    """Nothing runs threads in a template that forks: an agent module that starts one at import is run by a new
    Python per attempt (the template says why, and is gone). ``fork_server: false`` spawns every attempt."""
    async with runner(tmp_path, {"agent_class": "threaded_agent:ThreadedAtImport"}) as (daemon, run):
        records = [(await attempt(daemon, tmp_path))[0] for _ in range(2)]
        fork_server: Any = run.launcher
        assert fork_server.off is not None and "started 1 thread(s)" in fork_server.off
    assert all(r.state == "completed" and r.result.final_reward == 2.0 for r in records)
    assert len(imports(tmp_path)) == 3  # the template's import, then one per attempt

    (tmp_path / "imports").unlink()
    async with runner(tmp_path, {"agent_class": "probe_agent:Probe", "fork_server": False}) as (daemon, run):
        printed = [(await attempt(daemon, tmp_path))[1] for _ in range(2)]
        assert type(run.launcher).__name__ == "Spawner"
    assert imports(tmp_path) == [p["pid"] for p in printed]  # each attempt imported it itself
    assert all(not p["lazy_was_imported"] for p in printed)


async def test_a_spare_forked_before_the_agent_changed_refuses_its_attempt_as_stale(
    tmp_path: Path, agents: Path
) -> None:
    """A Python template's spare supervisors (forked ahead of their attempts) check the agent's files before
    they fork it: one forked before a change says so instead of running the old code, and the fork server
    starts a new template whose attempt runs the new code."""
    from aglverl.runners.seam import Launch
    from aglverl.runners.template import TemplateStale, fork_request

    template = _probe_template(tmp_path)
    async with anyio.create_task_group() as tg:
        await template.start(tg)
        spare = await template.spare()
        source = agents / "probe_agent.py"
        stamp = source.stat()
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
        read, write = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        launch = Launch(
            argv=("-c", "probe_agent:Probe"),
            env=dict(os.environ),
            cwd=str(tmp_path),
            stdin=stdin,
            output=write,
            name="an attempt",
        )
        try:
            await spare.assign(fork_request(launch, exec_=False), stdin, write, launch.name)
            with pytest.raises(TemplateStale, match=r"probe_agent\.py"):
                await spare.started()
        finally:
            for fd in (read, write, stdin):
                os.close(fd)
        await template.aclose()
        tg.cancel_scope.cancel()

    options = {"agent_class": "probe_agent:Probe"}
    async with runner(tmp_path, options) as (daemon, run):
        fork_server: Any = run.launcher
        assert len(fork_server._spares) == 2  # forked ahead: the runner's concurrency
        record, _ = await attempt(daemon, tmp_path)
        assert record.result.final_reward == 0.25 and fork_server.starts == 1
        await anyio.lowlevel.checkpoint()
        source.write_text(source.read_text().replace("REWARD = 0.25", "REWARD = 0.5"))
        stamp = source.stat()
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
        record, _ = await attempt(daemon, tmp_path)
        assert record.result.final_reward == 0.5 and fork_server.starts == 2


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "spawned"])
async def test_each_attempt_draws_its_own_numbers_from_the_global_generators_and_gets_a_seed_of_its_own(
    tmp_path: Path, agents: Path, monkeypatch: pytest.MonkeyPatch, forked: bool
) -> None:
    """Issue 50, finding 3. Four attempts of an agent that imports numpy and torch at its top (the template
    imports them; each attempt is a fork of it): each draws its own number from Python's ``random``, numpy's
    global generator and torch's, as four spawned ones do. Each gets ``AGL_SEED`` (its log's first line says
    it), four different ones, and generators seeded from it differ too. What stays shared under the fork
    server, as the README says: generator objects the agent's module made at import."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # numpy's and torch's imports then start no thread
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    options = {
        "agent_class": "random_agents:Draws",
        "fork_server": forked,
        "env_allow": ["PATH", "PYTHONPATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"],
    }
    async with runner(tmp_path, options) as (daemon, run):
        ids = [await daemon.queue_task({"n": n}) for n in range(4)]
        with anyio.fail_after(120):
            await daemon.store.wait_terminal(ids)
        records = [daemon.store.record(rollout_id) for rollout_id in ids]
        launcher: Any = run.launcher
        assert (type(launcher).__name__, getattr(launcher, "off", None)) == (
            ("ForkServer", None) if forked else ("Spawner", None)
        )
    assert [r.state for r in records] == ["completed"] * 4, [r.error for r in records]
    drawn = []
    for rollout_id in ids:
        first, *_, last = (tmp_path / "logs" / f"{rollout_id}.log").read_text().splitlines()
        drawn.append(json.loads(last))
        assert first == f"aglverl: AGL_SEED={drawn[-1]['seed']}"
    for name in ("random", "numpy", "torch", "seed", "seeded_random", "seeded_rng"):
        assert len({d[name] for d in drawn}) == 4, (name, [d[name] for d in drawn])
    shared = 1 if forked else 4
    assert [len({d[name] for d in drawn}) for name in ("module_random", "module_rng")] == [shared, shared]


WRITER = """
import importlib, json, os, sys


class Writer:
    def run(self):
        here = os.path.dirname(os.path.abspath(__file__))
        sys.dont_write_bytecode = True  # no stale .pyc of an equal-sized file written within the same second
        with open(os.path.join(here, "generated.py"), "w") as f:
            f.write(f"WHO = {os.environ['AGL_ROLLOUT_ID']!r}\\n")
        importlib.invalidate_caches()
        import generated

        print(json.dumps({"who": generated.WHO}), flush=True)
        with open(os.environ["AGL_REWARD_FILE"], "w") as f:
            f.write("1")
"""


async def test_a_module_an_attempt_writes_and_imports_is_its_own_and_never_the_templates(
    tmp_path: Path, agents: Path
) -> None:
    """Issue 50, finding 4. An agent that writes a module into its own folder at each attempt and imports it:
    each of four attempts imports the one it wrote (the template learns of it from the first, and leaves it out:
    it is not the Python installation's), all in one template."""
    (agents / "writer_agent.py").write_text(WRITER)
    async with runner(tmp_path, {"agent_class": "writer_agent:Writer"}) as (daemon, run):
        fork_server: Any = run.launcher
        seen = []
        for n in range(4):
            record, printed = await attempt(daemon, tmp_path, {"n": n})
            assert record.state == "completed", record.error
            seen.append((printed["who"], record.rollout_id))
        template = fork_server._holder.current
        assert fork_server.starts == 1 and template.preloads >= 1
        assert "generated" in template.skipped and "generated" not in template.preloaded
        assert "generated" not in fork_server.learned
    assert [who for who, _ in seen] == [rollout_id for _, rollout_id in seen]


def test_the_installation_is_its_folders_files_older_than_the_template_never_the_projects() -> None:
    """What a template may import before its forks: the standard library's and site-packages' files, also with
    the virtual environment inside the project (the agent's folder); never the project's own files, nor a file
    written into site-packages after the template started."""
    import anyio as installed_package

    import aglverl
    from aglverl.runners._template.preload import Installed

    project = Path(__file__).resolve().parents[1]
    installed = Installed([str(project), str(project / "examples")], time.time_ns())
    assert json.__file__ in installed and installed_package.__file__ in installed
    assert aglverl.__file__ not in installed and str(HELPERS / "forked_agents.py") not in installed
    fresh = Path(sysconfig.get_paths()["purelib"]) / f"aglverl_test_fresh_{os.getpid()}.py"
    fresh.write_text("WRITTEN = 'after the template started'\n")
    try:
        assert str(fresh) not in installed
        assert str(fresh) in Installed([str(project)], time.time_ns())  # older than a template started now
    finally:
        fresh.unlink()


async def test_a_template_that_stops_answering_is_ended_and_its_requests_fail_as_gone(
    tmp_path: Path, agents: Path
) -> None:
    """A template stopped by a process of its user (an agent can find it: its supervisor's parent) answers no
    fork: past its ``answer_seconds`` it is ended (``SIGCONT``, then ``SIGKILL``) and the request fails as
    :class:`TemplateGone`, which the fork server answers with a new template."""
    from aglverl.runners.supervised import TemplateGone

    template = _probe_template(tmp_path, answer_seconds=2.0)
    async with anyio.create_task_group() as tg:
        await template.start(tg)
        assert template.pid is not None
        pidfd = os.pidfd_open(template.pid)
        try:
            os.kill(template.pid, signal.SIGSTOP)
            with anyio.fail_after(20), pytest.raises(TemplateGone):
                await template.spare()
            assert not template.alive
            with anyio.fail_after(20):
                await anyio.wait_readable(pidfd)  # it exited
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever happened: no stopped process left behind
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        await template.aclose()
        tg.cancel_scope.cancel()
