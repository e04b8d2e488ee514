"""The generation engine behind :mod:`aglverl.engine.server`: continuous batching over a Hugging Face causal LM.

One dedicated thread (``aglverl-generate``) owns the model while it generates. Sequences (one per choice of
a request) are submitted from any thread; the engine thread

1. sleeps on a condition variable while there is nothing to do (no polling);
2. on the first arrival waits at most ``batch_wait`` seconds (a deadline, cut short once ``max_batch_size``
   sequences are pending) so that concurrent requests share their first forward pass;
3. prefills the admitted prompts as one left-padded batch (each distinct prompt once: the ``n`` choices of a
   request share its prefill) and merges their KV cache into the running batch;
4. decodes one token per step for every running sequence with per-sequence temperature, top-p, seed, stop
   tokens and length limit; finished or aborted sequences leave the batch at once (their rows are removed
   from the KV cache, so they stop costing compute) and sequences that arrived meanwhile join at the next
   step boundary.

Results go back to the thread that asked, on its event loop: the engine appends to the sequence's own lists
and calls ``loop.call_soon_threadsafe`` once per step and loop with the sequences that have news (every step
for streamed sequences, only the last one for the others).

Weight swaps and sleep happen between generations, never mid-batch: :meth:`Engine.idle` stops admission,
waits (on the condition) for the running sequences to finish, and keeps the engine idle while its block runs.
Every sequence records the weight version it was admitted under (:attr:`Engine.weight_version`, changed only
while the engine is idle), so a whole sequence is generated under the version it reports.

Abort (:meth:`Engine.abort`, vLLM's ``pause_generation`` without waiting for in-flight requests): queued
sequences end at once and running ones at the next step boundary, with ``finish_reason`` ``"abort"`` and the
tokens generated so far; admission stays closed until :meth:`Engine.resume` (new sequences wait, or with
``reject`` end at once as aborted with no tokens).

Log-probabilities: for every sampled token the engine reports ``log_softmax(logits / temperature)`` at that
token (``temperature`` 0, i.e. greedy, counts as 1). That is exactly what verl's actor recomputes for the
same sequence (it divides the logits by the rollout temperature and takes ``log_softmax``), so on-policy the
behaviour/trainer log-prob mismatch is numerical noise. Top-p truncation is not reflected in the reported
log-probs, as in verl's recomputation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .constrained import TokenConstraint

__all__ = ["Engine", "EngineStats", "GenSequence", "SamplingParams", "sample_next"]

logger = logging.getLogger(__name__)

#: Name of the engine's thread (tests check that none is left behind).
THREAD_NAME = "aglverl-generate"


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one sequence is sampled. ``temperature`` 0 is greedy; ``seed`` makes sampling reproducible.

    ``max_tokens`` counts generated tokens (the EOS or stop token included). ``stop_token_ids`` end a sequence
    like EOS does (the token is kept); ``ignore_eos`` generates through EOS. ``top_logprobs``: how many
    alternatives to record per token besides the sampled one.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0
    #: Record each sampled token's rank (1 = most likely) in ``GenSequence.ranks`` (the generate endpoint's).
    ranks: bool = False


class GenSequence:
    """One sequence to generate: written by the engine thread, read by its owner on the owner's loop.

    The engine only ever appends to ``token_ids``/``logprobs``/``top_logprobs`` and sets the finish fields
    before its final notification, so an owner that reads slices up to the length it was notified about sees
    a consistent prefix. ``cancelled`` is the owner's way to say "stop, nobody is listening" (a client went
    away, a stop string matched): the engine drops the sequence at the next step without notifying again.
    ``request_id`` names the owner's request (reported by :meth:`Engine.abort`); ``weight_version`` is set by
    the engine when the sequence is admitted (``None`` while it waits, or if it ended before admission).
    ``constraint`` (a :class:`aglverl.engine.constrained.TokenConstraint`) restricts each step's tokens to a grammar:
    the forbidden logits are set to ``-inf`` before sampling, so the recorded log-probs are those of the masked
    distribution (which verl's actor does not see: such tokens are slightly off-policy). A token the grammar
    rejects after all (a bug, not bad input) fails the sequence.
    """

    __slots__ = (
        "cancelled",
        "constraint",
        "error",
        "finish_reason",
        "finished",
        "incremental",
        "logprobs",
        "loop",
        "notify",
        "params",
        "prompt",
        "ranks",
        "request_id",
        "rng",
        "stop_reason",
        "token_ids",
        "top_logprobs",
        "weight_version",
    )

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        loop: asyncio.AbstractEventLoop,
        notify: Callable[[GenSequence, int], None],
        incremental: bool = False,
        choice: int = 0,
        request_id: str = "",
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.prompt = prompt
        #: The grammar this sequence's tokens must follow (:mod:`aglverl.engine.constrained`), or ``None``.
        self.constraint = constraint
        self.request_id = request_id
        self.params = params
        #: Where ``notify(seq, n_tokens)`` is called (``call_soon_threadsafe``).
        self.loop = loop
        self.notify = notify
        #: Notify after every token (streams, stop strings) rather than only at the end.
        self.incremental = incremental
        #: Seeded sequences own their random stream, so their draws do not depend on the batch; choice ``j``
        #: of a seeded request gets its own stream (choice 0 the seed's, same as with ``n=1``).
        self.rng: random.Random | None = None
        if params.seed is not None:
            self.rng = random.Random(params.seed if choice == 0 else f"{params.seed}/{choice}")
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.ranks: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.weight_version: int | None = None


@dataclass(slots=True)
class EngineStats:
    """Counters kept by the engine thread (plain ints; a snapshot read elsewhere may be one step stale)."""

    #: Busy periods: the engine went from idle to generating and back.
    generation_runs: int = 0
    #: Batched prefill forward passes (each admits a group of sequences into the running batch).
    prefill_batches: int = 0
    #: Batched decode forward passes.
    decode_steps: int = 0
    sequences: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    #: Sequences ended by :meth:`Engine.abort` or refused while it rejects.
    aborted_sequences: int = 0
    largest_batch: int = 0
    #: Seconds spent in forward passes and sampling (the rest of a run is waiting for work).
    busy_seconds: float = 0.0
    failures: int = 0


# ---------------------------------------------------------------------------------------------- sampling
def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-prob, from ``[B, V]`` logits and per-row parameters.

    ``temperature`` ``[B]`` (greedy rows carry 1.0), ``top_p`` ``[B]`` or ``None`` when no row truncates,
    ``greedy`` ``[B]`` bool, ``uniforms`` ``[B]`` in ``[0, 1)``. Sampling is by inverse CDF on the given
    uniforms, so a row's draw depends only on its own random stream. Returns ``(tokens [B], logprobs [B, V])``
    where the log-probs are ``log_softmax(logits / temperature)`` (see the module docstring).
    """
    logp = torch.log_softmax(logits / temperature.unsqueeze(1), dim=-1)
    probs = logp.exp()
    if top_p is not None:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # A token is kept while the mass before it is below top_p: the most likely token always survives.
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p.unsqueeze(1), 0.0)
        cdf = sorted_p.cumsum(-1)
        pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True)
        sampled = order.gather(1, pick.clamp_(max=logits.shape[-1] - 1)).squeeze(1)
    else:
        cdf = probs.cumsum(-1)
        pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True)
        sampled = pick.clamp_(max=logits.shape[-1] - 1).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp


