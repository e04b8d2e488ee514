"""The embedded rollout's server handle and weight loading, called in-process: verl's vLLM-server semantics.

The handle's class is used without Ray here (``generate`` only talks HTTP to the server); its abort and
sleep methods, which reach the worker through Ray, are covered with a real Ray in ``test_verl_plugin.py``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch
from aiohttp import web

from aglverl._net import bind_listener, url_of
from aglverl.algorithm import compose_config
from aglverl.engine.server import WEIGHT_VERSION_HEADER, InferenceServer
from aglverl.verl_plugin.rollout import RETRY_DELAYS, EmbeddedRollout, EmbeddedServerHandle, rollout_seed

pytestmark = pytest.mark.anyio

#: The class Ray wraps: its methods called directly, on the test's loop.
Handle = EmbeddedServerHandle.__ray_actor_class__  # type: ignore[attr-defined]

#: The rollout config's lengths the handle is given; the server's context is larger than their sum.
PROMPT_LENGTH, RESPONSE_LENGTH, MAX_MODEL_LEN = 40, 16, 64
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
async def server(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    async with InferenceServer(tiny_model, served_model_name="tiny", max_model_len=MAX_MODEL_LEN) as s:
        yield s


@pytest.fixture
async def paired(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    """A server that starts a batch only with two sequences (see ``test_inference.py``'s ``paired``)."""
    async with InferenceServer(tiny_model, served_model_name="tiny", max_batch_size=2, batch_wait=60) as s:
        yield s


def _handle(address: str) -> Any:
    return Handle(
        [],
        address,
        "tiny",
        prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH,
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture
async def handle(server: InferenceServer) -> AsyncIterator[Any]:
    h = _handle(server.url.removeprefix("http://"))
    yield h
    await h.close()


def _prompt(length: int) -> list[int]:
    return [5 + i % 400 for i in range(length)]


# ---------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize(
    ("prompt_len", "sampling", "expected"),
    [
        (10, {}, RESPONSE_LENGTH),  # the response length
        (45, {}, PROMPT_LENGTH + RESPONSE_LENGTH - 45),  # what the rollout's budget leaves
        (60, {}, 1),  # at least one token
        (50, {"max_tokens": 100}, MAX_MODEL_LEN - 50),  # an explicit limit is capped by the context
        (10, {"max_tokens": None, "max_new_tokens": 3}, 3),  # SGLang's name
    ],
    ids=["response_length", "budget", "at_least_one", "context", "max_new_tokens"],
)
async def test_max_tokens_defaults_like_verls_vllm_server(
    handle: Any, prompt_len: int, sampling: dict[str, Any], expected: int
) -> None:
    out = await handle.generate(_prompt(prompt_len), GREEDY | sampling)
    assert len(out.token_ids) == expected and out.stop_reason == "completed"


async def test_a_prompt_that_fills_the_context_is_refused(handle: Any, server: InferenceServer) -> None:
    with pytest.raises(ValueError, match="no room"):
        await handle.generate(_prompt(MAX_MODEL_LEN), {})
    assert server.stats().requests == 0


async def test_an_error_answer_raises_naming_the_server(handle: Any, server: InferenceServer) -> None:
    with pytest.raises(RuntimeError, match=f"{server.url}/v1/completions answered 400: .*temperature"):
        await handle.generate(_prompt(5), {"temperature": -1.0})


async def test_logprobs_only_when_asked(handle: Any) -> None:
    for sampling in ({}, {"logprobs": False}, {"logprobs": None}, {"logprobs": 0}):
        assert (await handle.generate(_prompt(5), GREEDY | sampling)).log_probs is None
    out = await handle.generate(_prompt(5), GREEDY | {"logprobs": True})
    assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids) == RESPONSE_LENGTH
    assert all(lp <= 0.0 for lp in out.log_probs)


