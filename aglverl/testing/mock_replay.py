"""The mock's replay of recorded vLLM exchanges (``replay_dir``): the cases, how a request finds its case, and
how the case's bytes go back out.

A request matches a case when its method, path and body match (ignoring ``return_token_ids``, which a proxy may
add); the answer is the case's status, content type and exact body, a stream written in small pieces so its SSE
events straddle network chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
from aiohttp import web

__all__ = ["REPLAY_PIECE", "ReplayCase", "load_replay_cases", "replay_key", "send_case"]

#: Bytes per write when replaying a recorded stream: smaller than one event, so events split across chunks.
REPLAY_PIECE = 64


@dataclass(frozen=True, slots=True)
class ReplayCase:
    """One recorded vLLM exchange (``NAME.request.json`` + ``NAME.response.*`` + ``NAME.meta.json``)."""

    name: str
    method: str
    path: str
    body: dict[str, Any]
    status: int
    content_type: str
    response: bytes

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")


def load_replay_cases(directory: str | Path) -> dict[str, ReplayCase]:
    """Every recorded case in ``directory``, by name. Raises ``FileNotFoundError`` for a missing directory."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"replay directory {root} does not exist")
    cases = {}
    for request_file in sorted(root.glob("*.request.json")):
        name = request_file.name.removesuffix(".request.json")
        request = orjson.loads(request_file.read_bytes())
        meta = orjson.loads((root / f"{name}.meta.json").read_bytes())
        [response_file] = [p for p in root.glob(f"{name}.response.*")]
        cases[name] = ReplayCase(
            name=name,
            method=request["method"],
            path=request["path"],
            body=request["body"],
            status=int(meta["status"]),
            content_type=meta["content_type"],
            response=response_file.read_bytes(),
        )
    return cases


def replay_key(method: str, path: str, body: Any) -> tuple[str, str, bytes]:
    """What a request and a recorded case must share to match: method, path, body (less ``return_token_ids``)."""
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k != "return_token_ids"}
    return method, path, orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


async def send_case(request: web.Request, case: ReplayCase, chunk_latency: float = 0.0) -> web.StreamResponse:
    """Answer ``request`` with ``case``'s recorded status, content type and bytes; a stream in pieces of
    :data:`REPLAY_PIECE` bytes, ``chunk_latency`` seconds apart. Cancelled (the client went away), it stops
    writing where it is."""
    headers = {"Content-Type": case.content_type}
    if not case.streamed:
        return web.Response(status=case.status, body=case.response, headers=headers)
    data = case.response
    pieces = [data[i : i + REPLAY_PIECE] for i in range(0, len(data), REPLAY_PIECE)]
    response = web.StreamResponse(status=case.status, headers=headers)
    await response.prepare(request)
    for i, piece in enumerate(pieces):
        if i and chunk_latency > 0:
            await anyio.sleep(chunk_latency)
        await response.write(piece)
    await response.write_eof()
    return response
