"""Durability: accepted results reach the journal before the 200; a restarted daemon recovers its step."""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path

import anyio
import orjson
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from aglverl import AgentDaemon, BatchConfig, Rollout, Triplet
from aglverl.client import AgentClient
from aglverl.store import Journal, LLMCall
from aglverl.store.journal import read_records

pytestmark = pytest.mark.anyio

BATCH = BatchConfig(max_prompt_length=8, max_response_length=8)
ROOT = Path(__file__).resolve().parents[1]


def _rollout(task, reward: float = 1.0) -> Rollout:
    ids = [int(task.input["i"]) + 1]
    return Rollout(
        rollout_id=task.rollout_id,
        attempt_id=task.attempt_id,
        final_reward=reward,
        triplets=[Triplet(prompt={"token_ids": ids}, response={"token_ids": ids * 2})],
    )


async def test_accepted_result_is_in_the_journal_before_the_agent_hears_ok(tmp_path: Path) -> None:
    path = tmp_path / "run.journal"
    async with (
        AgentDaemon(journal_path=path, batch=BATCH) as daemon,
        AgentClient(daemon.server_url) as client,
    ):
        await daemon.submit([{"i": 0}])
        task = await client.next_task(wait=1)
        assert task is not None
        await client.post_rollout(_rollout(task, 0.5))
        results = [r for r in read_records(path) if r["kind"] == "result"]
        assert [(r["rollout_id"], r["attempt_id"], r["result"]["final_reward"]) for r in results] == [
            (task.rollout_id, task.attempt_id, 0.5)
        ]
        await daemon.batches.receive()


async def test_restart_recovers_finished_rollouts_and_reissues_only_unfinished_ones(tmp_path: Path) -> None:
    path = tmp_path / "run.journal"
    async with (
        AgentDaemon(journal_path=path, batch=BATCH) as daemon,
        AgentClient(daemon.server_url) as client,
    ):
        step = await daemon.submit([{"i": i} for i in range(4)])
        tasks = [await client.next_task(wait=1) for _ in range(3)]
        for task in tasks[:2]:
            assert task is not None
            await client.post_rollout(_rollout(task))
        # The daemon stops mid-step: two results in, one task out with an agent, one never handed out.
    late = tasks[2]
    assert late is not None
    async with (
        AgentDaemon(journal_path=path, batch=BATCH) as daemon,
        AgentClient(daemon.server_url) as client,
    ):
        (recovered,) = daemon.recovered_steps
        assert recovered.rollout_ids == step.rollout_ids
        reissued = [await client.next_task(wait=0.2) for _ in range(3)]
        assert {t.rollout_id for t in reissued if t} == set(step.rollout_ids[2:])
        assert reissued[2] is None  # the two finished rollouts are not handed out again
        # The agent that held the task before the restart still gets its result accepted (first wins).
        await client.post_rollout(_rollout(late))
        other = next(t for t in reissued if t and t.rollout_id != late.rollout_id)
        await client.post_rollout(_rollout(other))
        with anyio.fail_after(10):
            batch = await daemon.batches.receive()
        assert batch.step == recovered.number
        assert sorted(batch.data.non_tensor_batch["rollout_id_list"]) == sorted(step.rollout_ids)
        assert batch.metrics["step/n_completed"] == 4
        next_step = await daemon.submit([{"i": 9}])
        assert next_step.number == recovered.number + 1