async def test_a_stop_token_completes_and_the_weight_version_is_reported(
    handle: Any, server: InferenceServer
) -> None:
    free = await handle.generate(_prompt(5), GREEDY)
    assert free.extra_fields["global_steps"] == 0
    stopped = await handle.generate(_prompt(5), GREEDY | {"stop_token_ids": [free.token_ids[2]]})
    first = free.token_ids.index(free.token_ids[2])
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.stop_reason == "completed"
    server.load_weights([(n, p.detach().clone()) for n, p in server.model.named_parameters()], 3)
    again = await handle.generate(_prompt(5), GREEDY)
    assert again.token_ids == free.token_ids and again.extra_fields["global_steps"] == 3


async def test_an_abort_returns_the_ids_so_far_as_aborted(
    paired: InferenceServer, http: aiohttp.ClientSession
) -> None:
    handle = _handle(paired.url.removeprefix("http://"))
    outputs: list[Any] = []

    async def generate() -> None:
        outputs.append(await handle.generate(_prompt(5), GREEDY | {"max_tokens": 1000}, request_id="r1"))

    body = {"model": "tiny", "prompt": _prompt(5), "max_tokens": 1000, "stream": True} | GREEDY
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(generate)
                async with http.post(paired.url + "/v1/completions", json=body) as resp:
                    await resp.content.readuntil(b"\n\n")  # the handle's request runs beside this stream
                    ended = await anyio.to_thread.run_sync(lambda: paired.abort(reject=True))
                    await resp.read()
            refused = await handle.generate(_prompt(5), GREEDY)
    finally:
        await handle.close()
    assert "cmpl-r1" in ended
    out = outputs[0]
    assert out.stop_reason == "aborted" and 1 <= len(out.token_ids) < 1000
    assert out.extra_fields["global_steps"] == 0
    assert refused.stop_reason == "aborted" and refused.token_ids == []


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


