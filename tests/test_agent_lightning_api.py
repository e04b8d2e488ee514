"""Agent Lightning v1.0's server API on aglverl's task server, checked against the real ``agentlightning==1.0.2``:
every answer is validated by Agent Lightning's own pydantic models (in the tier's Python 3.12 venv), the state
machine is Agent Lightning's table, and its Kubernetes controller's reconcile loop runs against the server.

A daemon on loopback in front of a vLLM-shaped mock backend; agents are the OpenAI and Anthropic SDKs."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import anyio
import anyio.to_thread
import httpx
import openai
import pytest
from conftest import agl_python

from aglverl import AgentDaemon, BatchConfig
from aglverl.agl10.config import AgentLightningSettings
from aglverl.agl10.wire import RolloutConfig, RolloutK8sConfig
from aglverl.testing.mock_vllm import MockVLLM

pytestmark = [pytest.mark.anyio, pytest.mark.agl]

HELPERS = Path(__file__).parent / "helpers"
KEY = "agl-s3cret"
BATCH = BatchConfig(max_prompt_length=256, max_response_length=16)


class Api:
    """An httpx client of the API that keeps every answer with the name of Agent Lightning's model for it."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.answers: list[dict[str, Any]] = []

    async def call(
        self,
        method: str,
        path: str,
        model: str | None = None,
        *,
        status: int = 200,
        triplet: bool = False,
        **kwargs: Any,
    ) -> Any:
        response = await self.client.request(method, path, **kwargs)
        assert response.status_code == status, (method, path, response.status_code, response.text)
        if response.status_code == 204:
            return None
        body = response.json()
        if model is not None:
            self.answers.append({"model": model, "body": body, "triplet": triplet})
        return body

    async def patch(self, rollout_id: str, status: int = 200, **fields: Any) -> Any:
        return await self.call(
            "PATCH", f"/api/rollouts/{rollout_id}", "Rollout", status=status, json={"status": fields}
        )

    async def reward(self, rollout_id: str, value: float, attempt: str = "0") -> None:
        body = {"event_type": "reward", "data": {"value": value}}
        await self.call("POST", f"/api/rollouts/{rollout_id}/attempt/{attempt}/events", "Event", json=body)


async def validated(api: Api) -> dict[str, Any]:
    """Agent Lightning's verdict on every answer kept (and its state-machine table)."""
    python = agl_python()
    assert python is not None
    request = json.dumps({"answers": api.answers}).encode()

    def run() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [python, str(HELPERS / "agl_validate.py")], input=request, capture_output=True, timeout=120
        )

    done = await anyio.to_thread.run_sync(run)
    assert done.returncode == 0, done.stderr.decode()
    verdict = json.loads(done.stdout)
    assert verdict["errors"] == [] and verdict["checked"] == len(api.answers)
    return verdict


@asynccontextmanager
async def serving(
    *, max_attempts: int = 1, settings: AgentLightningSettings | None = None, **kwargs: Any
) -> AsyncIterator[tuple[AgentDaemon, Api, MockVLLM]]:
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(
            backends=[mock.url],
            model="mock",
            batch=BATCH,
            token=KEY,
            max_attempts=max_attempts,
            agent_lightning=settings,
            **kwargs,
        ) as daemon,
        httpx.AsyncClient(
            base_url=daemon.server_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        ) as client,
    ):
        yield daemon, Api(client), mock


def openai_url(daemon: AgentDaemon, rollout_id: str, mode: str = "train") -> str:
    return f"{daemon.server_url}/proxy/rollout/{rollout_id}/attempt/0/mode/{mode}/openai/v1"