async def test_killed_daemon_process_recovers_its_step(tmp_path: Path) -> None:
    """Kill -9 a daemon process mid-step; a new one on the same journal finishes the step."""
    path = tmp_path / "kill.journal"
    cmd = [sys.executable, str(ROOT / "tests" / "helpers" / "journal_daemon.py"), str(path), "6"]

    async def first_line(process: anyio.abc.Process) -> dict:
        assert process.stdout is not None
        reader = BufferedByteReceiveStream(process.stdout)
        with anyio.fail_after(60):
            return orjson.loads(await reader.receive_until(b"\n", 1 << 20)), reader

    process = await anyio.open_process(cmd, cwd=ROOT)
    try:
        hello, _ = await first_line(process)
        assert hello["recovered"] == []
        async with AgentClient(hello["server_url"]) as client:
            done = []
            for _ in range(4):
                task = await client.next_task(wait=5)
                assert task is not None
                await client.post_rollout(_rollout(task))  # the 200 means: in the journal
                done.append(task.rollout_id)
        process.send_signal(signal.SIGKILL)
        await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

    process = await anyio.open_process(cmd, cwd=ROOT)
    try:
        hello, reader = await first_line(process)
        (recovered,) = hello["recovered"]
        assert set(done) < set(recovered) and len(recovered) == 6
        async with AgentClient(hello["server_url"]) as client:
            handed = []
            # Exactly the unfinished ones come out; after the last result the step ends and the process exits.
            for _ in range(len(recovered) - len(done)):
                task = await client.next_task(wait=5)
                assert task is not None
                handed.append(task.rollout_id)
                await client.post_rollout(_rollout(task))
        assert sorted(handed) == sorted(set(recovered) - set(done))
        with anyio.fail_after(30):
            batch = orjson.loads(await reader.receive_until(b"\n", 1 << 20))
        assert sorted(batch["rollout_ids"]) == sorted(recovered)
        assert batch["metrics"]["step/n_completed"] == 6
        await process.wait()
        assert process.returncode == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_batch_waiting_for_the_trainer_survives_a_restart(tmp_path: Path) -> None:
    """The step is finished and its batch built, but the trainer has not received it when the daemon dies:
    the step is still open in the journal and the restarted daemon delivers the same rollouts."""
    path = tmp_path / "waiting.journal"
    async with (
        AgentDaemon(journal_path=path, batch=BATCH) as daemon,
        AgentClient(daemon.server_url) as client,
    ):
        step = await daemon.submit([{"i": i} for i in range(3)])
        while (task := await client.next_task(wait=0.2)) is not None:
            await client.post_rollout(_rollout(task))
        with anyio.fail_after(10):
            report = await step.wait()  # built; the batch now waits in the stream
        assert report.metrics["step/n_completed"] == 3
        assert all(daemon.store.knows(rid) for rid in step.rollout_ids)
        assert "step_done" not in [r["kind"] for r in read_records(path)]
        # a compaction meanwhile keeps the waiting step (it is done, but not handed over)
        assert daemon.journal is not None
        daemon.journal.compact_bytes = 0
        daemon.journal.maybe_compact()
        with anyio.fail_after(10):
            await daemon.journal.wait_compacted(0)
    async with AgentDaemon(journal_path=path, batch=BATCH) as daemon:
        (recovered,) = daemon.recovered_steps
        assert recovered.rollout_ids == step.rollout_ids
        with anyio.fail_after(10):
            batch = await daemon.batches.receive()
        assert sorted(batch.data.non_tensor_batch["rollout_id_list"].tolist()) == sorted(step.rollout_ids)
        assert batch.metrics["step/n_completed"] == 3
    kinds = [r["kind"] for r in read_records(path)]
    # handed over: the step is done and its rollouts forgotten, once
    assert kinds.count("step_done") == 1 and kinds[-2:] == ["step_done", "forget"]
    async with AgentDaemon(journal_path=path, batch=BATCH) as daemon:
        assert daemon.recovered_steps == []  # so a third start delivers nothing again


def test_torn_last_line_ends_replay_without_losing_earlier_records(tmp_path: Path) -> None:
    path = tmp_path / "torn.journal"
    journal = Journal(path)
    journal.open()
    journal.write({"kind": "a", "n": 1})
    journal.write({"kind": "b", "n": 2})
    journal.close()
    with path.open("ab") as f:
        f.write(b'{"kind": "c", "n"')  # the process died mid-write
    assert [r["kind"] for r in read_records(path)] == ["a", "b"]


async def test_journal_is_compacted_to_the_work_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "compact.journal"
    daemon = AgentDaemon(journal_path=path, batch=BATCH)
    async with daemon, AgentClient(daemon.server_url) as client:
        assert daemon.journal is not None
        daemon.journal.compact_bytes = 4096
        for _ in range(5):
            await daemon.submit([{"i": i} for i in range(4)])
            while (task := await client.next_task(wait=0.2)) is not None:
                await client.post_rollout(_rollout(task))
            await daemon.batches.receive()
        assert path.stat().st_size < 4096 + 2048
        kinds = [r["kind"] for r in read_records(path)]
        assert "result" not in kinds or kinds.count("result") < 20  # finished steps were dropped
    async with AgentDaemon(journal_path=path, batch=BATCH) as again:
        assert again.recovered_steps == []
        step = await again.submit([{"i": 0}])
        assert step.number == 5


async def test_compaction_runs_in_a_worker_thread_and_keeps_records_written_meanwhile(tmp_path: Path) -> None:
    path = tmp_path / "offloop.journal"
    journal = Journal(path, fsync=True, compact_bytes=1024)
    journal.open()
    live = [{"kind": "live", "i": i, "pad": "x" * 64} for i in range(20_000)]
    snapshotted = anyio.Event()

    def live_records():
        snapshotted.set()
        return live

    journal.live_records = live_records
    async with anyio.create_task_group() as tg:
        await tg.start(journal.serve)
        for i in range(40):
            journal.write({"kind": "old", "i": i, "pad": "y" * 64})
        journal.maybe_compact()  # returns at once: the rewrite is the worker thread's
        assert journal.compactions == 0
        await snapshotted.wait()
        # the thread is writing the snapshot now; these land in the old file and must reach the new one
        assert journal._tail is not None
        for i in range(5):
            journal.write({"kind": "during", "i": i})
        tg.start_soon(journal.commit)  # an fsync of the old descriptor, racing the rename
        with anyio.fail_after(30):
            await journal.wait_compacted(0)
        journal.write({"kind": "after", "i": 0})
        await journal.commit()
        assert journal._synced == journal._written
        tg.cancel_scope.cancel()
    journal.close()
    kinds = [r["kind"] for r in read_records(path)]
    assert kinds == ["live"] * len(live) + ["during"] * 5 + ["after"]


