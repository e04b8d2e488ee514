"""The embedded rollout engine: aglverl's inference server hosted inside verl's hybrid actor worker.

verl looks a rollout engine up in two registries (``verl_plugin/__init__.py`` registers this one as
``rollout.name=aglverl``):

- :class:`EmbeddedRollout` (a ``BaseRollout``) lives in each ``ActorRolloutRefWorker`` process (hybrid
  mode), or in the ``CheckpointEngineWorker`` verl starts for a standalone replica (its own resource pool, as
  ``trainer.v1.trainer_mode=separate_async`` uses). It hosts an :class:`~aglverl.engine.server.InferenceServer`
  over the model on its own thread and event loop, so the server keeps answering while the worker trains;
  weights arrive through verl's checkpoint engine (``update_weights`` with full HF-named tensors, from a plain
  or an async iterator) and are copied into the served model between generations.
- :class:`EmbeddedReplica` (a ``RolloutReplica``) lives in the driver. verl's LLM server manager creates one
  per rollout replica; it reports the server's ``host:port`` and hands verl a Ray actor,
  :class:`EmbeddedServerHandle`, that offers the server-handle methods verl calls, with the semantics of
  verl's vLLM server: token-in/token-out ``generate`` (for verl's own agent loop and V1's partial-rollout
  client), sleep / wake-up, ``abort_all_requests`` / ``resume_generation``, KV-cache no-ops.

Only ``tensor_model_parallel_size == 1`` is supported: every replica is one worker with one server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncIterable, Iterable
from typing import Any

import aiohttp
import orjson
import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from ..engine.server import KEEPALIVE_SECONDS, WEIGHT_VERSION_HEADER, InferenceServer
from ..engine.thread import InferenceServerThread
from . import ROLLOUT_NAME

__all__ = [
    "ROLLOUT_NAME",
    "EmbeddedReplica",
    "EmbeddedRollout",
    "EmbeddedServerHandle",
    "local_rollout",
    "rollout_seed",
]

logger = logging.getLogger(__name__)

#: The rollouts of this process (one per hybrid worker in practice); ``__ray_call__`` reaches them here.
_LOCAL: list[EmbeddedRollout] = []

#: Retry policy of the handle's POST when the connection fails before any response byte (a keep-alive
#: connection the server closed as we wrote to it, a listener that is restarting): the pause before each
#: retry, all on fresh connections. The first retry is immediate; the rest give a listener time to return.
RETRY_DELAYS = (0.0, 0.1, 0.4, 1.0)
#: The handle's idle keep-alive, under the server's (``KEEPALIVE_SECONDS``), so it closes a pooled connection
#: before the server does; the retry above covers the race that is left.
_CLIENT_KEEPALIVE = KEEPALIVE_SECONDS - 1.0
#: No overall deadline: a request may wait at a sleeping or paused server until an abort ends it (as vLLM's).
_CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)
#: vLLM server's mapping of a finish reason to verl's stop reason (``vllm_async_server.py``); others pass.
_STOP_REASONS = {"abort": "aborted", "stop": "completed", "length": "completed"}


def local_rollout() -> EmbeddedRollout:
    """The embedded rollout of the calling worker process (raises if this process hosts none)."""
    if not _LOCAL:
        raise RuntimeError("this process hosts no aglverl rollout (is rollout.name=aglverl?)")
    return _LOCAL[-1]


def rollout_seed(config: Any) -> int | None:
    """The seed of the embedded engine's sampling, as verl seeds vLLM's: ``rollout.seed`` plus the replica's rank
    (one model copy per worker here, so the worker's ``RANK``); ``None`` (sampling seeded from the OS) when the
    config sets no seed. A request's own ``seed`` still wins for its sequences."""
    seed = getattr(config, "seed", None)
    if seed is None:
        return None
    return int(seed) + int(os.environ.get("RANK", "0"))


class EmbeddedRollout(BaseRollout):
    """verl's rollout interface over an in-process :class:`InferenceServer`.

    ``release()`` (verl's sleep) makes the server hold new generations until ``resume(["kv_cache"])``;
    ``update_weights`` consumes verl's ``(name, tensor)`` iterator on every rank (FSDP gathers full tensors
    collectively; checkpoint engines yield from an async generator) and loads them into the served model,
    which then serves weight version ``global_steps``.
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
            seed=rollout_seed(self.config),
        )
        self._thread = InferenceServerThread(self.server)
        self.address = self._thread.start().removeprefix("http://")
        _LOCAL.append(self)
        logger.info("aglverl rollout serving %s at %s", self.server.served_model_name, self.server.url)

    def shutdown(self) -> None:
        """Stop the server (in-flight requests get a short grace) and forget this rollout; blocking."""
        self._thread.stop()
        if self in _LOCAL:
            _LOCAL.remove(self)

    async def resume(self, tags: list[str]) -> None:
        """verl resumes ``weights`` before a sync and ``kv_cache`` after it; the latter wakes the server."""
        if "kv_cache" in tags:
            self.server.wake_up()

    async def release(self) -> None:
        """verl's sleep: new generations wait until the next wake-up (there is no GPU memory to free)."""
        self.server.sleep()

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        """Load full HF-named tensors into the served model; it then serves version ``global_steps``.

        ``weights``: a plain iterable (the hybrid worker's generator) or an async iterator (every verl
        checkpoint engine's ``receive_weights``). All of it is received first, then loaded in one swap
        between generations: if the iterator raises or the call is cancelled while receiving, nothing is
        loaded; once loading has started, cancellation does not interrupt it (the copy completes). Raises
        ``KeyError``/``ValueError`` for an unknown name or a shape mismatch (see
        :meth:`InferenceServer.load_weights`), ``NotImplementedError`` for other wire formats or LoRA.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the aglverl rollout takes full named tensors, not {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError(
                "the aglverl rollout cannot load LoRA adapters; set model.lora.merge=true"
            )
        named = await _received(weights)
        version = int(kwargs.get("global_steps") or 0)
        await asyncio.to_thread(self.server.load_weights, named, version)


async def _received(
    weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of ``weights``, each tensor copied to the CPU.

    Consumed here, on the worker's loop: the iterator may run collectives (FSDP ``full_tensor``) and yields
    views of training parameters or of a transfer buffer it reuses for the next item, hence the copies.
    """
    if isinstance(weights, AsyncIterable):
        try:
            return [(name, tensor.detach().to("cpu", copy=True)) async for name, tensor in weights]
        finally:
            aclose = getattr(weights, "aclose", None)
            if aclose is not None:  # an async generator left early (error, cancellation) runs its cleanup now
                await aclose()
    return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]


