"""Token-in chat: a call that extends a recorded turn is generated from that turn's exact ids, in one request.

A black-box agent sends its history back as text; re-rendered and re-tokenized, the history's ids drift from
the ids the engine generated, and a conversation never merges into one training row. :class:`TokenIn` keeps
the attempt's :class:`~aglverl.proxy.session.Sessions` and, for a chat call whose messages extend a recorded
turn's messages + answer (:class:`~aglverl.proxy.session.Match`), sends it as ONE chat completion carrying its
exact prompt ids, as its backend's dialect makes a call from ids (:meth:`~aglverl.proxy.dialect.Dialect.token_in`:
vLLM's ``kv_transfer_params["prompt_token_ids"]`` on the chat route): the earlier call's prompt + generated ids, the template's end of
turn where the answer stopped short of it, then the new tail's ids. The backend skips templating and
tokenization and answers with its own chat answer (its tool-call and reasoning parsers, JSON or SSE), which the
relay passes on and records like any call's (:class:`~aglverl.proxy.relay.Relay`): the recorded prompt extends
the turn's prompt + response by construction, so the conversation trains as one row. A Responses / Messages
call is a chat call by then and gets the same.

**The tail's ids.** A renderer gives them, for the tail alone (the cost does not grow with the history):

- the served model's own tokenizer and chat template in the proxy (:class:`_LocalRenderer`: the model card's
  ``root`` of the backend's listing, loaded once per model in a worker thread; renders run in a worker thread
  too, never on the event loop), checked once per rendering context against the call of the conversation the
  backend rendered itself, its messages exactly as sent (its first call, few-shot answers in it included; every
  later turn carries it, so the check is made again if the cache forgot the verdict): a template the backend
  overrides, ``--chat-template``, shows there;
- where the proxy has no tokenizer for the served model (the path is not on this machine), the backend's render
  route (:class:`_RemoteRenderer`, vLLM's with ``--enable-scale-out``): one request more per call, said once.

The tail is rendered after a tiny fixed conversation (user ``"a"``, assistant ``"b"``: the *anchor*) under the
call's tools and template arguments; the anchor's ids as the template renders them before a later turn (and its
end-of-turn id and the *glue* after it, ChatML's ``"\\n"``) are read once per rendering context from four
renders of the anchor with two answers (``"b"`` / ``"c"``), alone and followed by a turn, and kept in a cache
sized from the run (twice the attempts with a session, at least :data:`TEMPLATES_KEPT` per renderer, least
recently used out). An answer that ended on one of the model's stop tokens (the template's end of turn, or
another: the engine's ``stop_reason``, or an EOS id of the model's tokenizer and generation config) is not
given a second end of turn. A template whose anchor renders otherwise
before this tail is read by rendering the tail after both answers and keeping their common suffix.

**True to the template.** Appending is checked once per rendering context and conversation shape
(:func:`~aglverl.proxy.session.conversation_shape`): the template must render the whole conversation as the
rendering of the turn's messages, the answer, the end of turn and glue, then exactly the tail's ids. A template
that does not (Mistral's v0.3 puts the tool list and the system prompt on the LAST user turn) gets such calls
from the whole render instead: relayed as text (the backend renders them as a plain call; a new training row),
counted ``not_append_only``, one warning naming the template. The earlier answers themselves stay as the
engine generated them (reasoning a template would drop included: the model sees at inference what the trainer
will train on).

Falling back: until the answer starts, the call is relayed as text instead (the proxy's ordinary path, a new
chain), counted by cause in ``aglverl_proxy_token_in_total{outcome}``: ``no_backend`` (neither a tokenizer nor
the render route, or a backend that does not take prompt ids: detected once per backend and warned about once,
naming what is missing), ``render_error``, ``anchor_mismatch`` (a template whose anchor cannot be read),
``template_mismatch`` (the proxy's template disagrees with the backend's and there is no render route),
``not_append_only``, ``refused`` (the backend refused the call made from ids with a 4xx); ``ids_ignored``
counts a call the backend generated from its own rendering instead of the ids (recorded as it was generated;
the backend is then relayed as text). A call sent with ids counts ``generated``, and the calls never matched
count their :data:`~aglverl.proxy.session.MISSES` cause. Aborted generations (weight updates), holds, sampling
reconciliation, versions and ``per_call`` are the relay's and the resumer's, as for any call.

Its interface, as the proxy uses it: :meth:`TokenIn.admit` (synchronous: read a recorded chat call against its
attempt's session), :meth:`TokenIn.run` (send a matched call with its prompt ids and answer the agent through
the relay; ``None``: relay it as text), :meth:`TokenIn.forget` (the rollouts the store forgets); the recorder
remembers each recorded turn in the same :class:`~aglverl.proxy.session.Sessions`. It holds the config, the
pool (picking, the backends' facts, the upstream session), the relay, the meters and the sessions; it keeps per
backend its renderers and whether it takes prompt ids, and per model its tokenizer. Cancellation (the agent
left, shutdown) cancels a render in flight (a worker thread finishes its render and is discarded).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import orjson

from ..engine.chat_template import ChatTemplate, ChatTemplateError
from .call import JSON, Call, ProxyError, Unreachable, error_message
from .config import ProxyConfig
from .meters import Meters
from .pool import Backend, Pool, read_bounded
from .relay import Refused, Relay
from .session import MISSES, Match, Plan, Sessions, Turn, conversation_shape
from .upstream import UpstreamError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: How a call ended up: generated from ids, or relayed as text for one of these reasons.
OUTCOMES: tuple[str, ...] = (
    "generated",
    *MISSES,
    "no_backend",
    "render_error",
    "anchor_mismatch",
    "template_mismatch",
    "not_append_only",
    "refused",
    "ids_ignored",
)
#: The anchor: a conversation ending with an assistant turn, in two variants that differ in one token, and a
#: turn to follow it.
ANCHOR_USER: Mapping[str, str] = {"role": "user", "content": "a"}
ANCHOR_ANSWERS = ("b", "c")
ANCHOR_NEXT: Mapping[str, str] = {"role": "user", "content": "z"}
#: Rendering contexts whose anchor and shapes a renderer keeps at least (least recently used out past this and
#: twice the attempts with a session: sized from the run).
TEMPLATES_KEPT = 256
#: Conversation shapes a rendering context keeps the append-only verdict of.
SHAPES_KEPT = 64
#: Request fields the template renders with (the rendering context).
_TEMPLATE_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents")


class _Fallback(Exception):
    """Relay the call as text instead; nothing of it has reached the agent. ``outcome`` says why."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _answer(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


