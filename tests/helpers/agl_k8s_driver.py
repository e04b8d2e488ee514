"""Agent Lightning's Kubernetes controller against aglverl's server, with a local stand-in for Kubernetes.

Run by the Agent Lightning tier's Python: ``agl_k8s_driver.py SERVER_URL KEY AGENTS_DIR``. It runs Agent
Lightning's own ``K8sReconciler._reconcile_once`` (the loop ``runner_type=k8s`` runs every poll) three times
against the server: the first pass creates a Job per queuing rollout (rendered by Agent Lightning's
``build_job_spec``), the second finds them pending and patches the rollouts running, then the Jobs' containers
run as local processes (their command, with the env Agent Lightning put in the Job; the image's ``python`` is
this Python, ``AGENTS_DIR`` on its path) and each Job is marked as Kubernetes would (``Complete`` or
``Failed``), and the third pass patches the rollouts' ends. Only the Kubernetes API is replaced (no cluster can
run here). Prints a JSON report: the Jobs created, the states patched, the job names the server stored.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import agentlightning.controller.k8s_reconciler as k8s
from agentlightning.client import AgentLightningAsyncClient
from omegaconf import OmegaConf


class LocalJob:
    """What the reconciler uses of ``kr8s.asyncio.objects.Job``: create, list, ``raw``."""

    created: dict[str, dict[str, Any]] = {}

    def __init__(self, manifest: dict[str, Any], api: Any = None) -> None:
        self.raw = manifest

    async def async_create(self) -> None:
        name = self.raw["metadata"]["name"]
        if name in LocalJob.created:
            raise RuntimeError(f"409 Conflict: jobs.batch {name!r} already exists")
        self.raw.setdefault("status", {})
        LocalJob.created[name] = self.raw

    @classmethod
    async def async_list(cls, namespace: str, label_selector: str, api: Any) -> AsyncIterator[LocalJob]:
        for raw in list(cls.created.values()):
            if raw["metadata"]["namespace"] == namespace:
                yield cls(raw)


async def run_pod(job: dict[str, Any], agents_dir: str) -> None:
    """The Job's one container, as a local process; then the Job's condition as Kubernetes reports it."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, "PYTHONPATH": agents_dir, **{e["name"]: str(e["value"]) for e in container["env"]}}
    command = [
        sys.executable if container["command"][0] == "python" else container["command"][0],
        *container["command"][1:],
    ]
    process = await asyncio.create_subprocess_exec(*command, env=env)
    code = await process.wait()
    if code == 0:
        job["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    else:
        condition = {
            "type": "Failed",
            "status": "True",
            "reason": "BackoffLimitExceeded",
            "message": f"exit {code}",
        }
        job["status"] = {"failed": 1, "conditions": [condition]}


async def main(server: str, key: str, agents_dir: str) -> dict[str, Any]:
    config = OmegaConf.create(
        {
            "runner_type": "k8s",
            "agl_server": {"url": server, "agent_url": None, "key": key},
            "k8s_runner": {
                "namespace": "default",
                "ttl_after_finished": 1200,
                "max_jobs_per_minute": 100,
                "poll_interval": 5,
            },
        }
    )
    k8s.k8s_objects.Job = LocalJob  # type: ignore[misc]
    patched: list[str] = []
    names: list[str] = []
    async with AgentLightningAsyncClient(base_url=server, key=key, timeout=120) as api:
        reconciler = k8s.K8sReconciler(api=api, config=config)

        async def no_cluster() -> object:
            return object()

        reconciler._get_k8s_api = no_cluster  # type: ignore[method-assign]
        original = api.patch

        async def patch(url: str, **kwargs: Any) -> Any:
            response = await original(url, **kwargs)
            response.raise_for_status()
            patched.append(kwargs["json"]["status"]["state"])
            names.append(response.json()["status"]["k8s_job_name"])
            return response

        api.patch = patch  # type: ignore[method-assign]
        await reconciler._reconcile_once()  # creates the Jobs
        await reconciler._reconcile_once()  # finds them pending: the rollouts are running
        await asyncio.gather(*(run_pod(job, agents_dir) for job in LocalJob.created.values()))
        await reconciler._reconcile_once()  # finds them complete: the rollouts succeeded
    jobs = []
    for job in LocalJob.created.values():
        (container,) = job["spec"]["template"]["spec"]["containers"]
        jobs.append(
            {
                "name": job["metadata"]["name"],
                "rollout_id": job["metadata"]["labels"]["agentlightning/rollout-id"],
                "activeDeadlineSeconds": job["spec"].get("activeDeadlineSeconds"),
                "env": {e["name"]: e["value"] for e in container["env"]},
            }
        )
    return {"jobs": jobs, "patched": sorted(patched), "k8s_job_names": sorted(set(names))}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