def _describe(_worker: Any) -> dict[str, Any]:
    rollout = local_rollout()
    server = rollout.server
    return {
        "address": rollout.address,
        "model": server.served_model_name,
        "max_model_len": server.max_model_len,
    }


def _sleep(_worker: Any) -> None:
    local_rollout().server.sleep()


def _wake_up(_worker: Any) -> None:
    local_rollout().server.wake_up()


def _state(_worker: Any) -> dict[str, Any]:
    return dataclasses.asdict(local_rollout().server.stats())


def _abort(_worker: Any, reject: bool) -> list[str]:
    return local_rollout().server.abort(reject=reject)


def _resume(_worker: Any) -> None:
    local_rollout().server.resume()


@ray.remote(num_cpus=0)
class EmbeddedServerHandle:
    """The Ray actor verl holds for one embedded server (its "server handle"), behaving as verl's vLLM server.

    It runs no model: ``generate`` calls the server over loopback HTTP (token ids in, token ids out), and the
    life-cycle methods reach the rollout inside the worker process through ``__ray_call__``. ``prompt_length``
    and ``response_length`` are the rollout config's (the default ``max_tokens``), ``max_model_len`` the
    server's context.
    """

    def __init__(
        self,
        workers: list[Any],
        address: str,
        model: str,
        *,
        prompt_length: int,
        response_length: int,
        max_model_len: int,
    ) -> None:
        self.workers = workers
        self.url = f"http://{address}"
        self.model = model
        self.lengths = _Lengths(int(prompt_length), int(response_length), int(max_model_len))
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
        """Token-in/token-out generation through ``/v1/completions``, as verl's vLLM server does it.

        ``max_tokens`` (or ``max_new_tokens``) defaults to ``min(response_length, prompt_length +
        response_length - len(prompt_ids))`` and is clamped to ``[1, max_model_len - len(prompt_ids)]``;
        log-probs are returned only if ``logprobs`` is truthy. ``stop_reason`` is ``"completed"`` (EOS, stop,
        length) or ``"aborted"`` (an abort ended it: ``token_ids`` holds what was generated so far, and a
        request refused by ``abort_all_requests(reject_request=True)`` has none); ``extra_fields
        ["global_steps"]`` is the weight version the tokens were generated under. A request waits while the
        server sleeps or is paused by an abort, until it wakes / resumes or an abort ends it.

        Raises ``ValueError`` when the prompt leaves no room to generate, ``NotImplementedError`` for
        multi-modal input, ``RuntimeError`` naming the server when it answers with an error or cannot be
        reached (connections that fail before any response byte are retried, see ``RETRY_DELAYS``).
        Cancelling the call closes the connection, which drops the sequence from the server's batch.
        """
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise NotImplementedError("the aglverl rollout serves text-only models")
        body = _completion_request(self.model, list(prompt_ids), sampling_params, request_id, self.lengths)
        payload, version = await self._post("/v1/completions", body)
        return _token_output(payload, version)

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """POST ``body``: the answer and its weight version; retries what failed before any response byte."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_CLIENT_KEEPALIVE)
            self._session = aiohttp.ClientSession(connector=connector, timeout=_CLIENT_TIMEOUT)
        try:
            return await _post_once(self._session, self.url + path, body)
        except _NoResponse as exc:
            failure = exc.__cause__
        for attempt, delay in enumerate(RETRY_DELAYS, start=2):
            logger.info(
                "retrying %s on a fresh connection (attempt %d) after: %r", self.url, attempt, failure
            )
            await asyncio.sleep(delay)
            fresh = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=fresh, timeout=_CLIENT_TIMEOUT) as session:
                try:
                    return await _post_once(session, self.url + path, body)
                except _NoResponse as exc:
                    failure = exc.__cause__
        raise RuntimeError(
            f"aglverl rollout server at {self.url} did not answer {path} after {len(RETRY_DELAYS) + 1} "
            f"attempts: {failure!r}"
        ) from failure

    async def sleep(self) -> None:
        """Park the servers (requests wait); returns once the running generation has finished."""
        await asyncio.gather(*[w.__ray_call__.remote(_sleep) for w in self.workers])

    async def wake_up(self) -> None:
        """Undo :meth:`sleep` (it does not undo an abort: :meth:`resume_generation` does)."""
        await asyncio.gather(*[w.__ray_call__.remote(_wake_up) for w in self.workers])

    async def state(self) -> list[dict[str, Any]]:
        """The servers' state (weight version, sleeping, counters), for tests and diagnostics."""
        return list(await asyncio.gather(*[w.__ray_call__.remote(_state) for w in self.workers]))

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        """End every queued and running generation now; the answer of vLLM's server.

        Each ended ``generate`` returns its tokens so far with ``stop_reason="aborted"`` (requests waiting at
        a sleeping server included). Generation then stays paused until :meth:`resume_generation`: new
        requests wait, or with ``reject_request`` are answered at once as aborted with no tokens. Returns
        ``{"aborted_count": n, "request_ids": [...]}`` (the ids are the servers' ``cmpl-<request_id>``).
        """
        ended = await asyncio.gather(
            *[w.__ray_call__.remote(_abort, bool(reject_request)) for w in self.workers]
        )
        request_ids = [rid for ids in ended for rid in ids]
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_generation(self) -> None:
        """Let generation start again after :meth:`abort_all_requests`; idempotent."""
        await asyncio.gather(*[w.__ray_call__.remote(_resume) for w in self.workers])

    async def close(self) -> None:
        """Close the handle's pooled connections (a later ``generate`` opens new ones)."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

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


class _NoResponse(Exception):
    """The connection failed before any byte of the answer arrived (``__cause__``: the client error)."""


async def _post_once(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[dict[str, Any], int | None]:
    try:
        response = await session.post(url, json=body)
    except aiohttp.ClientConnectionError as exc:
        raise _NoResponse from exc
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"aglverl rollout server at {url}: {exc!r}") from exc
    async with response:
        try:
            raw = await response.read()
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"aglverl rollout server at {url} broke off its answer: {exc!r}") from exc
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    if response.status != 200 or not isinstance(payload, dict):
        error = (
            payload.get("error", payload) if isinstance(payload, dict) else raw[:500].decode(errors="replace")
        )
        raise RuntimeError(f"aglverl rollout server at {url} answered {response.status}: {error}")
    version = response.headers.get(WEIGHT_VERSION_HEADER)
    return payload, int(version) if version is not None else None


@dataclasses.dataclass(frozen=True, slots=True)
class _Lengths:
    """The rollout's prompt and response lengths and the server's context: what bounds ``max_tokens``."""

    prompt_length: int
    response_length: int
    max_model_len: int


def _token_output(payload: dict[str, Any], version: int | None) -> TokenOutput:
    choice = payload["choices"][0]
    finish = choice.get("finish_reason")
    logprobs = choice.get("logprobs") or {}
    return TokenOutput(
        token_ids=choice["token_ids"],
        log_probs=logprobs.get("token_logprobs"),
        stop_reason=_STOP_REASONS.get(finish, finish),
        extra_fields={"global_steps": version},
    )


def _completion_request(
    model: str, prompt_ids: list[int], sampling: dict[str, Any], request_id: str | None, lengths: _Lengths
) -> dict[str, Any]:
    """verl's sampling params (vLLM names) as an OpenAI completions request with token ids in and out.

    ``max_tokens`` as verl's vLLM server computes it (see :meth:`EmbeddedServerHandle.generate`); raises
    ``ValueError`` if the prompt leaves no room within ``max_model_len``.
    """
    room = lengths.max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) leaves no room to generate within max_model_len="
            f"{lengths.max_model_len}"
        )
    limit = sampling.get("max_tokens")
    if limit is None:
        limit = sampling.get("max_new_tokens")
    if limit is None:
        limit = min(
            lengths.response_length, lengths.prompt_length + lengths.response_length - len(prompt_ids)
        )
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_ids,
        "return_token_ids": True,
        "request_id": request_id or uuid.uuid4().hex,
        "max_tokens": max(1, min(int(limit), room)),
    }
    for key in ("temperature", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos"):
        if sampling.get(key) is not None:
            body[key] = sampling[key]
    if sampling.get("logprobs"):
        body["logprobs"] = 0
    return body


class EmbeddedReplica(RolloutReplica):
    """One embedded rollout replica, as verl's LLM server manager sees it.

    Hybrid (inside the actor workers) and standalone (a resource pool of its own, verl's
    ``CheckpointEngineWorker`` hosting :class:`EmbeddedRollout`) modes; colocated mode (a separate process
    beside the actor, verl's reward and teacher model servers) is refused.
    """

    async def launch_servers(self) -> None:
        """Find the server the worker started and create its handle; raises for colocated mode."""
        if self.rollout_mode not in (RolloutMode.HYBRID, RolloutMode.STANDALONE):
            raise NotImplementedError(
                f"the aglverl rollout runs in hybrid mode (inside verl's actor workers) or standalone mode (its "
                f"own resource pool), not {self.rollout_mode}: colocated reward or teacher model servers are not "
                f"supported by rollout.name={ROLLOUT_NAME}"
            )
        info = await self.workers[0].__ray_call__.remote(_describe)
        handle = EmbeddedServerHandle.options(max_concurrency=self.max_concurrency).remote(
            self.workers,
            info["address"],
            info["model"],
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            max_model_len=info["max_model_len"],
        )
        self.servers = [handle]
        self._server_handle = handle
        self._server_address = info["address"]