class _Anchor:
    """The anchor as one renderer renders it under one rendering context."""

    __slots__ = ("eot", "glue", "prefix")

    def __init__(self, eot: int, glue: list[int], prefix: list[int] | None) -> None:
        self.eot = eot  # the template's end of turn after an assistant's content
        self.glue = glue  # what the template puts between an end of turn and the next turn
        # The anchor's ids followed by a later turn, through the end of turn and the glue (None: not readable)
        self.prefix = prefix


class _Template:
    """What one renderer knows of one rendering context: its anchor, whether the anchor renders as a prefix
    before a tail, the append-only verdict per conversation shape, and (a local renderer) whether it agrees
    with the backend."""

    __slots__ = ("agrees", "anchor", "prefix_holds", "shapes")

    def __init__(self) -> None:
        self.anchor: _Anchor | None = None
        self.prefix_holds = True
        self.shapes: OrderedDict[bytes, bool] = OrderedDict()
        self.agrees: bool | None = None

    def verdict(self, shape: bytes) -> bool | None:
        return self.shapes.get(shape)

    def judge(self, shape: bytes, holds: bool) -> None:
        self.shapes[shape] = holds
        if len(self.shapes) > SHAPES_KEPT:
            self.shapes.popitem(last=False)


class _Templates:
    """A renderer's rendering contexts, least recently used out past what the run needs: twice the attempts with
    a session (``live()``), and at least :data:`TEMPLATES_KEPT` (a context's verdicts cost four renders and more
    to read again, and a run with as many tool lists as conversations must not read them on every call)."""

    __slots__ = ("_kept", "_live")

    def __init__(self, live: Any = None) -> None:
        self._kept: OrderedDict[bytes, _Template] = OrderedDict()
        self._live: Callable[[], int] = live or (lambda: 0)

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, context: bytes) -> _Template:
        template = self._kept.get(context)
        if template is None:
            template = self._kept[context] = _Template()
            if len(self._kept) > TEMPLATES_KEPT and len(self._kept) > 2 * self._live():
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(context)
        return template


