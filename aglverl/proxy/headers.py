"""Which headers go from one side of the proxy to the other: the hop-by-hop ones never do (RFC 9110, 7.6.1).

Pure data. What an agent's request loses besides (its credential, the framing the proxy redoes) is the
registry's of the agents' APIs (:attr:`aglverl.proxy.api.Apis.not_forwarded`: each API declares the header its
SDKs send their key in); what a backend's answer loses besides is its length (:data:`RESPONSE_DROP`).
"""

from __future__ import annotations

__all__ = ["HOP_BY_HOP", "RESPONSE_DROP"]

HOP_BY_HOP: frozenset[str] = frozenset(
    {"connection", "keep-alive", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
#: Also dropped from responses: the length, recomputed for the body actually sent.
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