class _FsyncSpy:
    """``os.fsync`` as it is, noting what each call made durable: the journal file or its directory."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: list[str] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            real(fd)
            kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
            self.synced.append(f"{kind}:{os.readlink(f'/proc/self/fd/{fd}')}")

        monkeypatch.setattr(os, "fsync", fsync)

    def take(self) -> list[str]:
        taken, self.synced = self.synced, []
        return taken


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd")
async def test_with_fsync_a_replaced_journal_is_durable_with_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rename is only as durable as its directory: with ``fsync=True`` the journal's directory is fsynced
    after the file is replaced (at open; after a compaction, before a commit of any record written through the
    new descriptor returns), or power loss could undo the rename and the records appended to the new file."""
    spy = _FsyncSpy(monkeypatch)
    path = tmp_path / "durable.journal"
    journal = Journal(path, fsync=True, compact_bytes=1024)
    journal.live_records = lambda: [{"kind": "live", "i": i} for i in range(3)]
    journal.open()
    assert f"dir:{tmp_path}" in spy.take()
    async with anyio.create_task_group() as tg:
        await tg.start(journal.serve)
        for i in range(40):
            journal.write({"kind": "old", "i": i, "pad": "y" * 64})
        await journal.commit()
        spy.take()
        journal.maybe_compact()
        with anyio.fail_after(30):
            await journal.wait_compacted(0)
        journal.write({"kind": "after", "i": 0})
        await journal.commit()
        synced = spy.take()
        tg.cancel_scope.cancel()
    journal.close()
    # the snapshot was fsynced before the rename; the record after it, with the directory of the rename
    assert synced == [f"file:{tmp_path}/durable.journal.tmp", f"file:{path}", f"dir:{tmp_path}"]
    assert [r["kind"] for r in read_records(path)] == ["live"] * 3 + ["after"]


def test_the_file_stays_proportional_to_the_live_state_far_below_compact_bytes(tmp_path: Path) -> None:
    """Groups dropped at every checkpoint leave "forget" records behind: past the floor, a file four times the
    size of what the last rewrite kept is rewritten, so a long run's journal stays flat."""
    journal = Journal(tmp_path / "flat.journal")  # compact_bytes: the 256 MB default
    live = [{"kind": "live", "i": i} for i in range(100)]
    journal.live_records = lambda: live
    journal.open(live)
    sizes = []
    for i in range(40_000):
        journal.write({"kind": "forget", "rollout_ids": [f"rollout-{i:08d}"]})
        journal.maybe_compact()
        sizes.append(journal.size)
    journal.close()
    assert journal.compactions >= 2 and max(sizes) <= (1 << 20) + 100
    assert [r["kind"] for r in read_records(tmp_path / "flat.journal")][:100] == ["live"] * 100


async def test_fsync_commit_is_shared_by_concurrent_posts(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "sync.journal", fsync=True)
    journal.open()
    for i in range(10):
        journal.write({"kind": "x", "i": i})
    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(journal.commit)
    assert journal._synced == journal._written == 10
    journal.close()


async def test_failed_rollout_keeps_its_reason_and_last_calls_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "run.journal"
    async with (
        AgentDaemon(journal_path=path, batch=BATCH, max_attempts=1) as daemon,
        AgentClient(daemon.server_url) as client,
    ):
        await daemon.submit([{"i": 0}, {"i": 1}])
        task = await client.next_task(wait=1)
        assert task is not None and task.attempt_id
        call = LLMCall(task.rollout_id, task.attempt_id, 3, "/v1/chat/completions", "b", 0.0, limit="context")
        daemon.store.record_calls(task.rollout_id, task.attempt_id, [call])
        await client.post_rollout(
            Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, status="failed")
        )
    async with AgentDaemon(journal_path=path, batch=BATCH, max_attempts=1) as daemon:
        record = daemon.store.record(task.rollout_id)
    assert (record.state, record.termination) == ("failed", "agent_error")
    assert [(c.seq, c.limit) for c in record.calls] == [(3, "context")]


async def test_recovered_step_keeps_its_metadata_and_can_be_abandoned(tmp_path: Path) -> None:
    path = tmp_path / "meta.journal"
    async with AgentDaemon(journal_path=path, batch=BATCH) as daemon:
        step = await daemon.submit([{"i": 0}, {"i": 1}], metadata={"global_step": 7})
        assert step.metadata == {"global_step": 7}
    async with AgentDaemon(journal_path=path, batch=BATCH) as daemon:
        (recovered,) = daemon.recovered_steps
        assert recovered.metadata == {"global_step": 7}
        # a resumed trainer that no longer needs the step ends it: nothing is handed out, the step completes
        assert daemon.abandon(recovered, "not resumed") == 2
        with anyio.fail_after(10):
            batch = await daemon.batches.receive()
            report = await recovered.wait()
        assert batch.step == recovered.number and len(batch.data) == 0
        assert report.metrics["step/n_failed"] == 2