# ---------------------------------------------------------------------------------------------- connections
class _DroppingFront:
    """A loopback HTTP front to ``upstream`` that answers each connection's first request and closes the
    connection, unanswered, on its second: a keep-alive connection the server closed as the client reused it
    (the ``Cannot write to closing transport`` / server-disconnected race)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.connections: list[Any] = []  # transports seen, kept alive so ids are not reused
        self.requests = 0
        self.dropped = 0

    async def relay(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        transport = request.transport
        if any(t is transport for t in self.connections):
            self.dropped += 1
            assert transport is not None
            transport.close()
            return web.Response()  # never reaches the client
        self.connections.append(transport)
        async with aiohttp.ClientSession() as session:
            async with session.post(self.upstream + request.path, data=await request.read()) as answer:
                body = await answer.read()
                version = answer.headers[WEIGHT_VERSION_HEADER]
        return web.Response(
            body=body, content_type="application/json", headers={WEIGHT_VERSION_HEADER: version}
        )


@pytest.fixture
async def front(server: InferenceServer) -> AsyncIterator[tuple[_DroppingFront, str]]:
    front = _DroppingFront(server.url)
    app = web.Application()
    app.router.add_post("/v1/completions", front.relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = bind_listener("127.0.0.1", 0)
    await web.SockSite(runner, sock).start()
    try:
        yield front, url_of(sock).removeprefix("http://")
    finally:
        await runner.cleanup()


async def test_a_dropped_keep_alive_connection_is_retried_on_a_fresh_one(
    front: tuple[_DroppingFront, str],
) -> None:
    relay, address = front
    handle = _handle(address)
    try:
        first = await handle.generate(_prompt(5), GREEDY)
        second = await handle.generate(_prompt(5), GREEDY)  # reuses the kept-alive connection: dropped
    finally:
        await handle.close()
    assert second.token_ids == first.token_ids and second.stop_reason == "completed"
    assert (relay.requests, relay.dropped, len(relay.connections)) == (3, 1, 2)


async def test_an_unreachable_server_fails_naming_it_after_bounded_retries() -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    handle = _handle(address)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=f"http://{address}.*after {len(RETRY_DELAYS) + 1} attempts"):
            await handle.generate(_prompt(5), GREEDY)
    finally:
        await handle.close()
    assert time.monotonic() - started < sum(RETRY_DELAYS) + 5


# ---------------------------------------------------------------------------------------------- weights
@pytest.fixture
def rollout(tiny_model: Path) -> Iterator[EmbeddedRollout]:
    config, _ = compose_config({"actor_rollout_ref": {"model": {"path": str(tiny_model)}}})
    rollout = EmbeddedRollout(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model, None)
    yield rollout
    rollout.shutdown()


async def test_update_weights_takes_an_async_generator_as_checkpoint_engines_yield_it(
    rollout: EmbeddedRollout,
) -> None:
    served = rollout.server.model
    target = {n: torch.randn_like(p) for n, p in served.named_parameters()}  # tied weights once
    buffer: dict[str, torch.Tensor] = {}
    closed: list[bool] = []

    async def receive_weights() -> AsyncIterator[tuple[str, torch.Tensor]]:
        try:
            for name, tensor in target.items():
                await anyio.lowlevel.checkpoint()
                # like a transfer bucket: the same storage is overwritten for the next tensor
                view = buffer.setdefault(str(tuple(tensor.shape)), torch.empty_like(tensor))
                view.copy_(tensor)
                yield name, view
        finally:
            closed.append(True)

    await rollout.update_weights(receive_weights(), global_steps=5)
    assert closed == [True]
    for name, param in served.named_parameters():
        assert torch.equal(param, target[name]), name
    assert rollout.server.weight_version == 5
    # a plain iterable still works (the hybrid worker's generator)
    await rollout.update_weights(((n, t * 2) for n, t in target.items()), global_steps=6)
    assert torch.equal(served.get_parameter("model.norm.weight"), target["model.norm.weight"] * 2)
    assert rollout.server.weight_version == 6


async def test_a_failing_weight_iterator_loads_nothing(rollout: EmbeddedRollout) -> None:
    before = {n: p.detach().clone() for n, p in rollout.server.model.named_parameters()}

    async def broken() -> AsyncIterator[tuple[str, torch.Tensor]]:
        yield "model.norm.weight", torch.zeros_like(before["model.norm.weight"])
        raise ConnectionError("the sender went away")

    with pytest.raises(ConnectionError):
        await rollout.update_weights(broken(), global_steps=9)
    after = dict(rollout.server.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert rollout.server.weight_version == 0


# ---------------------------------------------------------------------------------------------- seed
SAMPLED = {"temperature": 1.0, "ignore_eos": True}


async def _sampled(rollout: EmbeddedRollout, count: int = 4) -> list[list[int]]:
    handle = Handle(
        [],
        rollout.address,
        rollout.server.served_model_name,
        prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH,
        max_model_len=MAX_MODEL_LEN,
    )
    try:
        return [(await handle.generate(_prompt(6), SAMPLED)).token_ids for _ in range(count)]
    finally:
        await handle.close()


async def test_the_engine_samples_from_verls_rollout_seed_plus_the_replicas_rank(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl seeds vLLM's engine with ``rollout.seed`` + the replica's rank; the embedded engine the same: two
    servers of one seed and rank sample the same tokens for the same unseeded requests, another seed or rank
    others (the default seed, 42, is verl's)."""
    runs: dict[tuple[int, str], list[list[int]]] = {}
    for seed, rank in ((7, "0"), (7, "0"), (8, "0"), (7, "3")):
        monkeypatch.setenv("RANK", rank)
        config, _ = compose_config(
            {"actor_rollout_ref": {"model": {"path": str(tiny_model)}, "rollout": {"seed": seed}}}
        )
        rollout = EmbeddedRollout(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model, None)
        try:
            tokens = await _sampled(rollout)
        finally:
            rollout.shutdown()
        if (seed, rank) in runs:
            assert tokens == runs[(seed, rank)]  # the same seed and rank: the same samples
        runs[(seed, rank)] = tokens
    assert len({str(t) for t in runs.values()}) == 3, {k: v[0][:4] for k, v in runs.items()}
    # sampled, not greedy: the requests differ among themselves
    assert len({str(t) for t in runs[(7, "0")]}) > 1
    default, _ = compose_config({"actor_rollout_ref": {"model": {"path": str(tiny_model)}}})
    assert rollout_seed(default.actor_rollout_ref.rollout) == 42 + 3  # RANK is 3 still
