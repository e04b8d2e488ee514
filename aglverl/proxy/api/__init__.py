"""The agents' other APIs, spoken in front of any chat-completions backend: one module per API, one registry.

vLLM (and the embedded inference server) return token ids only on chat completions, so an agent call in another
API is translated into a chat completion toward the backend (the proxy then asks for ``return_token_ids`` and
records it like any chat call) and the backend's answer is translated back into the agent's API: a whole JSON
body, or an event stream translated event by event as it arrives (nothing of a stream is held back beyond the
SSE event being parsed).

- :mod:`~aglverl.proxy.api.translator` — what every API shares: the call's
  :class:`~aglverl.proxy.api.translator.Translator` (request in, answer out, the endings), the field checks
  that name the wrong field, :class:`~aglverl.proxy.api.translator.TranslationError`, and the
  :class:`~aglverl.proxy.api.translator.AgentApi` protocol an API's module implements.
- :mod:`~aglverl.proxy.api.responses` — OpenAI's Responses API (``POST .../v1/responses``).
- :mod:`~aglverl.proxy.api.messages` — Anthropic's Messages API (``POST .../v1/messages``).

:data:`APIS` is the registry: the path after ``/v1/`` an API is served on (POST only) -> its class. Adding an
API is a module beside these (a class with the :class:`~aglverl.proxy.api.translator.AgentApi` methods) and one
line in :data:`APIS`. :func:`new_translator` makes a call's translator; :func:`error_body` answers an error in
an API's shape (the proxy's own errors included).
"""

from __future__ import annotations

from collections.abc import Mapping

from .messages import MessagesApi
from .responses import ResponsesApi
from .translator import CHAT_TARGET, AgentApi, TranslationError, Translator

__all__ = [
    "APIS",
    "CHAT_TARGET",
    "AgentApi",
    "MessagesApi",
    "ResponsesApi",
    "TranslationError",
    "Translator",
    "error_body",
    "new_translator",
]

#: The translated APIs by the path (after ``/v1/``) each is served on, POST only.
APIS: Mapping[str, type[AgentApi]] = {
    "responses": ResponsesApi,
    "messages": MessagesApi,
}


def new_translator(path: str) -> Translator:
    """A fresh translator for one call to the API served on ``path``; ``KeyError`` for a path not in
    :data:`APIS`."""
    return Translator(APIS[path])


def error_body(path: str, status: int, message: str, param: str | None = None) -> bytes:
    """The JSON error body the API served on ``path`` answers ``status`` with."""
    return APIS[path].error_body(status, message, param)
