"""Agent Lightning 0.2/0.3's trace adapter (``Trainer(adapter=...)``) on aglverl: which of an attempt's recorded
calls train.

``agl.VERL`` trains the triplets its adapter (``TracerTraceToTriplet``) makes of a rollout's spans, and the
adapter's settings choose them: ``agent_match`` (a regular expression searched in the name of the agent around
each LLM call: openai-agents' ``agent.name``, an AgentOps ``@agent``'s operation name, AutoGen's
``recipient_agent_type``, a LangGraph node's ``langchain.chain.type``, agent-framework's ``executor.id``, ...),
``llm_call_match`` (the LLM call spans' names), ``exclude_llm_call_in_reward``, ``repair_hierarchy``. aglverl
trains the calls its proxy recorded (the exact ids the engine saw), so an adapter can only choose among them:
:func:`call_selector` reads the Trainer's adapter when ``fit`` starts, and a :class:`CallSelector` runs the
adapter's own ``adapt`` over an ended rollout's spans and names the calls it kept.

The tie is exact: Agent Lightning's OpenAI instrumentation (AgentOps') writes the id of the answer the agent got
(``gen_ai.response.id``) on each LLM call span, and aglverl's proxy records the same id with the call
(``LLMCall.response_id``: the backend's ``chatcmpl-...`` passed on unchanged, or a translated API's
``resp_...``); the ids are the engine's unique request ids. The adapter keeps a call by its span, the span names
the call's id, and the result names those ids (:data:`~aglverl.models.TRAINED_CALLS_KEY`): the attempt's other
calls are recorded and counted (``batch/n_calls_unselected``), not trained. A kept span without a response id
cannot be tied to a call: it is counted (:attr:`Selection.untied`) and trains nothing.

Without ``agent_match`` and with the default ``llm_call_match`` nothing is chosen: every recorded call trains,
whatever the spans (aglverl does not depend on them). Settings that choose nothing are honoured by nature:
``reward_match`` (the reward is the rollout's final one), ``_skip_empty_token_spans`` (calls without ids never
train). An adapter that is not a ``TracerTraceToTriplet`` (or one that overrides how it adapts) cannot be
honoured: a :class:`~aglverl.config_errors.ConfigError` naming it; Agent Lightning's ``LlmProxyTraceToTriplet``
(the LLM proxy's spans, every call) is aglverl's default already.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentlightning.adapter import LlmProxyTraceToTriplet, TracerTraceToTriplet

from ..config_errors import ConfigError

__all__ = ["DEFAULT_LLM_CALL_MATCH", "CallSelector", "Selection", "call_selector"]

#: ``TracerTraceToTriplet``'s own default ``llm_call_match`` (the OpenAI instrumentation's chat spans).
DEFAULT_LLM_CALL_MATCH = r"openai\.chat\.completion"


@dataclass(frozen=True, slots=True)
class Selection:
    """What the adapter kept of one rollout's trace: the response ids of the calls that train, the agents they
    belong to, and the kept LLM spans that name no response id (``untied``: no call of theirs can train)."""

    trained: frozenset[str]
    agents: frozenset[str]
    untied: int


class CallSelector:
    """The adapter's choice of calls (see the module docstring); :meth:`select` is pure CPU work over a trace
    (run it in a worker thread: a trace of hundreds of spans takes milliseconds)."""

    def __init__(self, adapter: TracerTraceToTriplet) -> None:
        #: The user's settings, in an adapter of aglverl's own (``_skip_empty_token_spans`` off: spans carry no
        #: token ids under aglverl, the proxy records them).
        self.adapter = TracerTraceToTriplet(
            repair_hierarchy=adapter.repair_hierarchy,
            llm_call_match=adapter.llm_call_match,
            agent_match=adapter.agent_match,
            exclude_llm_call_in_reward=adapter.exclude_llm_call_in_reward,
            reward_match=adapter.reward_match,
        )

    def describe(self) -> str:
        """The settings that choose calls, as the user wrote them."""
        return f"agent_match={self.adapter.agent_match!r}, llm_call_match={self.adapter.llm_call_match!r}"

    def select(self, spans: Sequence[Any]) -> Selection:
        """The calls the adapter keeps of one rollout's spans (none kept of an empty trace)."""
        if not spans:
            return Selection(frozenset(), frozenset(), 0)
        triplets = self.adapter.adapt(list(spans))
        ids = [t.metadata.get("response_id") for t in triplets]
        return Selection(
            trained=frozenset(i for i in ids if isinstance(i, str)),
            agents=frozenset(str(t.metadata.get("agent_name")) for t in triplets),
            untied=sum(not isinstance(i, str) for i in ids),
        )


def call_selector(adapter: Any) -> CallSelector | None:
    """The selector for the Trainer's ``adapter``, or ``None`` when it chooses nothing (every call trains).
    Raises :class:`~aglverl.config_errors.ConfigError` naming an adapter, or a setting, that cannot be
    honoured."""
    if adapter is None or type(adapter) is LlmProxyTraceToTriplet:
        return None
    name = type(adapter).__name__
    if not isinstance(adapter, TracerTraceToTriplet) or type(adapter).adapt is not TracerTraceToTriplet.adapt:
        raise ConfigError(
            f"Trainer(adapter={name}(...)) cannot be honoured: aglverl trains the token ids its proxy recorded "
            "for each call, not triplets an adapter builds, and chooses calls only as Agent Lightning's "
            "TracerTraceToTriplet does (agent_match, llm_call_match); pass adapter={'agent_match': ...} or "
            "a TracerTraceToTriplet"
        )
    for key in ("agent_match", "llm_call_match"):
        value = getattr(adapter, key)
        if value is None:
            continue
        try:
            re.compile(value)
        except (re.error, TypeError) as exc:
            raise ConfigError(
                f"Trainer(adapter=...).{key} must be a regular expression, got {value!r} ({exc})"
            ) from None
    if adapter.agent_match is None and adapter.llm_call_match == DEFAULT_LLM_CALL_MATCH:
        return None
    return CallSelector(adapter)
