"""Test and benchmark helpers: a vLLM-shaped mock backend (no model, no GPU, loopback only).

The mock is the server :mod:`.mock_vllm` (routes, injected faults, what it saw) and its parts: :mod:`.mock_tokens`
(prompt ids, the ids and log-probs it generates, tool-call arguments, a tokenizer that agrees),
:mod:`.mock_answers` (JSON bodies and SSE events) and :mod:`.mock_replay` (recorded vLLM exchanges).
"""

from .mock_replay import ReplayCase, load_replay_cases
from .mock_tokens import (
    VOCAB_SIZE,
    completion_token_ids,
    prompt_token_ids,
    render_chat,
    token_logprob,
    tool_arguments,
)
from .mock_vllm import DEFAULT_MODEL, MockVLLM, SeenRequest

__all__ = [
    "DEFAULT_MODEL",
    "VOCAB_SIZE",
    "MockVLLM",
    "ReplayCase",
    "SeenRequest",
    "completion_token_ids",
    "load_replay_cases",
    "prompt_token_ids",
    "render_chat",
    "token_logprob",
    "tool_arguments",
]
