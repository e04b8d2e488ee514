"""Token ids and text through one tokenizer, as the embedded server's hot paths use them.

:class:`TokenCodec` decodes (special tokens skipped or kept), encodes, and names each token by its own text
(what log-probs report, cached per token). It calls the tokenizer's Rust backend directly when there is one
(a few µs a call, no Python wrapper), the tokenizer otherwise. Thread-safe for reading; the token-text cache
is filled on the server's loop only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TokenCodec"]


class TokenCodec:
    """Decoding and encoding for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._texts: dict[int, str] = {}

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens left out unless ``skip_special`` is false."""
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=skip_special))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    def encode(self, text: str, *, special: bool) -> list[int]:
        """Ids of ``text``; ``special``: add the tokenizer's special tokens (BOS...) as it would."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=special).ids
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def token_text(self, token: int) -> str:
        """A token's own text (special tokens spelled out), as vLLM reports it in logprobs."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.decode([token], skip_special=False)
        return text