def _template_fields(request: Mapping[str, Any]) -> dict[str, Any]:
    return {key: request[key] for key in _TEMPLATE_FIELDS if request.get(key) is not None}


class _Renderer(Protocol):
    """What renders conversations into ids under a call's rendering context (see the module docstring)."""

    #: Whether it renders in the proxy (the model's tokenizer) rather than on the backend.
    local: bool
    #: The model's stop ids it knows of (EOS ids of its tokenizer and generation config).
    stop_ids: frozenset[int]
    #: What it renders with, for warnings (a tokenizer's path, a backend's route).
    source: str
    templates: _Templates

    async def render(
        self, request: Mapping[str, Any], conversations: Sequence[tuple[Sequence[Any], bool]]
    ) -> list[list[int]]: ...


class _LocalRenderer:
    """The served model's tokenizer and chat template in the proxy; every render runs in a worker thread."""

    local = True

    def __init__(
        self,
        source: str,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: frozenset[int] = frozenset(),
        kept: Any = None,
    ) -> None:
        self.source = source
        fast = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: no Python wrapper per call
        encode = None if fast is None else (lambda text: fast.encode(text, add_special_tokens=False).ids)
        self.template = ChatTemplate(tokenizer, encode)
        self.templates = _Templates(kept)
        self.stop_ids = stop_ids

    async def render(
        self, request: Mapping[str, Any], conversations: Sequence[tuple[Sequence[Any], bool]]
    ) -> list[list[int]]:
        """The ids of each ``(messages, generation prompt)`` under the call's rendering context, in one worker
        thread hop; :class:`_Fallback` (``render_error``) for what the template refuses."""
        fields = _template_fields(request)
        try:
            return await anyio.to_thread.run_sync(self._render_all, fields, conversations)
        except ChatTemplateError as exc:
            logger.debug("the chat template of %s refused a render: %s", self.source, exc)
            raise _Fallback("render_error") from None

    def _render_all(
        self, fields: Mapping[str, Any], conversations: Sequence[tuple[Sequence[Any], bool]]
    ) -> list[list[int]]:
        kwargs = dict(fields.get("chat_template_kwargs") or {})
        for key in ("chat_template", "documents"):  # the template's own arguments, as vLLM passes them
            if key in fields:
                kwargs[key] = fields[key]
        tools = fields.get("tools")
        return [
            self.template.render(
                messages, tools=tools, add_generation_prompt=gen, chat_template_kwargs=kwargs
            )
            for messages, gen in conversations
        ]


