"""The embedded rollout engine: aglverl's inference server hosted inside verl's hybrid actor worker.

verl looks a rollout engine up in two registries (``verl_plugin/__init__.py`` registers this one as
``rollout.name=aglverl``):

- :class:`EmbeddedRollout` (a ``BaseRollout``) lives in each ``ActorRolloutRefWorker`` process. It hosts an
  :class:`~aglverl.inference.InferenceServer` over the worker's model on its own thread and event loop, so
  the server keeps answering while the worker trains; weights arrive through verl's checkpoint engine
  (``update_weights`` with full HF-named tensors) and are copied into the served model between generations.
- :class:`EmbeddedReplica` (a ``RolloutReplica``) lives in the driver. verl's LLM server manager creates one
  per rollout replica; it reports the server's ``host:port`` and hands verl a Ray actor,
  :class:`EmbeddedServerHandle`, that offers the server-handle methods verl calls (token-in/token-out
  ``generate`` for verl's own agent loop, sleep / wake-up / abort / KV-cache no-ops).

Only ``tensor_model_parallel_size == 1`` is supported: every actor rank is one replica with one server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Iterable
from typing import Any

import aiohttp
import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from ..inference import InferenceServer, InferenceServerThread
from . import ROLLOUT_NAME

__all__ = ["ROLLOUT_NAME", "EmbeddedReplica", "EmbeddedRollout", "EmbeddedServerHandle", "local_rollout"]

logger = logging.getLogger(__name__)

#: The rollouts of this process (one per hybrid worker in practice); ``__ray_call__`` reaches them here.
_LOCAL: list[EmbeddedRollout] = []


def local_rollout() -> EmbeddedRollout:
    """The embedded rollout of the calling worker process (raises if this process hosts none)."""
    if not _LOCAL:
        raise RuntimeError("this process hosts no aglverl rollout (is rollout.name=aglverl?)")
    return _LOCAL[-1]


class EmbeddedRollout(BaseRollout):
    """verl's rollout interface over an in-process :class:`InferenceServer`.

    ``release()`` (verl's sleep) makes the server hold new generations until ``resume(["kv_cache"])``;
    ``update_weights`` consumes verl's ``(name, tensor)`` generator on every rank (FSDP gathers full tensors
    collectively) and loads them into the served model, which then serves weight version ``global_steps``.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        if self.config.tensor_model_parallel_size != 1:
            raise ValueError(
                f"rollout.name={ROLLOUT_NAME} serves one model copy per worker: set "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size=1 (got {self.config.tensor_model_parallel_size})"
            )
        max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        self.server = InferenceServer(
            str(self.model_config.local_path),
            # the configured model path, as vLLM names its model by default
            served_model_name=str(self.model_config.path),
            max_model_len=int(max_model_len),
            max_batch_size=int(self.config.max_num_seqs),
        )
        self._thread = InferenceServerThread(self.server)
        self.address = self._thread.start().removeprefix("http://")
        _LOCAL.append(self)
        logger.info("aglverl rollout serving %s at %s", self.server.served_model_name, self.server.url)

    async def resume(self, tags: list[str]) -> None:
        """verl resumes ``weights`` before a sync and ``kv_cache`` after it; the latter wakes the server."""
        if "kv_cache" in tags:
            self.server.wake_up()

    async def release(self) -> None:
        """verl's sleep: new generations wait until the next wake-up (there is no GPU memory to free)."""
        self.server.sleep()

    async def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        """Load full HF-named tensors into the served model; it then serves version ``global_steps``."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the aglverl rollout takes full named tensors, not {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the aglverl rollout cannot load LoRA adapters; set model.lora.merge=true")
        # The generator may run collectives (FSDP full_tensor) and yields views of training parameters, so it
        # is consumed here, on the worker's thread, and every tensor is copied before the next step runs.
        named = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]
        version = int(kwargs.get("global_steps") or 0)
        await asyncio.to_thread(self.server.load_weights, named, version)


def _describe(_worker: Any) -> tuple[str, str]:
    rollout = local_rollout()
    return rollout.address, rollout.server.served_model_name


def _sleep(_worker: Any) -> None:
    local_rollout().server.sleep()


def _wake_up(_worker: Any) -> None:
    local_rollout().server.wake_up()


def _state(_worker: Any) -> dict[str, Any]:
    return dataclasses.asdict(local_rollout().server.stats())


@ray.remote(num_cpus=0)
class EmbeddedServerHandle:
    """The Ray actor verl holds for one embedded server (its "server handle").

    It runs no model: ``generate`` calls the server over loopback HTTP (token ids in, token ids out), and the
    life-cycle methods reach the rollout inside the worker process through ``__ray_call__``.
    """

    def __init__(self, workers: list[Any], address: str, model: str) -> None:
        self.workers = workers
        self.url = f"http://{address}"
        self.model = model
        self._session: aiohttp.ClientSession | None = None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str | None = None,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Token-in/token-out generation for verl's own agent loop, through ``/v1/completions``."""
        if image_data is not None or video_data is not None:
            raise NotImplementedError("the aglverl rollout serves text-only models")
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = _completion_request(self.model, prompt_ids, sampling_params, request_id)
        async with self._session.post(f"{self.url}/v1/completions", json=body) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"aglverl rollout at {self.url}: {payload.get('error', payload)}")
        choice = payload["choices"][0]
        logprobs = choice.get("logprobs") or {}
        return TokenOutput(
            token_ids=choice["token_ids"],
            log_probs=logprobs.get("token_logprobs"),
            stop_reason="completed",
        )

    async def sleep(self) -> None:
        await asyncio.gather(*[w.__ray_call__.remote(_sleep) for w in self.workers])

    async def wake_up(self) -> None:
        await asyncio.gather(*[w.__ray_call__.remote(_wake_up) for w in self.workers])

    async def state(self) -> list[dict[str, Any]]:
        """The servers' state (weight version, sleeping, counters), for tests and diagnostics."""
        return list(await asyncio.gather(*[w.__ray_call__.remote(_state) for w in self.workers]))

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        # Generation requests are short and bounded by max_tokens; weight updates wait for the running one.
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def _completion_request(
    model: str, prompt_ids: list[int], sampling: dict[str, Any], request_id: str | None
) -> dict[str, Any]:
    """verl's sampling params (vLLM names) as an OpenAI completions request with token ids in and out."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "return_token_ids": True,
        "user": request_id or uuid.uuid4().hex,
    }
    for key in ("temperature", "top_p", "max_tokens", "seed", "stop"):
        if sampling.get(key) is not None:
            body[key] = sampling[key]
    if sampling.get("logprobs") is not None:
        body["logprobs"] = 0
    return body


class EmbeddedReplica(RolloutReplica):
    """One embedded rollout replica, as verl's LLM server manager sees it (hybrid mode only)."""

    async def launch_servers(self) -> None:
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(
                "the aglverl rollout runs inside verl's hybrid actor workers (actor_rollout_ref.hybrid_engine=true)"
            )
        address, model = await self.workers[0].__ray_call__.remote(_describe)
        handle = EmbeddedServerHandle.remote(self.workers, address, model)
        self.servers = [handle]
        self._server_handle = handle
        self._server_address = address
