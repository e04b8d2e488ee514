"""An OpenAI-compatible, vLLM-shaped inference server over a Hugging Face causal LM, for CPUs and tests.

:class:`InferenceServer` answers the routes agents and the proxy use, shaped exactly like vLLM's answers with
``"return_token_ids": true`` (recorded examples: ``tests/fixtures/vllm/``):

- ``POST /v1/chat/completions`` — top-level ``prompt_token_ids``, ``choices[i].token_ids``; streamed, a first
  chunk per choice with an empty ``role`` delta and ``prompt_token_ids``, then one chunk per token with that
  token's ``token_ids`` (``n > 1`` interleaves by ``index``), ``stream_options.include_usage``, ``[DONE]``.
  The prompt may come as token ids in ``kv_transfer_params.prompt_token_ids`` (vLLM 0.32's one-request
  token-in: no template, the ids are the prompt; ``messages`` and ``tools`` still drive validation, parsing,
  constrained decoding and the answer; :mod:`aglverl.engine.requests`).
- ``POST /v1/completions`` — a text prompt, a token-id prompt, or a list of either; ``prompt_token_ids`` inside
  each choice (streamed: in each choice's first chunk).
- vLLM's scale-out routes (render / generate from ids / derender, :mod:`aglverl.engine.scale_out`).
- ``GET /v1/models``, ``GET /health`` (JSON: weight version, sleep state, counters), ``GET /metrics``.

Token ids are sent only when the request says ``return_token_ids: true`` (the fields are ``null``
otherwise), as vLLM does. A sequence that ends on EOS keeps the EOS id in ``token_ids`` (and its log-prob) but
not in the text; a stop string truncates the text, the ids keep the token that completed it. Log-probs are
``log_softmax(logits / temperature)`` of the sampled token, what verl's actor recomputes (see
:mod:`aglverl.engine.generation`). Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, wrong types or values (``param`` names the field) and requests longer than the context, 404 for
an unknown model (vLLM's message).

Generation: a continuous-batching engine on its own thread (:class:`aglverl.engine.generation.Engine`);
concurrent requests and the ``n`` choices of one request share forward passes. Weights are swapped between
generations by :meth:`InferenceServer.load_weights` (from any thread); :meth:`~InferenceServer.sleep` /
:meth:`~InferenceServer.wake_up` park the engine (requests wait rather than fail).

Weight version: every generation answer carries the header ``X-Weight-Version``, the version of the weights
its tokens were generated under (recorded by the engine when the sequence started, so a swap racing the
request cannot mislead it; for a stream the header goes out with the first tokens, once every choice has
started). A request body may name itself with ``request_id`` (vLLM's field); the answer's ``id`` is then
``cmpl-<request_id>`` / ``chatcmpl-<request_id>``.

Abort (verl's partial rollouts): :meth:`~InferenceServer.abort` ends every queued and running generation
at once with ``finish_reason: "abort"`` and the ids generated so far (JSON and streams alike, as vLLM's
OpenAI server does), so a client can resume from ``prompt + ids`` (each choice's text is decoded from the
prompt's last ids on, as vLLM's detokenizer is primed, so the resumed text completes a character the aborted
one ended inside: the aborted text's trailing U+FFFD are those bytes); new requests then wait for
:meth:`~InferenceServer.resume`, or with ``reject=True`` are answered at once as aborted with no tokens.

Use ``async with InferenceServer("tiny") as server:`` or ``await tg.start(server.serve)`` on an asyncio loop,
or :class:`aglverl.engine.thread.InferenceServerThread` to host it on a thread of its own (inside a process
whose loop is not ours). Constructing the server loads the model: a blocking call of a few seconds.

Where the rest lives: requests and their plans :mod:`~aglverl.engine.requests`, one request in flight
:mod:`~aglverl.engine.job`, answer bodies and stream chunks :mod:`~aglverl.engine.answers`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson
import torch
from aiohttp import web
from anyio.abc import TaskStatus
from pydantic import ValidationError

from .._net import HttpListener
from .answers import BODIES, SSE_TYPE, WEIGHT_VERSION_HEADER, stream_answer
from .chat_parser import ChatParser
from .chat_template import ChatTemplate
from .constrained import ConstraintCompiler
from .generation import Engine, GenSequence
from .job import Job
from .requests import ApiError, Plan, RequestPlanner, read_json, validation_error
from .scale_out import ScaleOutRoutes
from .tiny import TINY_NAME, quiet_progress_bars, resolve_model
from .tokens import TokenCodec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "KEEPALIVE_SECONDS",
    "SHUTDOWN_GRACE",
    "WEIGHT_VERSION_HEADER",
    "InferenceServer",
    "InferenceStats",
]

logger = logging.getLogger(__name__)

#: vLLM runs on uvicorn, whose idle keep-alive is 5 s; the proxy's pool is tuned to close before that.
KEEPALIVE_SECONDS = 5.0
#: How long stopping lets in-flight requests finish before cancelling them.
SHUTDOWN_GRACE = 1.0


# ---------------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True, slots=True)
class InferenceStats:
    """A snapshot of the server's counters (see :class:`aglverl.engine.generation.EngineStats` for the engine's)."""

    weight_version: int
    weight_loads: int
    sleeping: bool
    sleep_calls: int
    wake_up_calls: int
    requests: int
    rejected_requests: int
    #: :meth:`InferenceServer.abort` closed admission (until :meth:`InferenceServer.resume`).
    generation_paused: bool
    abort_calls: int
    #: Sequences ended by an abort, or refused while an abort rejects new requests.
    aborted_sequences: int
    pending_sequences: int
    generation_runs: int
    prefill_batches: int
    decode_steps: int
    sequences: int
    prompt_tokens: int
    generated_tokens: int
    largest_batch: int
    busy_seconds: float
    failures: int


# ---------------------------------------------------------------------------------------------- server
class InferenceServer:
    """OpenAI-compatible server over one causal LM; see the module docstring. Keyword-only after ``model``.

    - ``model``: ``"tiny"`` (the built-in model, :mod:`aglverl.engine.tiny`), a local Hugging Face directory, or an
      already loaded ``PreTrainedModel`` (then ``tokenizer`` is required). Nothing is ever downloaded.
    - ``tokenizer``: a directory or a loaded tokenizer; default: the model's directory.
    - ``served_model_name``: the name requests must use (default: ``model`` as given, like ``vllm serve``).
    - ``host``/``port``: where to listen (``127.0.0.1``; port 0 picks a free one, see :attr:`url`).
    - ``max_batch_size``: rows (choices) generated together; ``batch_wait``: how long an idle engine waits
      for concurrent requests to join the first forward pass.
    - ``max_model_len``: context length (default: the config's ``max_position_embeddings``).
    - ``weight_version``: the version of the weights loaded now. ``seed``: seeds unseeded sampling.
    - ``torch_threads``: if set, ``torch.set_num_threads`` (process-wide) at construction.
    - ``dtype``: the dtype to load the weights in (``"auto"``: the checkpoint's).
    - ``tool_parser``: how tool calls are read out of generated text: ``"hermes"`` (``<tool_call>`` JSON
      blocks, vLLM's parser of that name), ``None`` (requests with ``tools`` are refused), or ``"auto"``
      (default): ``"hermes"`` when the chat template renders ``tools`` in the Hermes / Qwen style (it mentions
      ``<tool_call>``), else ``None``. A template with no tool section always refuses ``tools`` (400).
    - ``reasoning_parser``: ``"qwen3"`` / ``"deepseek_r1"`` (``<think>...</think>`` split into ``reasoning``,
      vLLM's parsers of those names; needs the markers to be single tokens), ``None``, or ``"auto"`` (default):
      ``"qwen3"`` when the template mentions ``<think>`` and the tokenizer has the markers, else ``None``. The
      built-in tiny model gets ``hermes`` and no reasoning parser.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel = TINY_NAME,
        *,
        tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None = None,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 64,
        batch_wait: float = 0.002,
        max_model_len: int | None = None,
        weight_version: int = 0,
        seed: int | None = None,
        torch_threads: int | None = None,
        dtype: str | torch.dtype = "auto",
        max_body_bytes: int = 32 << 20,
        tool_parser: str | None = "auto",
        reasoning_parser: str | None = "auto",
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.model, self.tokenizer, self.model_path = _load(model, tokenizer, dtype)
        self.served_model_name = served_model_name or (
            str(model)
            if isinstance(model, (str, os.PathLike))
            else str(self.model.config.name_or_path or "model")
        )
        config = self.model.config
        self.vocab_size: int = int(config.vocab_size)
        self.max_model_len: int = max_model_len or int(
            getattr(config, "max_position_embeddings", None) or 2048
        )
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.codec = TokenCodec(self.tokenizer)
        eos = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.engine = Engine(
            self.model,
            eos_token_ids=eos,
            pad_token_id=pad if pad is not None else 0,
            max_batch_size=max_batch_size,
            batch_wait=batch_wait,
            seed=seed,
            weight_version=weight_version,
        )
        #: The chat template as a renderer (``/v1/chat/completions`` and ``.../render`` share it).
        self.chat_template = ChatTemplate(self.tokenizer, lambda text: self.codec.encode(text, special=False))
        vocab = self.tokenizer.get_vocab()
        self.chat_parser = ChatParser(
            tool_parser=_default_tool_parser(self.chat_template) if tool_parser == "auto" else tool_parser,
            reasoning_parser=(
                _default_reasoning_parser(self.chat_template, vocab)
                if reasoning_parser == "auto"
                else reasoning_parser
            ),
            vocab=vocab,
        )
        self.constraints = ConstraintCompiler(self.tokenizer, self.vocab_size, eos)
        #: Validates requests into plans (the chat, completions and token-in routes share it).
        self.planner = RequestPlanner(
            served_model_name=self.served_model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            codec=self.codec,
            chat_template=self.chat_template,
            chat_parser=self.chat_parser,
            constraints=self.constraints,
        )
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._weights_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._sleeping = False
        self._counts = {"sleep": 0, "wake_up": 0, "weight_loads": 0, "requests": 0, "rejected": 0, "abort": 0}
        self._http: HttpListener | None = None
        self._serving = False
        self._stack: AsyncExitStack | None = None
        self._handlers: set[asyncio.Task[Any]] = set()  # generation requests being answered

    # ------------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no ``/v1``) once serving."""
        if self._http is None:
            raise RuntimeError("the inference server is not serving")
        return self._http.url

    @property
    def weight_version(self) -> int:
        """The version of the weights served now (answers report the version they ran under)."""
        return self.engine.weight_version

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def stats(self) -> InferenceStats:
        """The counters now (readable from any thread)."""
        e = self.engine.stats
        c = self._counts
        return InferenceStats(
            weight_version=self.engine.weight_version,
            weight_loads=c["weight_loads"],
            sleeping=self._sleeping,
            sleep_calls=c["sleep"],
            wake_up_calls=c["wake_up"],
            requests=c["requests"],
            rejected_requests=c["rejected"],
            generation_paused=self.engine.paused,
            abort_calls=c["abort"],
            aborted_sequences=e.aborted_sequences,
            pending_sequences=self.engine.pending,
            generation_runs=e.generation_runs,
            prefill_batches=e.prefill_batches,
            decode_steps=e.decode_steps,
            sequences=e.sequences,
            prompt_tokens=e.prompt_tokens,
            generated_tokens=e.generated_tokens,
            largest_batch=e.largest_batch,
            busy_seconds=e.busy_seconds,
            failures=e.failures,
        )

    # ------------------------------------------------------------------ weights and sleep (any thread)
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Copy full tensors (Hugging Face parameter names) into the model; returns how many were copied.

        Blocking and thread-safe: waits for the running generation to finish (new requests wait meanwhile),
        copies between generations, never mid-batch, then serves ``version``. Tied weights may come under
        both names (``model.embed_tokens.weight`` and ``lm_head.weight``). Concurrent calls run one at a time.
        Raises ``KeyError`` for an unknown name and ``ValueError`` for a shape mismatch; tensors before the bad
        one are already copied then, and the version is not changed. Calling it on the server's own event
        loop blocks that loop: use :meth:`update_weights` there.
        """
        with self._weights_lock, self.engine.idle():
            count = 0
            with torch.no_grad():
                for name, tensor in named_tensors:
                    self._copy_param(name, tensor)
                    count += 1
            self.engine.weight_version = version  # the engine is idle: no sequence can start meanwhile
            self._counts["weight_loads"] += 1
        logger.info("loaded %d tensors, serving weight version %d", count, version)
        return count

    def _copy_param(self, name: str, tensor: torch.Tensor) -> None:
        target = self._params.get(name)
        if target is None and name.startswith("module."):
            target = self._params.get(name.removeprefix("module."))
        if target is None:
            raise KeyError(
                f"unknown parameter {name!r} (expected Hugging Face names such as {next(iter(self._params))!r})"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.data.copy_(tensor)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """:meth:`load_weights` in a worker thread; the loop keeps serving (new requests wait for the swap).

        Cancelling the await does not interrupt the copy: it is deferred until the load is complete.
        """
        return await anyio.to_thread.run_sync(self.load_weights, named_tensors, version)

    def sleep(self, level: int = 1) -> None:
        """Park the engine (vLLM's ``sleep``): blocks until the running generation finishes; thread-safe.

        On CPU there is no KV cache pool to free, so this records the state; requests that arrive meanwhile
        wait for :meth:`wake_up` instead of failing, and :meth:`load_weights` still works. ``level`` is
        accepted for vLLM compatibility. Repeated calls are counted and otherwise no-ops.
        """
        with self._state_lock:
            self._counts["sleep"] += 1
            if self._sleeping:
                return
            self.engine.hold()
            self._sleeping = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Resume generation after :meth:`sleep` (waiting requests start); thread-safe, counted, idempotent."""
        with self._state_lock:
            self._counts["wake_up"] += 1
            if not self._sleeping:
                return
            self._sleeping = False
            self.engine.release()

    def abort(self, *, reject: bool = False) -> list[str]:
        """End every queued and running generation now; returns the ids of the requests it ended (any thread).

        vLLM's ``abort_all_requests``: each ended choice answers with ``finish_reason`` ``"abort"`` and the ids
        generated so far (requests waiting at a sleeping server end too). Admission then stays closed until
        :meth:`resume`: new requests wait (``reject=False``) or are answered at once as aborted with no tokens
        (``reject=True``; each call re-declares it). Blocks for at most one decode step (the running batch is
        cut at the next step boundary), so calling it on the server's own loop stalls that loop that long.
        Request ids are the answers' ``id`` (``cmpl-...`` / ``chatcmpl-...``), in the order they were ended.
        """
        with self._state_lock:
            self._counts["abort"] += 1
        ended = self.engine.abort(reject=reject)
        return list(dict.fromkeys(seq.request_id for seq in ended))

    def resume(self) -> None:
        """Open admission after :meth:`abort` (vLLM's ``resume_generation``): waiting requests start.

        Thread-safe and idempotent; it does not wake a sleeping server (:meth:`wake_up` does).
        """
        self.engine.resume()

    @property
    def paused(self) -> bool:
        """Whether :meth:`abort` closed admission (until :meth:`resume`)."""
        return self.engine.paused

    # ------------------------------------------------------------------ in-process generation
    async def generate_ids(
        self, prompt_ids: Sequence[int], sampling: Mapping[str, Any] | None = None
    ) -> tuple[list[int], list[float] | None, str]:
        """Generate from token ids through the same batcher: ``(token_ids, logprobs or None, finish_reason)``.

        ``sampling`` takes ``temperature``, ``top_p``, ``max_tokens`` (default: the rest of the context),
        ``seed``, ``stop_token_ids``, ``ignore_eos`` and ``logprobs`` (truthy: return the log-probs); verl's
        ``top_k``/``repetition_penalty``/``min_p`` are accepted at their neutral values. Callable from any
        asyncio loop in any thread while the server is serving (results are delivered to the caller's loop).
        An :meth:`abort` ends it with ``finish_reason`` ``"abort"`` and the ids generated so far.
        Raises ``ValueError`` for bad input, ``RuntimeError`` if the server stops or generation fails; if
        the caller is cancelled the sequence is dropped from the batch.
        """
        plan = self.planner.ids(list(prompt_ids), dict(sampling or {}))
        job = self._new_job(plan)
        self._counts["requests"] += 1
        try:
            self.engine.submit([c.seq for c in job.choices])
            await job.done.wait()
        finally:
            if not job.done.is_set():
                job.cancel()
        choice = job.choices[0]
        if choice.seq.error is not None:
            raise RuntimeError(f"generation failed: {choice.seq.error}") from choice.seq.error
        ids = choice.seq.token_ids[: choice.consumed]
        logprobs = choice.seq.logprobs[: choice.consumed] if plan.logprobs else None
        return ids, logprobs, choice.finish_reason or "length"

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once connections are accepted.

        Stopping (cancellation; shielded): stop accepting, give in-flight requests ``SHUTDOWN_GRACE``
        seconds, cancel the rest (their sequences leave the batch), close every socket, then stop the engine
        thread (in-process :meth:`generate_ids` callers get ``RuntimeError``) and join it: no thread is left.
        """
        if self._serving:
            raise RuntimeError("this InferenceServer is already serving")
        self._serving = True
        loop = asyncio.get_running_loop()
        engine_gone = anyio.Event()
        self.engine.start(on_exit=lambda: call_soon(loop, engine_gone.set))
        try:
            await self._start_http()
            try:
                task_status.started()
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._stop_http()
        finally:
            with anyio.CancelScope(shield=True):
                self.engine.request_stop()
                await engine_gone.wait()
                self.engine.join()
                self._serving = False

    async def _start_http(self) -> None:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        ScaleOutRoutes(
            self.planner, answer=self._generate, new_job=self._new_job, max_body_bytes=self.max_body_bytes
        ).add_to(app)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        http = HttpListener(
            app, self.host, self.port, keepalive_timeout=KEEPALIVE_SECONDS, shutdown_timeout=SHUTDOWN_GRACE
        )
        url = await http.start()
        self._http = http
        logger.info("inference server for %r listening on %s", self.served_model_name, url)

    async def _stop_http(self) -> None:
        """Stop accepting, let handlers finish for ``SHUTDOWN_GRACE`` s, cancel the rest (their jobs abort: the
        sequences leave the batch), close connections."""
        http, self._http = self._http, None
        if http is not None:
            await http.stop(self._handlers, grace=SHUTDOWN_GRACE, cancel_wait=SHUTDOWN_GRACE)

    async def __aenter__(self) -> InferenceServer:
        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        try:
            await tg.start(self.serve)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None, "__aexit__ without __aenter__"
        return await stack.__aexit__(*exc_info)

    # ------------------------------------------------------------------ HTTP handlers
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self.planner.chat)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self.planner.completion)

    async def _generate(self, request: web.Request, planner: Callable[[Any], Plan]) -> web.StreamResponse:
        """Plan the request's body with ``planner`` (400 / 404 / 413 answers counted as rejected), then answer."""
        try:
            plan = await self.planner.with_constraints(planner(await read_json(request, self.max_body_bytes)))
        except ValidationError as exc:
            self._counts["rejected"] += 1
            return validation_error(exc).response()
        except ApiError as exc:
            self._counts["rejected"] += 1
            return exc.response()
        self._counts["requests"] += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)  # so that stopping can wait for it, then cancel it
        try:
            return await self._answer(request, plan)
        finally:
            self._handlers.discard(task)

    async def _answer(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        """Generate for ``plan``; a client that goes away (cancellation, reset) frees its batch rows."""
        job = self._new_job(plan)
        try:
            try:
                self.engine.submit([c.seq for c in job.choices])
            except RuntimeError as exc:  # stopping
                return ApiError(503, str(exc)).response()
            if plan.stream:
                return await self._stream(request, job)
            await job.done.wait()
        finally:
            if not job.done.is_set():
                job.cancel()  # the client went away or we are stopping: free the batch rows
        if job.error is not None:
            return ApiError(500, f"generation failed: {job.error}").response()
        return web.Response(
            body=orjson.dumps(BODIES[plan.kind](job)),
            content_type="application/json",
            headers={WEIGHT_VERSION_HEADER: str(job.weight_version)},
        )

    async def _stream(self, request: web.Request, job: Job) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": SSE_TYPE, "Cache-Control": "no-cache"})
        try:
            await stream_answer(request, response, job)
        except ConnectionResetError:
            pass  # the client is gone; the caller cancels the job
        return response

    def _new_job(self, plan: Plan, outputs: Sequence[GenSequence] | None = None) -> Job:
        """A job for ``plan``: new sequences for the engine, or, with ``outputs``, ones whose tokens exist."""
        return Job(
            plan,
            model=self.served_model_name,
            codec=self.codec,
            parser=self.chat_parser,
            weight_version=lambda: self.engine.weight_version,
            outputs=outputs,
        )

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "aglverl",
            "root": str(self.model_path) if self.model_path else self.served_model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return web.Response(
            body=orjson.dumps({"object": "list", "data": [card]}), content_type="application/json"
        )

    async def _health(self, request: web.Request) -> web.Response:
        stats = asdict(self.stats())
        body = {"status": "ok", "model": self.served_model_name, **stats}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = []
        for key, value in asdict(self.stats()).items():
            lines.append(f"aglverl_inference_{key} {float(value):g}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


# ---------------------------------------------------------------------------------------------- loading
def _load(
    model: str | os.PathLike[str] | PreTrainedModel,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None,
    dtype: str | torch.dtype,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path | None]:
    """The model (eval mode, no grad) and tokenizer, from local files only (``local_files_only``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path: Path | None = None
    with quiet_progress_bars():
        if isinstance(model, (str, os.PathLike)):
            path = resolve_model(model)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
            )
        elif tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: pass tokenizer=")
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or path, local_files_only=True)
    model.eval().requires_grad_(False)
    return model, tokenizer, path


def _default_tool_parser(template: ChatTemplate) -> str | None:
    """``"hermes"`` for a template that renders tools the Hermes / Qwen way, else ``None``."""
    return "hermes" if template.supports_tools and "<tool_call>" in (template.source or "") else None


def _default_reasoning_parser(template: ChatTemplate, vocab: Mapping[str, int]) -> str | None:
    """``"qwen3"`` for a template that writes ``<think>`` with a tokenizer that has the markers, else ``None``."""
    if "<think>" in (template.source or "") and "<think>" in vocab and "</think>" in vocab:
        return "qwen3"
    return None


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the generation config and the tokenizer (Qwen lists several)."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return sorted(ids)


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> None:
    """``callback`` on ``loop`` from any thread; nothing when the loop is closed (nobody waits then)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass  # the loop is closed: nobody waits
