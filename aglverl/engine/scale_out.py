"""vLLM's scale-out token-in routes on the embedded server: render, generate from ids, derender.

- ``POST /v1/chat/completions/render`` — a chat request as vLLM's ``GenerateRequest`` (prompt ids, sampling
  parameters, the structural tag of a forced tool call), nothing generated;
- ``POST /inference/v1/generate`` — token ids in, token ids, log-probs and weight versions out (JSON or SSE);
- ``POST /v1/chat/completions/derender`` — generated ids to the chat answer ``/v1/chat/completions`` would have
  given for them (JSON), or one streamed chunk of it with the caller-threaded state.

The wire models are :mod:`aglverl.engine.token_routes`'; requests are planned by the server's
:class:`~aglverl.engine.requests.RequestPlanner` and answered through the server's own generation path, so a
render + generate + derender gives what one chat call gives. (vLLM 0.32 offers the same in one request, chat
with ``kv_transfer_params.prompt_token_ids``, which the chat route takes too.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from .answers import chat_body, chat_chunk
from .chat_parser import ToolRequest
from .generation import GenSequence, SamplingParams
from .job import Job
from .requests import (
    MAX_TOP_LOGPROBS,
    ApiError,
    ChatRequest,
    GenerationRequest,
    Plan,
    RequestPlanner,
    read_json,
    reasoning_closed,
    validation_error,
)
from .token_routes import (
    NEUTRAL_SAMPLING,
    DerenderRequest,
    GenerateRequest,
    derender_state,
    render_sampling_params,
)

__all__ = ["ScaleOutRoutes"]


class ScaleOutRoutes:
    """The handlers of the three routes (see the module docstring); :meth:`add_to` registers them.

    ``answer`` is the server's generation handler (plan, generate, answer JSON or SSE); ``new_job`` makes a
    job of a plan whose tokens exist already (a derender replays them, nothing is generated).
    """

    def __init__(
        self,
        planner: RequestPlanner,
        *,
        answer: Callable[[web.Request, Callable[[Any], Plan]], Awaitable[web.StreamResponse]],
        new_job: Callable[[Plan, Sequence[GenSequence]], Job],
        max_body_bytes: int,
    ) -> None:
        self.planner = planner
        self.answer = answer
        self.new_job = new_job
        self.max_body_bytes = max_body_bytes

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions/render", self.render)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/v1/chat/completions/derender", self.derender)

    async def render(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/render``: the chat request as vLLM's ``GenerateRequest`` (no generation)."""
        try:
            body = await read_json(request, self.max_body_bytes)
            plan = self.planner.chat(body)
            req = ChatRequest.model_validate(body)
            if plan.structured_outputs is not None:  # the constraint must compile: fail here, not at generate
                await self.planner.with_constraints(dataclasses.replace(plan, n=1))
        except ValidationError as exc:
            return validation_error(exc).response()
        except ApiError as exc:
            return exc.response()
        params = plan.params
        think = self.planner.chat_parser.think_ids
        answer = {
            "request_id": f"chatcmpl-{req.request_id or secrets.token_hex(8)}",
            "token_ids": plan.prompts[0],
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            "sampling_params": render_sampling_params(
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_tokens,
                seed=params.seed,
                stop=plan.stops,
                stop_token_ids=params.stop_token_ids,
                logprobs=params.top_logprobs if plan.logprobs else None,
                ignore_eos=params.ignore_eos,
                skip_special_tokens=plan.skip_special,
                structured_outputs=plan.structured_outputs,
            ),
            "model": req.model,
            "reasoning_ended": reasoning_closed(think, plan.prompts[0]) if think is not None else None,
            "reasoning_parser_kwargs": (
                {"chat_template_kwargs": dict(req.chat_template_kwargs or {})} if think is not None else None
            ),
            "return_token_ids": None,
            "output_mode": "tokens",
            "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
            "cache_salt": None,
            "priority": 0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _plan_generate(self, body: Any) -> Plan:
        req = GenerateRequest.model_validate(body)
        self.planner.check_model(req.model)
        if req.output_mode != "tokens":
            raise ApiError(400, "field 'output_mode': only 'tokens' is supported", "output_mode")
        sp = dict(req.sampling_params)
        for key, neutral in NEUTRAL_SAMPLING.items():
            if sp.get(key) not in neutral:
                raise ApiError(
                    400,
                    f"field 'sampling_params.{key}': only its neutral value is supported here",
                    "sampling_params",
                )
        if sp.get("n", 1) not in (1, None):
            raise ApiError(400, "field 'sampling_params.n': only 1 is supported", "sampling_params")
        fields = ("temperature", "top_p", "max_tokens", "stop", "stop_token_ids", "seed", "ignore_eos")
        shaped = {k: sp[k] for k in fields if sp.get(k) is not None}
        if isinstance(shaped.get("temperature"), int):
            shaped["temperature"] = float(shaped["temperature"])
        if isinstance(shaped.get("top_p"), int):
            shaped["top_p"] = float(shaped["top_p"])
        inner = GenerationRequest.model_validate(
            {**shaped, "stream": req.stream, "request_id": req.request_id}
        )
        logprobs = sp.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ApiError(
                400,
                f"field 'sampling_params.logprobs': an integer in [0, {MAX_TOP_LOGPROBS}]",
                "sampling_params",
            )
        self.planner.check_prompt_ids(req.token_ids, "token_ids")
        params = self.planner.sampling(inner, [req.token_ids], inner.max_tokens, logprobs or 0)
        params = dataclasses.replace(params, ranks=logprobs is not None)
        plan = self.planner.plan("generate", inner, [req.token_ids], params, logprobs is not None)
        structured = sp.get("structured_outputs")
        gate_parse = ToolRequest(thinking=True) if req.reasoning_ended is False else None
        return dataclasses.replace(
            plan,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            structured_outputs=structured if isinstance(structured, dict) else None,
            parse=gate_parse,
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /inference/v1/generate``: token ids in, token ids (log-probs, versions) out; JSON or SSE."""
        return await self.answer(request, self._plan_generate)

    async def derender(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/derender``: generated ids to the chat answer ``/v1/chat/completions``
        would have given for them (JSON), or one streamed chunk of it with the caller-threaded state."""
        try:
            req = DerenderRequest.model_validate(await read_json(request, self.max_body_bytes))
            self.planner.check_model(req.model)
            answer = self._derender_stream(req) if req.stream else self._derender_whole(req)
        except ValidationError as exc:
            return validation_error(exc).response()
        except ApiError as exc:
            return exc.response()
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _derender_plan(self, req: DerenderRequest, prompt: list[int], n: int, logprobs: bool) -> Plan:
        chat = dict(req.chat_request or {"messages": [{"role": "user", "content": ""}]})
        chat.setdefault("messages", [{"role": "user", "content": ""}])
        creq = ChatRequest.model_validate(chat)
        parse = ToolRequest.from_request(chat)
        uses_parser = self.planner.chat_parser.reasoning_parser is not None or (
            self.planner.chat_parser.tool_parser is not None
            and parse.has_tools
            and parse.tool_choice != "none"
        )
        stops = (creq.stop,) if isinstance(creq.stop, str) else tuple(creq.stop or ())
        params = SamplingParams(max_tokens=self.planner.max_model_len, top_logprobs=creq.top_logprobs or 0)
        return Plan(
            kind="chat",
            prompts=[prompt],
            n=n,
            params=params,
            stops=tuple(x for x in stops if x),
            stream=bool(req.stream),
            include_usage=False,
            with_ids=creq.return_token_ids is True,
            logprobs=logprobs,
            parse=parse if uses_parser else None,
            skip_special=not uses_parser,
        )

    def _replayed(self, plan: Plan, prompt: list[int], choice: Any, *, final: bool) -> GenSequence:
        """A finished (or, streaming, growing) sequence holding a generate answer's ids, for a derender."""
        seq = GenSequence(
            prompt,
            plan.params,
            loop=asyncio.get_running_loop(),
            notify=lambda s, n: None,
            incremental=plan.stream or bool(plan.stops),
            choice=choice.index,
        )
        ids = list(choice.token_ids or [])
        if any(t < 0 or t >= self.planner.vocab_size for t in ids):
            raise ApiError(
                400, f"field 'token_ids': ids must be in [0, {self.planner.vocab_size})", "generate_response"
            )
        seq.token_ids.extend(ids)
        content = (choice.logprobs or {}).get("content") or []
        seq.logprobs.extend(float(e.get("logprob", 0.0)) for e in content[: len(ids)])
        seq.logprobs.extend([0.0] * (len(ids) - len(seq.logprobs)))
        if final and choice.finish_reason is not None and not isinstance(choice.stop_reason, str):
            seq.finished, seq.finish_reason = True, choice.finish_reason
            seq.stop_reason = choice.stop_reason if isinstance(choice.stop_reason, int) else None
        return seq

    def _derender_whole(self, req: DerenderRequest) -> dict[str, Any]:
        gen = req.generate_response
        if gen is None or not gen.choices:
            raise ApiError(
                400,
                "field 'generate_response': a generate answer with choices is required",
                "generate_response",
            )
        prompt = list(req.prompt_token_ids or gen.prompt_token_ids or [])
        logprobs = any(c.logprobs is not None for c in gen.choices)
        plan = self._derender_plan(req, prompt, len(gen.choices), logprobs)
        seqs = [self._replayed(plan, prompt, c, final=True) for c in gen.choices]
        job = self.new_job(plan, seqs)
        for choice in job.choices:
            choice.take(len(choice.seq.token_ids))
            if choice.finish_reason is None:  # a stop string given as stop_reason that the text does not hold
                choice.finish_reason = gen.choices[choice.index].finish_reason
        job.id = gen.request_id
        body = chat_body(job)
        completion = sum(len(c.token_ids or []) for c in gen.choices)
        prompt_tokens = req.prompt_tokens or 0
        body["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion}
        body["usage"] |= {
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        body["prompt_token_ids"] = None
        return body

    def _derender_stream(self, req: DerenderRequest) -> dict[str, Any]:
        chunk_in = req.generate_chunk
        if chunk_in is None:
            raise ApiError(400, "field 'generate_chunk': required when 'stream' is true", "generate_chunk")
        if len(chunk_in.choices) > 1:
            raise ApiError(400, "field 'generate_chunk': at most one choice per chunk", "generate_chunk")
        state = req.stream_state
        if state is not None and sum(state.output_chunk_lens) != len(state.output_token_ids):
            raise ApiError(
                400, "field 'stream_state': output_chunk_lens must add up to output_token_ids", "stream_state"
            )
        prompt = list(req.prompt_token_ids or chunk_in.prompt_token_ids or [])
        choice_in = chunk_in.choices[0] if chunk_in.choices else None
        logprobs = choice_in is not None and choice_in.logprobs is not None
        plan = self._derender_plan(req, prompt, 1, logprobs)
        seq = GenSequence(
            prompt,
            plan.params,
            loop=asyncio.get_running_loop(),
            notify=lambda s, n: None,
            incremental=True,
            choice=choice_in.index if choice_in else 0,
        )
        job = self.new_job(plan, [seq])
        job.id = chunk_in.request_id
        choice = job.choices[0]
        choice.index = seq_index = choice_in.index if choice_in else 0
        old = list(state.output_token_ids) if state else []
        start = 0
        for size in state.output_chunk_lens if state else []:  # replay: the parser's state cannot travel
            seq.token_ids.extend(old[start : start + size])
            seq.logprobs.extend([0.0] * size)
            start += size
            if (d := choice.take(len(seq.token_ids))) is not None:
                choice.delta(d)
        new_ids = list(choice_in.token_ids or []) if choice_in else []
        out_chunk: dict[str, Any] = {
            "id": chunk_in.request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model or self.planner.served_model_name,
            "choices": [],
        }
        pinned = list(state.last_tool_call_ids) if state else []
        if choice_in is not None:
            replayed = self._replayed(plan, prompt, choice_in, final=True)
            seq.token_ids.extend(new_ids)
            seq.logprobs.extend(replayed.logprobs)
            seq.finished, seq.finish_reason, seq.stop_reason = (
                replayed.finished,
                replayed.finish_reason,
                replayed.stop_reason,
            )
            d = choice.take(len(seq.token_ids))
            if d is not None and choice.finish_reason is None and choice_in.finish_reason is not None:
                d.finish_reason = choice.finish_reason = choice_in.finish_reason
            chunk = chat_chunk(job, choice, d) if d is not None else None
            if chunk is None:
                chunk = {
                    "choices": [{"index": seq_index, "delta": {}, "logprobs": None, "finish_reason": None}]
                }
            out = chunk["choices"][0]
            for call in out["delta"].get("tool_calls") or []:
                if "id" in call:
                    if call["index"] < len(pinned):
                        call["id"] = pinned[call["index"]]
                    else:
                        pinned.append(call["id"])
            if not (state and state.role_sent):
                out["delta"] = {"role": "assistant", **out["delta"]}
            out_chunk["choices"] = [out]
        if chunk_in.usage is not None:
            completion = int(chunk_in.usage.get("completion_tokens") or 0)
            prompt_tokens = (
                req.prompt_tokens
                if req.prompt_tokens is not None
                else int(chunk_in.usage.get("prompt_tokens") or 0)
            )
            out_chunk["usage"] = {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion,
                "completion_tokens": completion,
            }
        streamed = choice.session.tools_streamed if choice.session else False
        new_state = derender_state(state, new_ids, tools_streamed=streamed, tool_call_ids=pinned)
        if not choice_in:
            new_state["role_sent"] = bool(state and state.role_sent)
        return {"chunk": out_chunk, "stream_state": new_state}
