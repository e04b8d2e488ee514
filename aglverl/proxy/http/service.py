"""What an :class:`~aglverl.proxy.http.HttpServer` serves: a :class:`Service`.

:meth:`Service.admit` decides on a request at its head, before a byte of its body was read (an answer refuses it,
``None`` lets it in); :meth:`Service.respond` answers a request let in (in a task of its own, the body read when
it asks for it); :meth:`Service.refusal` spells the server's own refusals (:mod:`.errors`) as its clients read
them. An interface only.
"""

from __future__ import annotations

from typing import Protocol

from .errors import HttpError
from .exchange import Answer, Exchange

__all__ = ["Service"]


class Service(Protocol):
    """What an :class:`HttpServer` serves."""

    def admit(self, exchange: Exchange) -> Answer | None:
        """Decide on a request whose head (``exchange``'s method, target, path, query, headers) is in and whose
        body is not: ``None`` lets it in (what it made of the head goes in ``exchange.state``), an answer refuses
        it (written in its turn; the body is never read). Synchronous: called from the parser's callback."""

    async def respond(self, exchange: Exchange) -> None:
        """Answer a request let in (``exchange.body()``, then ``send_whole`` or ``start``/``write``/``end``).
        Cancelled when the client leaves before its answer is written, or when the server stops."""

    def refusal(self, error: HttpError, exchange: Exchange) -> Answer:
        """The answer to a request the server refuses itself (``exchange``: what was read of it)."""