class _RemoteRenderer:
    """The backend's render route (a proxy without the model's tokenizer): one request per render."""

    local = False
    #: The render route tells no stop ids: the engine's ``stop_reason`` and the template's end of turn do.
    stop_ids: frozenset[int] = frozenset()

    def __init__(self, pool: Pool, config: ProxyConfig, backend: Backend, kept: Any = None) -> None:
        self.pool = pool
        self.config = config
        self.backend = backend
        self.source = f"{backend.url}{backend.dialect.render_target}"
        self.templates = _Templates(kept)
        #: Whether the route is served (``None``: not asked yet).
        self.served: bool | None = None
        #: The refusal that said it is not (status, message), for the warning.
        self.refusal: tuple[int, str] = (0, "")

    async def render(
        self, request: Mapping[str, Any], conversations: Sequence[tuple[Sequence[Any], bool]]
    ) -> list[list[int]]:
        """The ids of each ``(messages, generation prompt)``, rendered concurrently by the backend;
        :class:`_Fallback` (``no_backend`` when the route is not served, else ``render_error``)."""
        results: list[list[int]] = [[] for _ in conversations]
        failure: _Fallback | None = None

        async def one(i: int, messages: Sequence[Any], gen: bool) -> None:
            nonlocal failure
            try:
                results[i] = await self._render(request, messages, gen)
            except _Fallback as exc:
                failure = failure or exc

        async with anyio.create_task_group() as tg:
            for i, (messages, gen) in enumerate(conversations):
                tg.start_soon(one, i, messages, gen)
        if failure is not None:
            raise failure
        return results

    async def _render(self, request: Mapping[str, Any], messages: Sequence[Any], gen: bool) -> list[int]:
        dialect = self.backend.dialect
        headers = {"Content-Type": JSON}
        if self.config.backend_auth is not None:
            headers["Authorization"] = self.config.backend_auth
        body = dialect.render_body(request, messages, gen)
        try:
            upstream = await self.pool.upstream.request(
                "POST", self.backend.url, dialect.render_target, headers.items(), body
            )
            try:
                raw = await read_bounded(upstream, self.config.max_response_bytes, "backend render")
            finally:
                upstream.close()
            status = upstream.status
        except (UpstreamError, OSError, TimeoutError, ProxyError) as exc:
            logger.debug("render on %s failed: %r", self.backend.url, exc)
            raise _Fallback("render_error") from None
        if status >= 400:
            if dialect.lacks_route(status, raw):
                self.served = False
                self.refusal = (status, error_message(raw, 200))
                raise _Fallback("no_backend")
            logger.debug("render on %s answered %d: %s", self.backend.url, status, error_message(raw))
            raise _Fallback("render_error")
        try:
            ids = dialect.rendered_ids(orjson.loads(raw))
        except orjson.JSONDecodeError:
            ids = None
        if ids is None:
            raise _Fallback("render_error")
        self.served = True
        return ids


