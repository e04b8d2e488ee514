"""The agents' other APIs, spoken in front of any chat-completions backend: one module per API, one registry.

vLLM (and the embedded inference server) return token ids only on chat completions, so an agent call in another
API is translated into a chat completion toward the backend (the proxy then asks for the backend's ids and
records it like any chat call) and the backend's answer is translated back into the agent's API: a whole JSON
body, or an event stream translated event by event as it arrives (nothing of a stream is held back beyond the
SSE event being parsed).

- :mod:`~aglverl.proxy.api.translator` — what every API shares: the call's
  :class:`~aglverl.proxy.api.translator.Translator` (request in, answer out, the endings), the field checks
  that name the wrong field, :class:`~aglverl.proxy.api.translator.TranslationError`, and the
  :class:`~aglverl.proxy.api.translator.AgentApi` protocol an API's module implements.
- :mod:`~aglverl.proxy.api.responses` — OpenAI's Responses API (``POST .../v1/responses``; its stored responses:
  :mod:`~aglverl.proxy.api.response_store` keeps them per attempt, :mod:`~aglverl.proxy.api.stored_responses`
  continues and reads them back).
- :mod:`~aglverl.proxy.api.messages` — Anthropic's Messages API (``POST .../v1/messages``, key in ``x-api-key``).

An API is one module: a class with the :class:`~aglverl.proxy.api.translator.AgentApi` methods that declares
its :class:`~aglverl.proxy.api.translator.Route` patterns (path parameters included: a model named in the URL,
a route that always streams) and the header its SDKs send their key in, registered in :data:`APIS`
(:meth:`Apis.register`; ``tests/test_translate.py`` adds one with a path parameter and its own key header).
:data:`APIS` matches a call's method and path after ``/v1/`` to its API, route and parameters (a route the
proxy answers itself, :attr:`Route.answer <aglverl.proxy.api.translator.Route.answer>`, is matched the same way),
and keeps the one list of headers that carry an agent's credential (:attr:`Apis.credential_headers`:
``Authorization`` and each API's), which the proxy accepts its token in, drops before forwarding, and Agent
Lightning's hop drops too.
:func:`new_translator` makes a call's translator; :func:`error_body` answers an error in an API's shape (the
proxy's own errors included).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ..headers import HOP_BY_HOP
from .messages import MessagesApi
from .responses import ResponsesApi
from .translator import CHAT_TARGET, AgentApi, Route, TranslationError, Translator

__all__ = [
    "APIS",
    "CHAT_TARGET",
    "AgentApi",
    "Apis",
    "MessagesApi",
    "ResponsesApi",
    "Route",
    "TranslationError",
    "Translator",
    "error_body",
    "new_translator",
]

#: Headers never forwarded to a backend beside the credentials: the hop-by-hop ones, the backend's own Host and
#: a recomputed length; ``Expect`` because the proxy has read the whole body before it forwards.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}


class Apis:
    """The translated APIs by their routes (see the module docstring). Matching costs a dict lookup for a path
    with no parameters, and a regular expression only for a path that starts like a parametrised route."""

    def __init__(self, *apis: type[AgentApi]) -> None:
        self._serve(apis)

    def _serve(self, apis: Sequence[type[AgentApi]]) -> None:
        self._apis: list[type[AgentApi]] = []
        self._exact: dict[tuple[str, str], tuple[type[AgentApi], Route]] = {}  # (method, path) -> route
        self._patterns: list[tuple[str, str, re.Pattern[str], type[AgentApi], Route]] = []
        #: The headers an agent's credential comes in, ``authorization`` first (lower case).
        self.credential_headers: tuple[str, ...] = ("authorization",)
        #: Of those, the APIs' own (``x-api-key``...), tried in order when there is no ``Authorization``.
        self.key_headers: tuple[str, ...] = ()
        #: What never goes from an agent's request to a backend: the hop-by-hop headers, the credentials and
        #: the framing the proxy redoes (``host``, ``content-length``, ``expect``).
        self.not_forwarded: frozenset[str] = _NOT_FORWARDED | {"authorization"}
        for api in apis:
            self.register(api)

    def unregister(self, api: type[AgentApi]) -> None:
        """Stop serving ``api`` (its routes, and its key header unless another API takes the same)."""
        self._serve([other for other in self._apis if other is not api])

    def register(self, api: type[AgentApi]) -> type[AgentApi]:
        """Serve ``api`` on its routes (a method and path already served is a ``ValueError``); returns it."""
        self._apis.append(api)
        for route in api.routes:
            if "{" not in route.pattern:
                if (route.method, route.pattern) in self._exact:
                    raise ValueError(f"{route.method} {route.pattern!r} is already served by another API")
                self._exact[route.method, route.pattern] = (api, route)
                continue
            prefix = route.pattern.split("{", 1)[0]
            parts = re.split(r"\{(\w+)\}", route.pattern)
            regex = "".join(
                re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)" for i, part in enumerate(parts)
            )
            self._patterns.append((route.method, prefix, re.compile(regex + r"\Z"), api, route))
        header = getattr(api, "credential_header", None)
        if header and header.lower() not in self.credential_headers:
            self.key_headers = (*self.key_headers, header.lower())
            self.credential_headers = ("authorization", *self.key_headers)
            self.not_forwarded = _NOT_FORWARDED | set(self.credential_headers)
        return api

    def match(self, path: str, method: str = "POST") -> tuple[type[AgentApi], Route, dict[str, str]] | None:
        """The API, route and path parameters a ``method`` call to ``path`` (after ``/v1/``) is for; ``None``:
        none."""
        exact = self._exact.get((method, path))
        if exact is not None:
            return exact[0], exact[1], {}
        for method_, prefix, regex, api, route in self._patterns:
            if method_ == method and path.startswith(prefix) and (found := regex.match(path)) is not None:
                return api, route, found.groupdict()
        return None

    def credential(self, headers: Mapping[str, str]) -> str | None:
        """The credential an agent presented, as an ``Authorization`` value: that header, else the first API
        key header present, as a bearer token; ``None`` when there is none."""
        header = headers.get("Authorization")
        if header is None:
            for name in self.key_headers:
                value = headers.get(name)
                if value is not None:
                    return "Bearer " + value
        return header


#: The translated APIs the proxy serves.
APIS = Apis(ResponsesApi, MessagesApi)


def new_translator(path: str) -> Translator:
    """A fresh translator for one call to the API served on ``path``; ``KeyError`` for a path no API serves."""
    found = APIS.match(path)
    if found is None:
        raise KeyError(path)
    return Translator(*found)


def error_body(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    """The JSON error body the API served on ``path`` answers ``status`` with."""
    found = APIS.match(path)
    if found is None:
        raise KeyError(path)
    return Translator(found[0]).error(status, message, param, code)
