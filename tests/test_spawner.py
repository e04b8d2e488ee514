"""The plain spawn (:class:`aglverl.runners.spawn.Spawner`): a supervisor outlives its attempt and runs the next
one, with nothing of the last left; a stop that comes late for an ended attempt never touches the next; each
attempt's output ends with its own processes, whatever was forked beside it. Real processes, no daemon."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from aglverl.runners.seam import Launch
from aglverl.runners.spawn import Spawner
from aglverl.runners.template import SupervisedProcess

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def spawner(ahead: int = 0) -> AsyncIterator[Spawner]:
    launcher = Spawner(env_allow=["PATH"], ahead=ahead)
    async with anyio.create_task_group() as tg:
        await tg.start(launcher.serve)
        yield launcher
        tg.cancel_scope.cancel()


async def start(launcher: Spawner, script: str) -> tuple[SupervisedProcess, int]:
    """Start ``sh -c script``; its process and the read end of its output."""
    read, write = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY)
    try:
        process = await launcher.start(
            Launch(
                argv=("sh", "-c", script),
                env=launcher.environment({}),
                cwd="/",
                stdin=stdin,
                output=write,
                name="an attempt",
                grace=2.0,
            )
        )
    finally:
        os.close(write)
        os.close(stdin)
    assert isinstance(process, SupervisedProcess)
    return process, read


async def output(read: int) -> str:
    """What the attempt's processes wrote, up to the end of their output (every write end closed)."""
    data = b""
    os.set_blocking(read, False)
    try:
        while True:
            await anyio.wait_readable(read)
            try:
                chunk = os.read(read, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return data.decode()
            data += chunk
    finally:
        os.close(read)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_supervisor_runs_the_next_attempt_once_everything_of_the_last_is_gone() -> None:
    async with spawner() as launcher:
        # the first attempt leaves a daemon behind: a new session, reparented to the supervisor when sh exits
        first, read = await start(launcher, "setsid sleep 60 & echo $!")
        stray = int((await output(read)).strip())
        assert (await first.wait()).code == 0
        await first.finished()
        assert first.strays == 1
        assert not alive(stray), "the first attempt's daemon outlived it"

        second, read = await start(launcher, "echo second; echo $PPID")
        said = (await output(read)).split()
        assert (await second.wait()).code == 0
        await second.finished()
        assert second.supervisor == first.supervisor, "the next attempt was given a new supervisor"
        assert said == ["second", str(first.supervisor)]
        assert second.strays == 0
        assert second.pid != first.pid


async def test_a_stop_that_comes_after_its_attempt_ended_does_not_touch_the_next() -> None:
    async with spawner() as launcher:
        first, read = await start(launcher, "exit 0")
        await output(read)
        assert (await first.wait()).code == 0
        # as a runner whose deadline passed just as the attempt ended (its exit read, not yet its end): the stop
        # reaches a supervisor that waits for its next attempt
        await first.stop(0.01)
        await first.finished()

        second, read = await start(launcher, "sleep 0.5; echo ran to its end")
        assert second.supervisor == first.supervisor
        assert await output(read) == "ran to its end\n"
        assert (await second.wait()).code == 0
        await second.finished()


async def test_each_attempts_output_ends_with_its_own_processes_while_others_started_beside_it_run() -> None:
    """Attempts started at once are forked from one template, which may hold the descriptors of the next requests
    while it forks for one: no supervisor, and no agent, keeps another attempt's output open."""
    async with spawner() as launcher:
        started: list[tuple[str, SupervisedProcess, int]] = []

        async def one(kind: str) -> None:
            script = "echo quick" if kind == "quick" else "echo long; exec sleep 60"
            started.append((kind, *await start(launcher, script)))

        async with anyio.create_task_group() as tg:
            for i in range(10):  # more than the spares: most of them forked for the burst, pipelined
                tg.start_soon(one, "long" if i % 2 else "quick")
        longs = [(process, read) for kind, process, read in started if kind == "long"]
        with anyio.fail_after(20):  # the long ones run for 60 s
            for kind, process, read in started:
                if kind == "quick":
                    assert await output(read) == "quick\n"
                    assert (await process.wait()).code == 0
                    await process.finished()
        for process, read in longs:
            assert process.exit is None
            await launcher.stop(process, 1.0)
            assert (await process.wait()).signal is not None
            assert await output(read) == "long\n"
            await process.finished()


async def test_supervisors_forked_ahead_wait_before_the_first_attempts_and_are_kept_after_them() -> None:
    async with spawner(ahead=3) as launcher:
        assert launcher.waiting == 3
        started = [await start(launcher, "echo $PPID") for _ in range(3)]
        assert launcher.waiting <= 2  # taken (a refill may have forked spares meanwhile)
        parents = set()
        for process, read in started:
            parents.add(int((await output(read)).strip()))
            await process.wait()
            await process.finished()
        assert parents == {process.supervisor for process, _ in started}
        assert len(parents) == 3
        assert launcher.waiting >= 3