# ---------------------------------------------------------------------------------------------- KV cache
def _kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _set_kv(cache: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        layer.keys, layer.values = k, v


def _left_pad(t: torch.Tensor, dim: int, amount: int) -> torch.Tensor:
    if amount == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [amount, 0]
    return F.pad(t, pad)


class _Batch:
    """The running batch: its sequences and the tensors aligned with them (row ``i`` is ``seqs[i]``).

    Rows are right-aligned (left padding), so the KV length is the longest row's length; ``mask`` marks real
    positions, ``positions`` holds each row's next position id, ``last`` the token each row feeds next.
    """

    def __init__(
        self, seqs: list[GenSequence], cache: Any, mask: torch.Tensor, positions: torch.Tensor
    ) -> None:
        self.seqs = seqs
        self.cache = cache
        self.mask = mask
        self.positions = positions
        self.last = torch.zeros(len(seqs), 1, dtype=torch.long)
        self._params: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int] | None = None

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in order); drop KV columns no remaining row uses."""
        if len(rows) == len(self.seqs):
            return
        self._params = None
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            return
        index = torch.tensor(rows)
        mask = self.mask.index_select(0, index)
        used = mask.any(0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self.mask = mask[:, start:]
        kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in _kv(self.cache)
        ]
        _set_kv(self.cache, kv)
        self.positions = self.positions.index_select(0, index)
        self.last = self.last.index_select(0, index)

    def merge(self, other: _Batch) -> None:
        """Append ``other``'s rows, left-padding whichever side is shorter so both stay right-aligned."""
        if not other.seqs:
            return  # every newcomer finished at its first token; its tensors are stale
        self._params = None
        if not self.seqs:
            self.seqs, self.cache, self.mask = other.seqs, other.cache, other.mask
            self.positions, self.last = other.positions, other.last
            return
        mine, theirs = self.mask.shape[1], other.mask.shape[1]
        width = max(mine, theirs)
        self.mask = torch.cat(
            [_left_pad(self.mask, 1, width - mine), _left_pad(other.mask, 1, width - theirs)]
        )
        kv = [
            (
                torch.cat([_left_pad(k1, 2, width - mine), _left_pad(k2, 2, width - theirs)]),
                torch.cat([_left_pad(v1, 2, width - mine), _left_pad(v2, 2, width - theirs)]),
            )
            for (k1, v1), (k2, v2) in zip(_kv(self.cache), _kv(other.cache), strict=True)
        ]
        _set_kv(self.cache, kv)
        self.seqs = self.seqs + other.seqs
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])

    def params(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
        """``(temperature, top_p or None, greedy, most top_logprobs)`` per row, rebuilt when rows change."""
        if self._params is None:
            ps = [s.params for s in self.seqs]
            greedy = torch.tensor([p.temperature == 0 for p in ps])
            temperature = torch.tensor([p.temperature or 1.0 for p in ps], dtype=torch.float32)
            top_p = torch.tensor([p.top_p for p in ps]) if any(p.top_p < 1 for p in ps) else None
            self._params = (temperature, top_p, greedy, max(p.top_logprobs for p in ps))
        return self._params


# ---------------------------------------------------------------------------------------------- engine
class Engine:
    """Continuous-batching generation over ``model`` on a dedicated thread; see the module docstring.

    ``eos_token_ids`` end a sequence (unless its ``ignore_eos``). ``max_batch_size`` bounds the running batch;
    ``batch_wait`` is how long an idle engine waits for company once work arrives. ``seed`` seeds the random
    streams of unseeded sequences (``None``: from the OS). ``weight_version`` is the version of the weights
    the model holds; its owner changes it only inside :meth:`idle` (sequences record it when admitted).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int = 0,
        max_batch_size: int = 64,
        batch_wait: float = 0.002,
        seed: int | None = None,
        weight_version: int = 0,
    ) -> None:
        self.model = model
        self.weight_version = weight_version
        self.eos = frozenset(eos_token_ids)
        self.pad = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait
        self.stats = EngineStats()
        self._seeds = random.Random(seed)
        self._cond = threading.Condition()
        self._pending: deque[GenSequence] = deque()
        self._holds = 0  # parties (weight loads, sleep, the abort gate) that need the engine idle
        self._busy = False
        self._gate_closed = False  # closed by abort(), opened by resume(); holds the engine while closed
        self._rejecting = False  # while the gate is closed: end new sequences at once instead of queueing
        self._cut = False  # the engine thread is to end every running sequence at its next step boundary
        self._last_cut: list[GenSequence] = []  # what the last cut ended (read by abort() once idle)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._mask_executor: Any = None  # llguidance's parallel mask executor, made on the first constraint

    # ------------------------------------------------------------------ control (any thread)
    def start(self, on_exit: Callable[[], None] | None = None) -> None:
        """Start the engine thread; ``on_exit`` is called from it as its very last action."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._stopping = False
        self._thread = threading.Thread(target=self._main, args=(on_exit,), name=THREAD_NAME, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the engine thread to finish: the running step completes, every sequence then fails."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (after :meth:`request_stop`)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopping

    def submit(self, seqs: Sequence[GenSequence]) -> None:
        """Queue sequences (any thread). Raises ``RuntimeError`` when the engine is not running.

        While :meth:`abort` rejects, the sequences end at once (``finish_reason`` ``"abort"``, no tokens; their
        owners are notified as usual); while its gate is merely closed they wait for :meth:`resume`.
        """
        with self._cond:
            if self._thread is None or self._stopping:
                raise RuntimeError("the inference engine is not running")
            if self._rejecting:
                self._end_aborted(seqs)
                return
            self._pending.extend(seqs)
            self._cond.notify_all()

    def abort(self, *, reject: bool = False) -> list[GenSequence]:
        """End every queued and running sequence now and close admission until :meth:`resume` (any thread).

        Queued sequences (also those waiting at a held, e.g. sleeping, engine) end at once; running ones at the
        engine's next step boundary; each keeps the tokens generated so far and gets ``finish_reason``
        ``"abort"``. Sequences submitted afterwards wait for :meth:`resume`, or with ``reject`` end at once as
        aborted with no tokens (each call re-declares ``reject``, as vLLM's ``abort_all_requests`` does).
        Blocks until the running batch has been cut (at most one decode step), so the engine is idle when it
        returns. Returns the sequences it ended (owner-cancelled ones excluded). Idempotent apart from that.
        """
        with self._cond:
            if not self._gate_closed:
                self._gate_closed = True
                self._holds += 1
            self._rejecting = reject
            queued = [s for s in self._pending if not s.cancelled]
            self._pending.clear()
            self._end_aborted(queued)
            running: list[GenSequence] = []
            if self._busy:
                self._last_cut, self._cut = [], True
                self._cond.notify_all()
                while self._busy:
                    self._cond.wait()
                running = self._last_cut
            return queued + running

    def resume(self) -> None:
        """Open admission again after :meth:`abort` (any thread): waiting sequences start; idempotent."""
        with self._cond:
            self._rejecting = False
            if self._gate_closed:
                self._gate_closed = False
                self._holds -= 1
                self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """Whether :meth:`abort` closed admission (until :meth:`resume`)."""
        return self._gate_closed

    @contextmanager
    def idle(self) -> Iterator[None]:
        """Hold the engine idle for the block: no admission, the running batch drains first (blocking wait)."""
        with self._cond:
            self._holds += 1
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def hold(self) -> None:
        """Like entering :meth:`idle` without a block: stays held until :meth:`release` (used by sleep)."""
        with self._cond:
            self._holds += 1
            while self._busy:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._holds -= 1
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ engine thread
    def _main(self, on_exit: Callable[[], None] | None) -> None:
        try:
            with torch.inference_mode():
                self._warm_up()
                while (first := self._wait_for_work()) is not None:
                    self._run(first)
        finally:
            with self._cond:
                left = list(self._pending)
                self._pending.clear()
            self._fail(left, RuntimeError("the inference server stopped"))
            if on_exit is not None:
                on_exit()

    def _warm_up(self) -> None:
        """One tiny prefill + decode, so the first request does not pay torch's first-call set-up (~0.5 s)."""
        from transformers import DynamicCache

        ids = torch.full((1, 2), self.pad, dtype=torch.long)
        mask = torch.ones_like(ids)
        cache = DynamicCache()
        self.model(
            input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        mask = torch.ones(1, 3, dtype=torch.long)
        self.model(
            input_ids=ids[:, :1], attention_mask=mask, position_ids=torch.tensor([[2]]), past_key_values=cache
        )

    def _wait_for_work(self) -> list[GenSequence] | None:
        """Block until sequences may start, gather company for up to ``batch_wait``; ``None`` on stop."""
        with self._cond:
            while True:
                while not self._stopping and (self._holds or not self._pending):
                    self._cond.wait()
                if self._stopping:
                    return None
                deadline = time.monotonic() + self.batch_wait
                while len(self._pending) < self.max_batch_size and not self._stopping and not self._holds:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._stopping:
                    return None
                if not self._holds:
                    self._busy = True
                    self.stats.generation_runs += 1
                    return self._take(self.max_batch_size)

    def _take(self, room: int) -> list[GenSequence]:
        """Up to ``room`` live pending sequences (caller holds the condition)."""
        out: list[GenSequence] = []
        while self._pending and len(out) < room:
            seq = self._pending.popleft()
            if not seq.cancelled:
                out.append(seq)
        return out

    def _run(self, first: list[GenSequence]) -> None:
        """Generate until no sequence is left, admitting newcomers at step boundaries."""
        batch = _Batch([], None, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        admit = first
        try:
            while True:
                started = time.perf_counter()
                if batch.seqs:
                    self._decode(batch)
                if admit:
                    self._admit(batch, admit)
                self.stats.busy_seconds += time.perf_counter() - started
                admit = self._next_admission(batch)
                if not batch.seqs and not admit:
                    return
        except _Stopped:
            self._fail(batch.seqs + admit, RuntimeError("the inference server stopped"))
        except Exception as exc:
            logger.exception("generation failed; failing %d sequences", len(batch.seqs) + len(admit))
            self.stats.failures += 1
            self._fail(batch.seqs + admit, exc)
        finally:
            with self._cond:
                self._busy = False
                self._cut = False
                self._cond.notify_all()

    def _next_admission(self, batch: _Batch) -> list[GenSequence]:
        with self._cond:
            if self._stopping:
                raise _Stopped
            if self._cut:
                self._cut = False
                self._last_cut = [s for s in batch.seqs if not s.cancelled]
                self._end_aborted(self._last_cut)
                batch.keep([])
            if self._holds or not self._pending:
                return []
            return self._take(self.max_batch_size - len(batch.seqs))

    def _admit(self, batch: _Batch, seqs: list[GenSequence]) -> None:
        """Prefill ``seqs`` (each distinct prompt once), sample their first token, merge the live ones."""
        prompts, rows = _distinct_prompts(seqs)
        cache, mask, logits = self._prefill(prompts)
        if rows != list(range(len(prompts))):  # n choices of a prompt: copy its row n times
            index = torch.tensor(rows)
            _set_kv(cache, [(k.index_select(0, index), v.index_select(0, index)) for k, v in _kv(cache)])
            mask, logits = mask[index], logits[index]
        for seq in seqs:  # before _advance notifies anyone; the version cannot change while we are busy
            seq.weight_version = self.weight_version
        new = _Batch(list(seqs), cache, mask, mask.sum(-1) - 1)  # _advance moves it to the sampled token's
        self.stats.prefill_batches += 1
        self.stats.sequences += len(seqs)
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        new.keep(self._advance(new, logits))
        batch.merge(new)
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch.seqs))

    def _prefill(self, prompts: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One left-padded forward over ``prompts``: ``(KV cache, attention mask, last-position logits)``."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache, mask, out.logits[:, -1].float()

    def _decode(self, batch: _Batch) -> None:
        """One decode step for every running row; finished rows leave the batch."""
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.seqs), 1)], dim=1)
        out = self.model(
            input_ids=batch.last,
            attention_mask=batch.mask,
            position_ids=batch.positions.unsqueeze(1),
            past_key_values=batch.cache,
            use_cache=True,
        )
        self.stats.decode_steps += 1
        batch.keep(self._advance(batch, out.logits[:, -1].float()))

    def _advance(self, batch: _Batch, logits: torch.Tensor) -> list[int]:
        """Sample one token per row, record it, notify owners; returns the rows that go on."""
        seqs = batch.seqs
        temperature, top_p, greedy, top_k = batch.params()
        rngs = [s.rng or self._seeded(s) for s in seqs]
        uniforms = torch.tensor([r.random() for r in rngs], dtype=torch.float32)
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None and s.constraint.active]
        if constrained:
            self._mask(logits, constrained, seqs)
        tokens, logp = sample_next(logits, temperature, top_p, greedy, uniforms)
        chosen_t = logp.gather(1, tokens.unsqueeze(1))
        chosen = chosen_t.squeeze(1).tolist()
        tops = logp.topk(top_k, dim=-1) if top_k else None
        ranks = (logp > chosen_t).sum(-1).add_(1).tolist() if any(s.params.ranks for s in seqs) else None
        token_list = tokens.tolist()
        batch.last = tokens.unsqueeze(1)
        batch.positions = batch.positions + 1
        self.stats.generated_tokens += len(seqs)
        keep: list[int] = []
        news: dict[asyncio.AbstractEventLoop, list[tuple[GenSequence, int]]] = {}
        for i, seq in enumerate(seqs):
            if seq.cancelled:
                continue
            token = token_list[i]
            seq.token_ids.append(token)
            seq.logprobs.append(chosen[i])
            if seq.constraint is not None and not seq.constraint.consume(token):
                seq.error = RuntimeError(f"the constraint rejected token {token}: {seq.constraint.error}")
                seq.finished = True
                news.setdefault(seq.loop, []).append((seq, len(seq.token_ids)))
                continue
            if ranks is not None and seq.params.ranks:
                seq.ranks.append(ranks[i])
            if seq.params.top_logprobs and tops is not None:
                k = seq.params.top_logprobs
                seq.top_logprobs.append(
                    list(zip(tops.indices[i, :k].tolist(), tops.values[i, :k].tolist(), strict=True))
                )
            if self._finish(seq, token):
                news.setdefault(seq.loop, []).append((seq, len(seq.token_ids)))
            else:
                keep.append(i)
                if seq.incremental:
                    news.setdefault(seq.loop, []).append((seq, len(seq.token_ids)))
        for loop, items in news.items():
            _post(loop, items)
        return keep

    def _mask(self, logits: torch.Tensor, rows: list[int], seqs: Sequence[GenSequence]) -> None:
        """Apply the constrained rows' grammars to ``logits`` (one parallel bitmask fill for all of them)."""
        from .constrained import apply_constraints, new_executor

        if self._mask_executor is None:
            self._mask_executor = new_executor()
        constraints = [seqs[i].constraint for i in rows]
        apply_constraints(logits, rows, constraints, self._mask_executor)  # type: ignore[arg-type]

    def _end_aborted(self, seqs: Sequence[GenSequence]) -> None:
        """Finish ``seqs`` with ``"abort"`` (tokens so far kept) and notify their owners; caller holds the lock."""
        news: dict[asyncio.AbstractEventLoop, list[tuple[GenSequence, int]]] = {}
        for seq in seqs:
            seq.finish_reason, seq.finished = "abort", True
            news.setdefault(seq.loop, []).append((seq, len(seq.token_ids)))
        self.stats.aborted_sequences += len(seqs)
        for loop, items in news.items():
            _post(loop, items)

    def _seeded(self, seq: GenSequence) -> random.Random:
        seq.rng = random.Random(self._seeds.getrandbits(64))
        return seq.rng

    def _finish(self, seq: GenSequence, token: int) -> bool:
        """Set the finish fields if ``token`` ends ``seq``; the token itself is kept (as vLLM does)."""
        p = seq.params
        if token in self.eos and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif len(seq.token_ids) >= p.max_tokens:
            seq.finish_reason = "length"
        else:
            return False
        seq.finished = True
        return True

    def _fail(self, seqs: Sequence[GenSequence], error: BaseException) -> None:
        news: dict[asyncio.AbstractEventLoop, list[tuple[GenSequence, int]]] = {}
        for seq in seqs:
            if not seq.finished:
                seq.error, seq.finished = error, True
                news.setdefault(seq.loop, []).append((seq, len(seq.token_ids)))
        for loop, items in news.items():
            _post(loop, items)


def _distinct_prompts(seqs: Sequence[GenSequence]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts of ``seqs`` and, per sequence, the index of its prompt in that list.

    The ``n`` choices of a request share one prompt list object, so identity is the test (cheap, exact).
    """
    index: dict[int, int] = {}
    prompts: list[list[int]] = []
    rows = []
    for seq in seqs:
        key = id(seq.prompt)
        if key not in index:
            index[key] = len(prompts)
            prompts.append(seq.prompt)
        rows.append(index[key])
    return prompts, rows


class _Stopped(Exception):
    """Raised inside a run when the engine is asked to stop: the run's sequences then fail."""


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[GenSequence, int]]) -> None:
    try:
        loop.call_soon_threadsafe(_dispatch, items)
    except RuntimeError:
        pass  # the owner's loop is closed: nobody is waiting any more


def _dispatch(items: list[tuple[GenSequence, int]]) -> None:
    for seq, count in items:
        seq.notify(seq, count)
