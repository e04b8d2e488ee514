"""What the proxy does itself for a rollout attempt whose agent calls it directly in place of Agent Lightning's
hop on the task server (:mod:`aglverl.agl10.hop`): the attempt's own key, and the body rewrite of Agent
Lightning's gateway. Pure data and a pure function: nothing here awaits.

aglverl's runner starts an agent process per attempt and gives it an OpenAI base URL. Through the hop, a call
costs a second HTTP exchange on the same loop (the task server's, then an HTTP client to the proxy); so when the
proxy runs in the daemon's process, the runner gives its agents the attempt's proxy URL itself, and the proxy
applies the hop's rule (:class:`GatewayRule`, asked of ``gateway(rollout_id, attempt_id)`` at each call's head,
by :meth:`Admission.check <aglverl.proxy.admission.Admission.check>`):

- the attempt's key (its agent's ``AGL_KEY``) opens that attempt's calls, as the proxy's token does, and no
  other key does (it is needed even when the proxy has no token, as on the hop: one agent cannot call under
  another's rollout); a revoked key (the agent's process is gone) opens nothing. Checked at the head: a call
  with a wrong key is refused (401) before a byte of its body is read, as every refusal is;
- every JSON object body gets ``fields`` (the served model's name, the rollout's temperature), as the hop sets
  them (:func:`rewrite_json`, which the hop uses too), once the body is read
  (:meth:`Admission.admit <aglverl.proxy.admission.Admission.admit>`); any other body goes as it is.

An attempt with no rule (``None``: not one the runner started) is the proxy's token's alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["GatewayRule", "GatewayRules", "rewrite_json"]


def rewrite_json(body: bytes, fields: Mapping[str, Any], content_type: str) -> bytes:
    """``body`` with ``fields`` set, when it is a JSON object (by its ``content_type`` and its bytes); any other
    body as it is (the proxy answers what is wrong with it)."""
    if not body or not fields or "json" not in content_type.lower():
        return body
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(payload, dict):
        return body
    payload.update(fields)
    return orjson.dumps(payload)


@dataclass(frozen=True, slots=True)
class GatewayRule:
    """One attempt's rule: ``key`` opens its calls (``None``: revoked, only the proxy's token does); ``fields``
    are set on its JSON bodies."""

    key: str | None
    fields: Mapping[str, Any]


#: ``(rollout_id, attempt_id)`` -> the attempt's rule, or ``None`` (the proxy's token alone opens it).
GatewayRules = Callable[[str, str], "GatewayRule | None"]