def _load_tokenizer(source: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer at ``source`` (a model directory, or a hub id already in the local cache); ``None`` when
    this machine has neither. Never downloads. Blocking: called in a worker thread."""
    path = Path(source)
    if not path.is_dir():
        if path.is_absolute() or source.count("/") != 1:
            return None
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "tokenizer_config.json"), str):
            return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        logger.debug("no tokenizer at %s: %r", source, exc)
        return None


def _stop_ids(source: str, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The model's EOS ids: its tokenizer's, and its generation config's (Qwen2.5 lists ``<|im_end|>`` and
    ``<|endoftext|>``, Llama 3.1 ``<|eom_id|>`` beside ``<|eot_id|>``), what an engine stops on. Blocking."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        generation = GenerationConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        generation = None
    for value in (getattr(generation, "eos_token_id", None), tokenizer.eos_token_id):
        if type(value) is int:
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if type(v) is int)
    return frozenset(ids)


def _load_renderer(source: str, live: Any) -> _LocalRenderer | None:
    """The local renderer of the model at ``source`` (``None``: no tokenizer, or one without a chat template).
    Blocking: called in a worker thread."""
    tokenizer = _load_tokenizer(source)
    if tokenizer is None:
        return None
    renderer = _LocalRenderer(source, tokenizer, _stop_ids(source, tokenizer), live)
    return renderer if renderer.template.source is not None else None


class _Tokenizers:
    """The served models' tokenizers, loaded once per source (in a worker thread) and shared by backends."""

    def __init__(self, live: Callable[[], int]) -> None:
        self._renderers: dict[str, _LocalRenderer | None] = {}
        self._loading: dict[str, anyio.Event] = {}
        self._live = (
            live  # how many conversations the run holds (what a renderer's template cache is sized by)
        )

    async def renderer(self, source: str | None) -> _LocalRenderer | None:
        if source is None:
            return None
        while source not in self._renderers:
            loading = self._loading.get(source)
            if loading is not None:
                await loading.wait()
                continue
            loading = self._loading[source] = anyio.Event()
            try:
                self._renderers[source] = await anyio.to_thread.run_sync(_load_renderer, source, self._live)
            finally:
                del self._loading[source]
                loading.set()
        return self._renderers[source]


class _BackendState:
    """What the token-in part knows of one backend."""

    __slots__ = ("local", "prompt_ids", "remote", "resolved", "resolving")

    def __init__(self, remote: _RemoteRenderer) -> None:
        self.local: _LocalRenderer | None = None
        self.remote = remote
        self.resolved = False  # its tokenizer was looked for
        self.resolving: anyio.Event | None = None
        self.prompt_ids: bool | None = None  # whether it generates chat calls from prompt ids (None: unknown)


class TokenIn:
    """Token-in chat for a proxy (see the module docstring): sessions, and calls sent with their prompt ids.

    The proxy calls :meth:`admit` for every attributed chat call once it is read, :meth:`run` to make a
    matched call (``None``: relay it as text) and :meth:`forget` for rollouts the store forgets; the recorder
    remembers each recorded call's turn in :attr:`sessions`.
    """

    def __init__(
        self, config: ProxyConfig, pool: Pool, relay: Relay, meters: Meters, sessions: Sessions
    ) -> None:
        self.config = config
        self.pool = pool
        self.relay = relay
        self.meters = meters
        #: The attempts' recorded turns (the recorder remembers a turn once its call is recorded).
        self.sessions = sessions
        self._backends: dict[str, _BackendState] = {}
        self._tokenizers = _Tokenizers(self._live)
        self._warned: set[tuple[str, str]] = set()
        self.m_calls = meters.registry.counter(
            "aglverl_proxy_token_in_total",
            "Recorded chat calls by how they were made: sent with the session's ids (generated), or relayed "
            "as text for the reason named.",
            ["outcome"],
        )

    # ------------------------------------------------------------------ the session
    def admit(self, call: Call) -> None:
        """Read a recorded chat call against its attempt's session; count it now unless it matched."""
        assert call.rollout_id is not None and call.attempt_id is not None and call.request is not None
        pending, match, miss = self.sessions.consider(call.rollout_id, call.attempt_id, call.request)
        call.tokenin = Plan(pending, match)
        if call.capture is not None and pending is not None:
            call.capture.answers = True
        if miss is not None:
            self.m_calls.inc(1, miss)

    def forget(self, rollout_ids: Sequence[str]) -> None:
        self.sessions.forget(rollout_ids)

    def _live(self) -> int:
        """The attempts with a session: the run's conversations, what the template caches are sized by."""
        return len(self.sessions)

    def templates_kept(self) -> int:
        """Rendering contexts the renderers keep (each bounded by :data:`TEMPLATES_KEPT`)."""
        renderers = {id(r): r for s in self._backends.values() for r in (s.local, s.remote) if r is not None}
        return sum(len(r.templates) for r in renderers.values())

    # ------------------------------------------------------------------ making a call from ids
    async def run(self, call: Call) -> bool:
        """Send a matched call with its prompt ids through the relay and answer the agent; ``False`` when it
        must be relayed as text instead (nothing has reached the agent). Raises :class:`ProxyError` for a call
        that failed before its answer started; cancellation closes the call's upstream requests."""
        plan = call.tokenin
        assert plan is not None and plan.match is not None and call.request is not None
        backend = self.pool.pick(call.rollout_id, ())
        if backend is None:
            return False  # the relay answers 503
        state = self._state(backend)
        try:
            if state.prompt_ids is False:
                raise _Fallback("no_backend")
            prompt = await self._prompt(backend, state, call, plan.match)
        except _Fallback as exc:
            self.m_calls.inc(1, exc.outcome)
            return False
        target = call.target
        call.prompt_ids = plan.prompt = prompt
        call.wire = None  # spelled anew, as the dialect sends a call made from ids (Call.prepare)
        outcome = "generated"
        try:
            await self.relay.attempts(call, refusals=True)
            return True
        except Refused as exc:
            outcome = "refused"
            message = error_message(exc.body)
            if call.dialect.refuses_prompt_ids(exc.status, message):
                self._no_prompt_ids(backend, state, f"it refused them: {exc.status}: {message}")
            logger.debug("backend %s refused a call made from ids: %s", call.backend, exc)
            call.prompt_ids = plan.prompt = call.wire = None  # relayed as text from the start
            call.target, call.reshape = target, None
            call.capture = call.dialect.capture("chat", answers=True)
            return False
        finally:
            used = call.capture.prompt_ids if call.capture is not None else None
            if outcome == "generated" and used is not None and used != prompt:
                outcome = "ids_ignored"
                self._no_prompt_ids(backend, state, "it generated from its own rendering of the messages")
            self.m_calls.inc(1, outcome)

    def _state(self, backend: Backend) -> _BackendState:
        state = self._backends.get(backend.url)
        if state is None:
            remote = _RemoteRenderer(self.pool, self.config, backend, self._live)
            state = self._backends[backend.url] = _BackendState(remote)
        return state

    def _warn_once(self, key: tuple[str, str], message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def _no_prompt_ids(self, backend: Backend, state: _BackendState, why: str) -> None:
        state.prompt_ids = False
        self._warn_once(
            ("prompt_ids", backend.url),
            "backend %s does not generate chat calls from prompt ids (%s): its multi-turn calls are relayed as "
            "text from now on, and each one whose history the chat template re-renders differently from the "
            "generated ids starts a new training row; token-in needs %s",
            backend.url,
            why,
            backend.dialect.advice.get("prompt_ids", "a backend that takes prompt ids"),
        )

    # ------------------------------------------------------------------ renderers
    async def _renderer(self, backend: Backend, state: _BackendState, model: str | None) -> _Renderer:
        """The backend's renderer: the model's tokenizer in the proxy once found, else the render route;
        :class:`_Fallback` (``no_backend``) when it has neither. The tokenizer is looked for once (a listing
        that did not answer is read again at the next call, the render route meanwhile)."""
        if not state.resolved:
            if state.resolving is not None:
                await state.resolving.wait()
            else:
                resolving = state.resolving = anyio.Event()
                try:
                    await self._resolve(backend, state, model)
                finally:
                    state.resolving = None
                    resolving.set()
        if state.local is not None:
            return state.local
        if state.remote.served is False:
            raise _Fallback("no_backend")
        return state.remote

    async def _resolve(self, backend: Backend, state: _BackendState, model: str | None) -> None:
        """Look for the served model's tokenizer where the backend's listing says it is (once)."""
        try:
            facts = await self.pool.facts(backend)
        except Unreachable as exc:
            logger.debug("GET %s on %s failed: %s", backend.dialect.models_path, backend.url, exc)
            return  # asked again next call; the render route meanwhile
        source = facts.dialect.tokenizer_source(facts.cards, model)
        state.local = await self._tokenizers.renderer(source)
        state.resolved = True
        if state.local is None:
            self._warn_once(
                ("tokenizer", backend.url),
                "no tokenizer for model %r of backend %s on this machine (its listing names %r): each later "
                "turn of a conversation first asks the backend to render its tail (%s), one request more per "
                "call",
                model,
                backend.url,
                source,
                facts.dialect.render_target,
            )

    def _no_renderer(self, backend: Backend, state: _BackendState) -> None:
        status, message = state.remote.refusal
        self._warn_once(
            ("render", backend.url),
            "backend %s has no token-in chat: the proxy has no tokenizer for its model and %s answered %d "
            "(%s); token-in needs the model's tokenizer on this machine or %s. Until then its multi-turn calls "
            "are relayed as text, and each one whose history the chat template re-renders differently from "
            "the generated ids starts a new training row",
            backend.url,
            backend.dialect.render_target,
            status,
            message,
            backend.dialect.advice.get("render", "a render route"),
        )

    # ------------------------------------------------------------------ the prompt
    async def _prompt(self, backend: Backend, state: _BackendState, call: Call, match: Match) -> list[int]:
        """The call's exact prompt: the turn's prompt + response, the end of turn a stop short of it left out,
        the glue, the tail's ids; :class:`_Fallback` when it cannot be made true to the template."""
        request = call.request
        assert request is not None
        try:
            renderer = await self._renderer(backend, state, call.model)
            template = renderer.templates.get(match.turn.context)
            if isinstance(renderer, _LocalRenderer) and template.agrees is not True:
                renderer, template = await self._checked(backend, state, renderer, template, request, match)
            anchor = await self._anchor(renderer, template, request)
            rest = await self._rest(renderer, template, anchor, request, match.tail)
            await self._appends(renderer, template, anchor, request, match, rest)
        except _Fallback as exc:
            if exc.outcome == "no_backend" and state.local is None:
                self._no_renderer(backend, state)
            raise
        turn = match.turn
        return [*turn.prompt, *turn.response, *self._end_of_turn(turn, renderer, anchor), *rest]

    @staticmethod
    def _end_of_turn(turn: Turn, renderer: _Renderer, anchor: _Anchor) -> list[int]:
        """What closes the turn's answer before the glue: nothing when the answer ended on the template's end of
        turn or on another of the model's stop tokens (the engine's ``stop_reason``, or the model's EOS ids as
        its tokenizer and generation config name them: Qwen2.5's ``<|endoftext|>``, Llama 3.1's
        ``<|eom_id|>``), which the engine kept as generated and which end the turn as well; else the template's
        end of turn (an answer cut at its limit, or stopped by a stop string)."""
        last = turn.response[-1:]
        if last == [anchor.eot] or turn.stop or (last and last[0] in renderer.stop_ids):
            return []
        return [anchor.eot]

    async def _checked(
        self,
        backend: Backend,
        state: _BackendState,
        renderer: _LocalRenderer,
        template: _Template,
        request: Mapping[str, Any],
        match: Match,
    ) -> tuple[_Renderer, _Template]:
        """The local renderer when it agrees with the backend under this rendering context (checked once,
        against a turn the backend rendered itself), else the backend's render route; :class:`_Fallback`
        (``template_mismatch``) when the backend has none."""
        # The witness: the conversation's call the backend rendered itself, its messages exactly as they were
        # sent (a few-shot answer in them included), and the ids the backend made of them. Every turn of a
        # conversation carries it, so the check is made whenever the verdict is not known (a first look at
        # this rendering context, or one the cache forgot).
        witness = match.turn.witness
        if template.agrees is None and witness is not None:
            [ids] = await renderer.render(request, [(witness.messages, True)])
            template.agrees = ids == witness.prompt
            if not template.agrees:
                self._warn_once(
                    ("template", renderer.source),
                    "the chat template of %s renders a conversation otherwise than backend %s does (its "
                    "--chat-template, or template arguments it adds): the tails of such calls are rendered by "
                    "the backend (%s) instead",
                    renderer.source,
                    backend.url,
                    backend.dialect.render_target,
                )
        if template.agrees is not False:
            return renderer, template
        if state.remote.served is False:
            raise _Fallback("template_mismatch")
        return state.remote, state.remote.templates.get(match.turn.context)

    async def _anchor(self, renderer: _Renderer, template: _Template, request: Mapping[str, Any]) -> _Anchor:
        """The anchor under this rendering context (read once, from four renders)."""
        if template.anchor is not None:
            return template.anchor
        b, c = (_answer(text) for text in ANCHOR_ANSWERS)
        user, after = dict(ANCHOR_USER), dict(ANCHOR_NEXT)
        conversations = [([user, b], False), ([user, c], False), ([user, b, after], False), ([user, c, after], False)]  # fmt: skip
        alone_b, alone_c, next_b, next_c = await renderer.render(request, conversations)
        n = _common_suffix(alone_b, alone_c)
        if n == 0 or n >= min(len(alone_b), len(alone_c)):
            self._warn_once(
                ("anchor", renderer.source),
                "the chat template of %s renders an assistant's answer with no end-of-turn id after it: its "
                "multi-turn calls are relayed as text",
                renderer.source,
            )
            raise _Fallback("anchor_mismatch")
        eot, glue = alone_b[-n], alone_b[len(alone_b) - n + 1 :]
        m = _common_suffix(next_b, next_c)
        at = len(next_b) - m  # where the ids after the answer start
        readable = 0 < m < min(len(next_b), len(next_c)) and next_b[at : at + 1 + len(glue)] == [eot, *glue]
        template.anchor = _Anchor(eot, glue, next_b[: at + 1 + len(glue)] if readable else None)
        return template.anchor

    async def _rest(
        self,
        renderer: _Renderer,
        template: _Template,
        anchor: _Anchor,
        request: Mapping[str, Any],
        tail: Sequence[Any],
    ) -> list[int]:
        """The ids after the end of turn: the glue, then the tail rendered with the generation prompt."""
        b, c = (_answer(text) for text in ANCHOR_ANSWERS)
        first = [dict(ANCHOR_USER), b, *tail]
        if anchor.prefix is not None and template.prefix_holds:
            [ids] = await renderer.render(request, [(first, True)])
            if ids[: len(anchor.prefix)] == anchor.prefix:
                return anchor.glue + ids[len(anchor.prefix) :]
            template.prefix_holds = False  # this template renders the anchor otherwise before such tails
        ids, other = await renderer.render(request, [(first, True), ([dict(ANCHOR_USER), c, *tail], True)])
        n = _common_suffix(ids, other)
        if n == 0 or n >= min(len(ids), len(other)) or ids[-n] != anchor.eot:
            raise _Fallback("anchor_mismatch")
        return ids[len(ids) - n + 1 :]

    async def _appends(
        self,
        renderer: _Renderer,
        template: _Template,
        anchor: _Anchor,
        request: Mapping[str, Any],
        match: Match,
        rest: list[int],
    ) -> None:
        """Whether the template renders this shape of conversation append-only (judged once per shape):
        the whole conversation as the turn's messages rendered, the answer, the end of turn, then ``rest``.
        :class:`_Fallback` (``not_append_only``) when it does not."""
        messages = request["messages"]
        shape = conversation_shape(messages, match)
        holds = template.verdict(shape)
        if holds is None:
            conversations = [(messages[: match.history], False), (messages, True)]
            history, whole = await renderer.render(request, conversations)
            end = [anchor.eot, *rest]
            holds = (
                len(history) + len(end) <= len(whole)
                and whole[: len(history)] == history
                and whole[len(whole) - len(end) :] == end
            )
            template.judge(shape, holds)
            if not holds:
                self._warn_once(
                    ("append", renderer.source),
                    "the chat template of %s does not render a conversation as its earlier turn followed by the "
                    "new messages (it moves or repeats parts when the conversation grows: a system prompt or a "
                    "tool list on the last user turn); calls of such conversations (shape %s) are generated "
                    "from the whole conversation as the template renders it (relayed as text, a new training "
                    "row each)",
                    renderer.source,
                    shape.decode(),
                )
        if not holds:
            raise _Fallback("not_append_only")