async def test_a_rollouts_whole_life_answers_as_agent_lightnings_server_does() -> None:
    """Create (idempotent), list, start, an agent's call and reward, succeed, read events (raw, triplet,
    filtered), detail, the cursor, delete, models, pause / state / resume: every answer validates."""
    async with serving() as (daemon, api, mock):
        items = [
            {"input": {"q": i, "data_id": f"d{i}"}, "rollout_id": f"r{i}", "metadata": {"batch_idx": 0}}
            for i in (1, 2)
        ]
        created = await api.call("POST", "/api/rollouts", "list[Rollout]", status=201, json=items)
        again = await api.call("POST", "/api/rollouts", "list[Rollout]", status=201, json=items[:1])
        assert again == created[:1] and [r["status"]["state"] for r in created] == ["queuing", "queuing"]
        fresh = await api.call(
            "POST", "/api/rollouts", "list[Rollout]", status=201, json=[{"input": "no id"}]
        )
        assert len(fresh[0]["rollout_id"]) == 32 and fresh[0]["is_train"] is True
        listed = await api.call(
            "GET", "/api/rollouts", "list[Rollout]", params={"state_in": ["queuing"], "limit": 2}
        )
        assert [r["rollout_id"] for r in listed] == ["r1", "r2"]
        await api.patch("r1", state="running", last_attempt_id="0")
        async with openai.AsyncOpenAI(
            base_url=openai_url(daemon, "r1"), api_key=KEY, max_retries=0
        ) as client:
            reply = await client.chat.completions.create(
                model="whatever", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert reply.model == "mock" and reply.choices[0].message.content
        await api.reward("r1", 0.5)
        done = await api.patch("r1", state="succeeded", last_attempt_id="0")
        assert done["status"]["state"] == "succeeded" and done["status"]["version"] == 3
        assert daemon.store.record("r1").result.final_reward == 0.5
        events = await api.call("GET", "/api/rollouts/r1/events", "list[Event]")
        assert [e["event_type"] for e in events] == ["model_request", "reward"]
        (call,) = daemon.store.record("r1").calls
        assert events[0]["data"]["response"]["prompt_token_ids"] == call.prompt_token_ids
        trip = await api.call(
            "GET", "/api/rollouts/r1/events", "list[Event]", triplet=True, params={"format": "triplet"}
        )
        assert trip[0]["data"]["response_token_ids"] == call.response_token_ids and trip[1]["data"] == {
            "value": 0.5
        }
        only = await api.call(
            "GET", "/api/rollouts/r1/events", "list[Event]", params={"event_type": "reward"}
        )
        assert [e["event_type"] for e in only] == ["reward"]
        detail = await api.call("GET", "/api/rollouts/r1", "RolloutDetail")
        assert detail["attempts"] == ["0"]
        await api.patch("r2", state="failed", error_message="could not start")
        page = await api.call("GET", "/api/rollouts/terminal", "TerminalRolloutsPage")
        assert page == {
            "items": [
                {"rollout_id": "r1", "state": "succeeded", "data_id": "d1", "is_train": True},
                {"rollout_id": "r2", "state": "failed", "data_id": "d2", "is_train": True},
            ],
            "next_after": 2,
            "total_terminal": 2,
        }
        await api.call("DELETE", "/api/rollouts/r1", status=204)
        await api.call("DELETE", "/api/rollouts/r1", status=204)  # a missing id is no error
        await api.call("GET", "/api/rollouts/r1", status=404)
        page = await api.call("GET", "/api/rollouts/terminal", "TerminalRolloutsPage", params={"after": 0})
        assert [i["rollout_id"] for i in page["items"]] == ["r2"] and page["next_after"] == 2
        models = [{"model": "mock", "endpoint": f"{mock.url}/v1", "version": 3}]
        await api.call("POST", "/api/models", "list[Model]", status=201, json=models)
        assert daemon.proxy.backends == [mock.url] and daemon.proxy.weight_version == 3
        await api.call("DELETE", "/api/models", "status")
        assert daemon.proxy.backends == []
        paused = await api.call(
            "POST", "/proxy/pause", "PauseStateResponse", json={"retry_after_seconds": 9, "reason": "sync"}
        )
        assert paused == {"paused": True, "retry_after_seconds": 9, "reason": "sync", "inflight": 0}
        assert daemon.proxy.held
        await api.call("GET", "/proxy/state", "PauseStateResponse")
        resumed = await api.call("POST", "/proxy/resume", "PauseStateResponse")
        assert resumed["paused"] is False and not daemon.proxy.held
    await validated(api)


async def test_the_state_machine_is_agent_lightnings_and_refuses_every_other_transition_with_409() -> None:
    """Every (from, to) pair of Agent Lightning's four states: allowed exactly when its own VALID_TRANSITIONS
    table allows it (a 409 otherwise, the rollout unchanged)."""
    states = ["queuing", "running", "succeeded", "failed"]
    async with serving() as (_, api, _mock):
        table = (await validated(api))["valid_transitions"]

        async def rollout_in(state: str, rollout_id: str) -> None:
            await api.call(
                "POST",
                "/api/rollouts",
                "list[Rollout]",
                status=201,
                json=[{"input": {}, "rollout_id": rollout_id}],
            )
            if state in ("running", "succeeded"):
                await api.patch(rollout_id, state="running")
            if state == "succeeded":
                await api.reward(rollout_id, 1.0)
            if state in ("succeeded", "failed"):
                await api.patch(rollout_id, state=state)

        for source in states:
            for target in states:
                rollout_id = f"{source}-to-{target}"
                await rollout_in(source, rollout_id)
                if target == "succeeded" and source == "running":
                    await api.reward(rollout_id, 1.0)
                allowed = target in table[source]
                body = await api.patch(rollout_id, status=200 if allowed else 409, state=target)
                if allowed:
                    assert body["status"]["state"] == target
                else:
                    assert body == {"detail": f"Rollout {rollout_id}: cannot transition {source} -> {target}"}
                    api.answers.pop()  # the 409's detail is not a Rollout
                    detail = await api.call("GET", f"/api/rollouts/{rollout_id}", "RolloutDetail")
                    assert detail["rollout"]["status"]["state"] == source
    await validated(api)


async def test_a_failed_attempt_is_retried_as_a_new_rollout_that_controllers_pick_up() -> None:
    """aglverl's retries and Agent Lightning's state machine: the failed attempt's rollout ends failed (its
    error says which rollout retries it), the retry is a fresh queuing rollout with the same input and config,
    and its success completes the aglverl rollout with its reward."""
    config = RolloutConfig(timeout_seconds=120)
    async with serving(max_attempts=2) as (daemon, api, _mock):
        body = [{"input": {"x": 1}, "rollout_id": "job", "config": config.model_dump()}]
        await api.call("POST", "/api/rollouts", "list[Rollout]", status=201, json=body)
        await api.patch("job", state="running", last_attempt_id="0")
        failed = await api.patch("job", state="failed", error_message="subprocess exited with code 1")
        assert failed["status"]["state"] == "failed"
        assert "subprocess exited with code 1" in failed["status"]["error_message"]
        assert "retried as job-retry-1" in failed["status"]["error_message"]
        (retry,) = await api.call(
            "GET", "/api/rollouts", "list[Rollout]", params={"state_in": ["queuing", "running"]}
        )
        assert retry["rollout_id"] == "job-retry-1" and retry["input"] == {"x": 1}
        assert retry["config"]["timeout_seconds"] == 120
        await api.patch("job-retry-1", state="running", last_attempt_id="0")
        await api.reward("job-retry-1", 0.75)
        await api.patch("job-retry-1", state="succeeded", last_attempt_id="0")
        record = daemon.store.record("job")
        assert record.state == "completed" and record.result.final_reward == 0.75 and record.num_claims == 2
        page = await api.call("GET", "/api/rollouts/terminal", "TerminalRolloutsPage")
        assert [(i["rollout_id"], i["state"]) for i in page["items"]] == [
            ("job", "failed"),
            ("job-retry-1", "succeeded"),
        ]
        # an attempt reported succeeded without a reward event fails (no reward_fillna_value here)
        await api.call(
            "POST", "/api/rollouts", "list[Rollout]", status=201, json=[{"input": {}, "rollout_id": "quiet"}]
        )
        await api.patch("quiet", state="running")
        quiet = await api.patch("quiet", state="succeeded")
        assert (
            quiet["status"]["state"] == "failed"
            and "without a reward event" in quiet["status"]["error_message"]
        )
    await validated(api)


async def test_the_proxy_path_serves_streams_responses_and_anthropic_messages_with_the_modes_temperature() -> (
    None
):
    """An agent's first call starts its rollout; every API aglverl's proxy serves works on Agent Lightning's
    path (a stream, the Responses API, Anthropic Messages), each call recorded with its token ids, the served
    model's name and the rollout's temperature forced (aglverl's proxy would refuse the agent's own 1.3)."""
    async with serving(sampling_parameters={"temperature": 0.7}) as (daemon, api, mock):
        await api.call(
            "POST", "/api/rollouts", "list[Rollout]", status=201, json=[{"input": {}, "rollout_id": "a"}]
        )
        base = openai_url(daemon, "a")
        async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
            text = []
            stream = await client.chat.completions.create(
                model="gpt-x",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                temperature=1.3,
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
            assert "".join(text)
            (running,) = await api.call(
                "GET", "/api/rollouts", "list[Rollout]", params={"state_in": ["running"]}
            )
            assert running["rollout_id"] == "a"  # the first call started it
            response = await client.responses.create(model="gpt-x", input="hello", max_output_tokens=4)
            assert response.output_text
        async with anthropic.AsyncAnthropic(
            base_url=base.removesuffix("/v1"), api_key=KEY, max_retries=0
        ) as claude:
            message = await claude.messages.create(
                model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hey"}]
            )
            assert message.content[0].text
        sent = [r.json for r in mock.generation_requests()]
        assert [(s["model"], s["temperature"]) for s in sent] == [("mock", 0.7)] * 3
        events = await api.call(
            "GET", "/api/rollouts/a/events", "list[Event]", params={"event_type": "model_request"}
        )
        assert len(events) == 3 and all(e["data"]["response"]["choices"][0]["token_ids"] for e in events)
        await api.call(
            "POST", "/proxy/rollout/a/attempt/0/mode/test/openai/v1/chat/completions", status=404, json={}
        )
        await api.patch("a", state="failed", error_message="stop")
        late = await api.client.post(
            f"{base}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert late.status_code == 409
    await validated(api)


async def test_every_route_needs_the_key_as_a_bearer_token_or_x_api_key() -> None:
    async with serving() as (daemon, api, _mock):
        async with httpx.AsyncClient(base_url=daemon.server_url) as anonymous:
            for method, path in [
                ("GET", "/api/rollouts?state_in=queuing"),
                ("POST", "/api/rollouts"),
                ("GET", "/api/rollouts/terminal"),
                ("GET", "/api/rollouts/x"),
                ("PATCH", "/api/rollouts/x"),
                ("DELETE", "/api/rollouts/x"),
                ("POST", "/api/rollouts/x/attempt/0/events"),
                ("GET", "/api/rollouts/x/events"),
                ("POST", "/api/models"),
                ("DELETE", "/api/models"),
                ("POST", "/proxy/pause"),
                ("POST", "/proxy/resume"),
                ("GET", "/proxy/state"),
                ("POST", "/proxy/rollout/x/attempt/0/mode/train/openai/v1/chat/completions"),
            ]:
                response = await anonymous.request(method, path)
                assert response.status_code == 401, (method, path)
                assert response.json() == {"detail": "Invalid or missing API key"}
            assert (await anonymous.get("/healthz")).json() == {"status": "ok"}
            with_header = await anonymous.get("/proxy/state", headers={"x-api-key": KEY})
            assert with_header.status_code == 200
        assert (await api.client.get("/api/rollouts")).status_code == 422  # state_in is required


async def test_the_terminal_cursor_continues_across_a_daemon_restarted_on_its_journal(tmp_path: Path) -> None:
    """A reader's ``next_after`` from before a restart lists exactly what ended after it: positions are journaled
    (a resumed ``AsyncVERL`` run reopens its journal the same way). An attempt in flight at the restart ended
    with it (failed, in the cursor) and its retry is a new queuing rollout."""
    journal = tmp_path / "run.journal"
    create = [{"input": {"data_id": f"d{i}"}, "rollout_id": f"r{i}"} for i in range(4)]
    async with serving(max_attempts=2, journal_path=journal) as (_, api, _mock):
        await api.call("POST", "/api/rollouts", "list[Rollout]", status=201, json=create)
        await api.patch("r0", state="running")
        await api.reward("r0", 1.0)
        await api.patch("r0", state="succeeded")
        await api.patch(
            "r1", state="failed", error_message="its Job spec was invalid"
        )  # never started: no retry
        await api.patch("r3", state="running")  # in flight when the daemon stops
        before = await api.call("GET", "/api/rollouts/terminal", "TerminalRolloutsPage")
        assert [(i["rollout_id"], i["state"]) for i in before["items"]] == [
            ("r0", "succeeded"),
            ("r1", "failed"),
        ]
    cursor = before["next_after"]
    async with serving(max_attempts=2, journal_path=journal) as (_, api2, _mock):
        api2.answers = api.answers
        again = await api2.call("GET", "/api/rollouts/terminal", "TerminalRolloutsPage")
        assert again["items"][:2] == before["items"]
        new = await api2.call(
            "GET", "/api/rollouts/terminal", "TerminalRolloutsPage", params={"after": cursor}
        )
        assert [(i["rollout_id"], i["state"]) for i in new["items"]] == [("r3", "failed")]
        r3 = await api2.call("GET", "/api/rollouts/r3", "RolloutDetail")
        assert "previous run" in r3["rollout"]["status"]["error_message"]
        queued = await api2.call("GET", "/api/rollouts", "list[Rollout]", params={"state_in": ["queuing"]})
        assert sorted(r["rollout_id"] for r in queued) == ["r2", "r3-retry-1"]
        await api2.patch("r2", state="running")
        await api2.reward("r2", 0.5)
        await api2.patch("r2", state="succeeded")
        last = await api2.call(
            "GET", "/api/rollouts/terminal", "TerminalRolloutsPage", params={"after": new["next_after"]}
        )
        assert [(i["rollout_id"], i["state"]) for i in last["items"]] == [("r2", "succeeded")]
        assert last["total_terminal"] == 4 and last["next_after"] == 4
    await validated(api2)


K8S_TEMPLATE = """\
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ job_name }}
spec:
  template:
    spec:
      containers:
        - name: agent
          image: python:3.12
          command: ["python", "-c", "from agl_style_agents import RewardAgent; RewardAgent().run()"]
          env:
            - name: TASK_REWARD
              value: {{ input.reward | yaml_escape }}
"""


async def test_agent_lightnings_kubernetes_controller_drives_rollouts_through_its_routes(
    tmp_path: Path,
) -> None:
    """``runner_type=k8s`` cannot run here (no cluster): its own reconciler runs against this server with the
    Kubernetes API replaced by a local stand-in that runs each created Job's container as a process (its
    command, with the env Agent Lightning rendered into the Job). What it uses of the server is real: the
    rollouts' ``config.k8s.job_template`` rendered by ``build_job_spec`` (job name, labels, deadline, the
    agent's AGL_* URLs), ``GET /api/rollouts?state_in=queuing&state_in=running&limit=500``, ``PATCH`` with
    ``state``, ``k8s_job_name``, ``last_attempt_id`` and ``error_message``, the proxy path and events."""
    settings = AgentLightningSettings(
        rollout_config=RolloutConfig(timeout_seconds=300, k8s=RolloutK8sConfig(job_template=K8S_TEMPLATE))
    )
    async with serving(settings=settings) as (daemon, _api, _mock):
        step = await daemon.submit([{"prompt": "a", "reward": 0.25}, {"prompt": "b", "reward": 0.75}], n=1)
        python = agl_python()
        assert python is not None
        command = [python, str(HELPERS / "agl_k8s_driver.py"), daemon.server_url, KEY, str(HELPERS)]
        result = await anyio.run_process(command, check=False)
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        report = json.loads(result.stdout.splitlines()[-1])  # after the reconciler's own log lines
        with anyio.fail_after(60):
            batch = await daemon.batches.receive()
        assert batch.step == step.number
    assert sorted(batch.data.batch["token_level_scores"].sum(-1).tolist()) == [0.25, 0.75]
    jobs = report["jobs"]
    assert len(jobs) == 2
    for job in jobs:
        assert job["name"] == f"agl-rollout-{job['rollout_id']}" and job["activeDeadlineSeconds"] == 300
        assert job["env"]["AGL_OPENAI_BASE_URL"] == openai_url(daemon, job["rollout_id"])
        assert (
            job["env"]["AGL_EVENT_URL"]
            == f"{daemon.server_url}/api/rollouts/{job['rollout_id']}/attempt/0/events"
        )
        assert job["env"]["AGL_KEY"] == KEY
    assert report["patched"] == ["running", "running", "succeeded", "succeeded"]
    assert report["k8s_job_names"] == sorted(f"agl-rollout-{j['rollout_id']}" for j in jobs)
