"""What the Agent Lightning routes share: a refusal that becomes ``{"detail": ...}``, and the bounded body."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["Refused", "json_response", "read_body"]


class Refused(Exception):
    """A request refused with ``status``; answered ``{"detail": detail}`` as Agent Lightning's server answers."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def json_response(data: Any, status: int = 200) -> Response:
    """A model, a list of models, or plain JSON data."""
    if isinstance(data, BaseModel):
        body = data.model_dump_json().encode()
    elif isinstance(data, list) and data and isinstance(data[0], BaseModel):
        body = b"[" + b",".join(d.model_dump_json().encode() for d in data) + b"]"
    else:
        body = orjson.dumps(data)
    return Response(body, status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 past ``limit`` bytes (before reading it when its length says so)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Refused(413, f"request body of {length} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
