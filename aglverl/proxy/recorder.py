"""The recorder: a call's capture becomes :class:`~aglverl.store.LLMCall` rows in the store, and its turn in
its attempt's token-in session.

:class:`Recorder` is what every path that answers an attributed call ends with. Its interface:

- :meth:`Recorder.capture_body` — capture a whole answer's ids (decoded once, without building its per-token
  entries); :meth:`Recorder.upstream_refused` — fail a call the backend answered with an error, noting a
  prompt refused for the context window (``limit`` ``"context"``).
- :meth:`Recorder.commit` — put the call's rows in the store (:class:`~aglverl.proxy.store_view.ProxyStore`),
  once, one per choice, as soon as the outcome is known and before the agent can see the end of its answer (an
  agent that reports its rollout done on its last byte must find its last call recorded); an answered chat
  call's turn then goes into its attempt's :class:`~aglverl.proxy.session.Sessions` (token-in). A store that
  refuses the rows (the attempt is over) is counted (``unrecorded``), nothing raised.
- :meth:`Recorder.finish` — count every call once (outcome, latencies) and, if the delivery failed after the
  commit, turn its records into failed ones (the rows are the store's objects: changed in place).

Ids that are not valid int64 ids below the store's vocabulary size are recorded as absent; a failed call's
partial output is never recorded as a response; an abort nobody resumed fails the call. Synchronous: nothing
here awaits, so nothing is cancelled half-way. Holds the store, the meters and the sessions (``None`` when
token-in is off).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from ..store import LLMCall
from .call import Call, error_message
from .meters import Meters
from .session import Sessions, Witness
from .store_view import ProxyStore

__all__ = ["Recorder"]


def _stop_limit(
    finish_reason: str | None, ids: Sequence[int] | None, max_tokens: int | None
) -> Literal["max_tokens", "context"] | None:
    """Which limit ended a response that the backend says stopped on ``"length"``, if it did.

    An engine stops on length at the request's ``max_tokens`` or at its context window; a request without
    ``max_tokens`` gets the rest of the window (vLLM's default), so stopping short of ``max_tokens`` (or with
    none asked for) means the window was full.
    """
    if finish_reason != "length":
        return None
    if max_tokens is not None and (ids is None or len(ids) >= max_tokens):
        return "max_tokens"
    return "context"


def _response_id(call: Call) -> str | None:
    """The id of the answer the agent got: its API's own (a Responses or Messages call, translated; see
    :class:`~aglverl.proxy.api.translator.AgentApi`), else the backend's chat or completion ``id``, which the
    proxy passes on unchanged."""
    own = getattr(call.translator.api, "id", None) if call.translator is not None else None
    if isinstance(own, str):
        return own
    return call.capture.response_id if call.capture is not None else None


class Recorder:
    """Records and counts calls (see the module docstring)."""

    def __init__(self, store: ProxyStore, meters: Meters, sessions: Sessions | None) -> None:
        self.store = store
        self.meters = meters
        #: The attempts' token-in sessions (``None``: token-in is off).
        self.sessions = sessions

    def capture_body(self, call: Call, status: int, body: bytes) -> bool:
        """Capture a whole answer's ids; ``False`` when nothing was captured (an error answer, a call not
        captured, a body that is not JSON: the call then fails)."""
        if status >= 400:
            self.upstream_refused(call, status, body)
            return False
        if call.capture is None:
            return False
        if not call.capture.take_body(body):
            call.fail(f"backend answered {status} with a body that is not JSON")
            return False
        return True

    @staticmethod
    def upstream_refused(call: Call, status: int, body: bytes) -> None:
        """Fail a call the backend answered with an error; note a prompt refused for the context window."""
        message = error_message(body)
        if call.dialect.context_refusal(status, message):
            call.limit = "context"
        call.fail(f"backend answered {status}: {message}", "upstream_error")

    def commit(self, call: Call) -> None:
        """Put an attributed call in the store (once), as soon as its outcome is known.

        That is before the agent can see the end of the response: an agent that reports its rollout the
        moment it has its answer must not finish the rollout before its last call is recorded.
        """
        if call.records is not None or call.rollout_id is None or call.kind is None:
            return
        assert call.attempt_id is not None
        if call.capture is not None and call.capture.aborted and call.error is None:
            # An abort the proxy could not take out (a chunked JSON answer, an event it did not recognise):
            # a partial response must not be trained on as a whole one.
            self.meters.resume_failed.inc(1, "unsupported")
            call.fail("the backend aborted the generation (finish_reason 'abort') and it was not resumed")
        call.records = self._records(call, time.monotonic() - call.t0)
        if not self.store.record_calls(call.rollout_id, call.attempt_id, call.records):
            self.meters.unrecorded.inc()
        elif call.tokenin is not None and self.sessions is not None:
            self._remember(call)

    def _remember(self, call: Call) -> None:
        """Keep a recorded call's turn in its attempt's token-in session (an answered call with one choice and
        its ids, and the answer the agent got), so that a later call extending it is generated from its ids.
        A turn whose prompt is not the ids the token-in part sent (a call relayed as text, or a backend that
        rendered the messages itself) is the backend's own rendering of its messages."""
        plan = call.tokenin
        assert plan is not None and self.sessions is not None
        if plan.pending is None or call.error is not None or not call.records or len(call.records) != 1:
            return
        record = call.records[0]
        if record.status != "ok" or record.prompt_token_ids is None or record.response_token_ids is None:
            return
        choice = call.capture.choices.get(0) if call.capture is not None else None
        if choice is not None and choice.answer is not None:
            prompt, response = record.prompt_token_ids, record.response_token_ids
            if plan.prompt is None or plan.prompt != prompt:  # the backend rendered the messages itself
                messages = (call.request or {}).get("messages")
                witness = Witness(messages, prompt) if isinstance(messages, list) else None
            else:  # made from ids: the conversation's rendered call stays its witness
                witness = plan.match.turn.witness if plan.match is not None else None
            stop = choice.finish_reason == "stop" and response[-1:] == [choice.stop_reason]
            self.sessions.remember(plan.pending, choice.answer, prompt, response, witness, stop)

    def finish(self, call: Call) -> None:
        """Count the call; record it if that has not happened, or mark its records failed if delivery failed."""
        end = time.monotonic()
        self.meters.calls.inc(1, call.outcome)
        if call.upstream_end:
            upstream = call.upstream_end - call.upstream_start
            self.meters.upstream.observe(upstream)
            self.meters.added.observe(max(0.0, (end - call.t0) - upstream))
        if call.first_byte:
            self.meters.first_byte.observe(call.first_byte - call.t0)
        if call.records is None:
            self.commit(call)
        elif call.error is not None:
            for record in call.records:  # recorded as answered, then the agent never got the answer
                if record.status == "ok":
                    record.status, record.error = "failed", call.error
                    record.response_token_ids = record.logprobs = record.finish_reason = record.limit = None

    def _records(self, call: Call, latency: float) -> list[LLMCall]:
        capture = call.capture
        ok = call.error is None
        common: dict[str, Any] = {
            "rollout_id": call.rollout_id,
            "attempt_id": call.attempt_id,
            "seq": call.seq,
            "path": call.path,
            "backend": call.backend,
            "started_at": call.started_at,
            "latency": latency,
            "status": "ok" if ok else "failed",
            "error": call.error,
            "model": (capture.model if capture is not None else None) or call.model,
            "weight_version": call.weight_version,
            "weight_version_end": (
                call.weight_version if call.weight_version_end is None else call.weight_version_end
            ),
            "sampling": call.sampling,
            "off_policy": call.off_policy,
            "response_id": _response_id(call),
        }
        vocab = self.store.vocab_size
        choices = capture.result() if capture is not None else []
        if not choices:
            prompt = capture.token_ids(capture.prompt_ids, vocab) if capture is not None else None
            if ok:
                self.meters.no_ids.inc()
            return [LLMCall(**common, prompt_token_ids=prompt, limit=call.limit)]
        records = []
        for idx, choice, ids, logprobs in choices:
            prompt = choice.prompt_ids if choice.prompt_ids is not None else capture.prompt_ids  # type: ignore[union-attr]
            # Whatever a backend sends as ids must be valid int64 ids below the vocabulary size, or it is
            # recorded as "no ids": one malformed answer must not reach (and break) a training batch.
            prompt, ids = capture.token_ids(prompt, vocab), capture.token_ids(ids, vocab)  # type: ignore[union-attr]
            if ids is None:
                logprobs = None
            if not ok:
                ids = logprobs = None  # a broken call's partial output is never passed off as a response
            elif ids is None or prompt is None:
                self.meters.no_ids.inc()
            if ids is not None:
                self.meters.generated.inc(len(ids))
            records.append(
                LLMCall(
                    **common,
                    choice_index=idx,
                    prompt_token_ids=prompt,
                    response_token_ids=ids,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason if ok else None,
                    limit=_stop_limit(choice.finish_reason, ids, call.max_tokens) if ok else call.limit,
                )
            )
        return records
