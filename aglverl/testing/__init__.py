"""Test and benchmark helpers: a vLLM-shaped mock backend (no model, no GPU, loopback only)."""

from .mock_vllm import (
    DEFAULT_MODEL,
    VOCAB_SIZE,
    MockVLLM,
    ReplayCase,
    SeenRequest,
    completion_token_ids,
    load_replay_cases,
    prompt_token_ids,
    render_chat,
    token_logprob,
    tool_arguments,
)

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
