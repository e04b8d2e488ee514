"""What a training config that cannot run raises: :class:`ConfigError`, whose message names the key, the value
and what is allowed (from :mod:`aglverl.algorithm`'s checks and from the sections mapped onto aglverl's keys,
such as Agent Lightning's ``agentlightning:``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "unknown_key_message"]


class ConfigError(ValueError):
    """The training config is invalid; the message names the key, the value and what is allowed."""


def unknown_key_message(full_key: str, key: str, known: Iterable[str]) -> str:
    """``unknown config key 'a.b'; did you mean 'c'?`` (the suggestion only when one is close)."""
    close = difflib.get_close_matches(key, sorted(known), n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown config key {full_key!r}{hint}"
