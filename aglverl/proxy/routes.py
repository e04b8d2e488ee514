"""The proxy's two route families, matched on a request's path as the URL parser gives it.

- ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path}`` — an attributed call (recorded, admitted against its
  attempt);
- ``/v1/{path}`` — an unattributed call (relayed, counted, never recorded).

The path is the URL parser's (``httptools.parse_url``): no query, no fragment, so that neither can change which
route a call takes (``.../v1/chat/completions#x`` is a chat call like any). Percent-escapes are decoded segment by
segment before matching, the way the backends decode them: ``/rollout/%72...`` is the rollout ``r...``, and
``chat%2Fcompletions`` is matched, and captured, as ``chat/completions``, which is what the backend serves it as.
What goes upstream (:attr:`Route.target`) is the path as sent when it holds no escape, else the path as read,
escaped again where it must be (an escaped ``/`` goes as ``/``): the backend serves what the proxy matched and
recorded, whether it decodes ``%2F`` (uvicorn) or not (aiohttp). A ``.`` or ``..`` segment or a backslash (escaped or not, an escaped ``/``
read as a separator) is marked
(:attr:`Route.dotted`): the proxy refuses it (400) rather than let a backend resolve it elsewhere. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

__all__ = ["Route", "route"]

#: What a path segment may hold unescaped (RFC 3986's pchar, less ``%``).
_PCHAR = "!$&'()*+,;=:@-._~"


@dataclass(frozen=True, slots=True)
class Route:
    """A matched route: the rollout and attempt (``None`` for ``/v1/...``), the path after ``/v1/`` as the proxy
    reads it (escapes decoded: what an API or a captured path is matched on), the target sent upstream
    (``/v1/...``, without the query), and whether a segment is ``.``/``..`` or holds a backslash."""

    rollout_id: str | None
    attempt_id: str | None
    path: str
    target: str
    dotted: bool


def route(raw_path: str) -> Route | None:
    """The route of ``raw_path`` (a URL's path, as sent); ``None`` when it is neither family's."""
    segments = raw_path.split("/")
    rollout_id: str | None
    attempt_id: str | None
    escaped = "%" in raw_path
    if escaped:
        segments = [unquote(s, errors="surrogateescape") for s in segments]
    if len(segments) >= 7 and segments[1] == "rollout" and segments[3] == "attempt" and segments[5] == "v1":
        rollout_id, attempt_id, rest = segments[2], segments[4], segments[6:]
        if not rollout_id or not attempt_id:
            return None
    elif len(segments) >= 3 and segments[0] == "" and segments[1] == "v1":
        rollout_id = attempt_id = None
        rest = segments[2:]
    else:
        return None
    if segments[0]:
        return None  # not an absolute path (the URL parser's path of an origin-form target starts with "/")
    path = "/".join(rest)
    if (
        escaped
    ):  # the path as read, escaped again where it must be: an escaped "/" is sent as the "/" it was read as
        target = "/v1/" + quote(path, safe=_PCHAR + "/", errors="surrogateescape")
    else:
        target = "/v1/" + path
    dotted = False
    if escaped or "." in raw_path or "\\" in raw_path:
        decoded = "/".join(segments)  # an escaped "/" is a separator to a backend that decodes the whole path
        dotted = "\\" in decoded or any(s in (".", "..") for s in decoded.split("/"))
    return Route(rollout_id, attempt_id, path, target, dotted)
