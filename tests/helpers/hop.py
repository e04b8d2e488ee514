"""A recording hop: a loopback HTTP server that forwards every request to a backend and keeps what it was asked.

Between the proxy and a real backend (vLLM, the embedded engine), so that a test can say which requests reached
the backend and with what bodies (:meth:`Hop.asked`), while answers stream through unchanged. For a streamed
chat answer it also counts the generated ids as they pass: :attr:`Hop.midway` is set once one stream has
passed more than ``midway_tokens`` ids without finishing, or has finished (a busy machine's backend may send
many ids in one event): :attr:`Hop.finishes` tells which (the finish reason of each stream that passed, in the
order they ended). With :attr:`Hop.root` set, the backend's model listing says its model is there (a path
this machine does not have: a proxy without the model's tokenizer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import orjson
from aiohttp import web

from aglverl._net import bind_listener, url_of

CHAT = "/v1/chat/completions"


class Hop:
    """What the hop saw (see the module docstring); :attr:`url` is where the proxy sends its calls."""

    def __init__(self, backend: str, midway_tokens: int) -> None:
        self.backend = backend
        self.midway_tokens = midway_tokens
        self.url = ""
        self.seen: list[tuple[str, Any]] = []
        self.midway = anyio.Event()
        self.finishes: list[str] = []
        #: The ``root`` the model listing's cards get instead of the backend's (``None``: the backend's).
        self.root: str | None = None

    def forget(self) -> None:
        """Start recording afresh (a test that makes its setup again)."""
        self.seen.clear()
        self.finishes.clear()
        self.midway = anyio.Event()

    def asked(self, path: str = CHAT) -> list[Any]:
        """The bodies of the requests to ``path``, in the order they came."""
        return [body for p, body in self.seen if p == path]

    def paths(self) -> list[str]:
        """Every request's path but the model listing's (read once per backend), in the order they came."""
        return [p for p, _ in self.seen if p != "/v1/models"]

    def with_ids(self) -> list[dict[str, Any]]:
        """The chat requests that carried prompt ids (``kv_transfer_params.prompt_token_ids``)."""
        return [b for b in self.asked() if isinstance(b, dict) and (b.get("kv_transfer_params") or {}).get("prompt_token_ids")]  # fmt: skip

    def _count(self, line: bytes, tokens: int) -> int:
        for choice in orjson.loads(line[6:]).get("choices") or ():
            tokens += len(choice.get("token_ids") or ())
            if choice.get("finish_reason") is not None:
                self.finishes.append(choice["finish_reason"])
                self.midway.set()
        if tokens > self.midway_tokens:
            self.midway.set()
        return tokens


@asynccontextmanager
async def recording_hop(backend: str, midway_tokens: int = 20) -> AsyncIterator[Hop]:
    """A :class:`Hop` in front of ``backend`` (``http://host:port``), serving while the context is open."""
    hop = Hop(backend, midway_tokens)
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        hop.seen.append((request.path, orjson.loads(raw) if raw else None))
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.request(
            request.method, hop.backend + request.path_qs, data=raw, headers=headers
        ) as answer:
            passed = {"Content-Type": answer.headers.get("Content-Type", "application/json")}
            for name in ("X-Weight-Version",):
                if name in answer.headers:
                    passed[name] = answer.headers[name]
            streamed = answer.content_type == "text/event-stream"
            if not streamed:  # whole, with its length, as the backend sent it
                raw = await answer.read()
                if request.path == "/v1/models" and hop.root is not None:
                    listing = orjson.loads(raw)
                    listing["data"] = [{**card, "root": hop.root} for card in listing["data"]]
                    raw = orjson.dumps(listing)
                return web.Response(status=answer.status, body=raw, headers=passed)
            response = web.StreamResponse(status=answer.status, headers=passed)
            await response.prepare(request)
            tokens, pending = 0, b""
            async for piece in answer.content.iter_any():
                *lines, pending = (pending + piece).split(b"\n")  # pieces may end inside a line
                for line in lines:
                    if line.startswith(b"data: {"):
                        tokens = hop._count(line, tokens)
                await response.write(piece)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = bind_listener("127.0.0.1", 0)
    site = web.SockSite(runner, sock)
    await site.start()
    hop.url = url_of(sock)
    try:
        yield hop
    finally:
        await runner.cleanup()
        await session.close()
