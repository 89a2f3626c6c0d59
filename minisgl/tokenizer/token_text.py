"""The text and raw bytes of single tokens, for log-probability replies.

A byte-level BPE token (Qwen, Llama 3, GPT-2 style) may hold part of a UTF-8 character, so its
own bytes are the truth (OpenAI's `bytes` field) and its text is those bytes decoded with
U+FFFD for an incomplete character. Added/special tokens are their literal content. Other
tokenizers fall back to decoding the one token.
"""

from __future__ import annotations

import json
from typing import Any

from minisgl.logprobs import TokenLogprobs
from minisgl.message.detokenizer_to_api import LogprobsText


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted: char -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


class TokenTexts:
    """id -> (text, bytes), cached (the vocabulary bounds the cache)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.table = _byte_level_table() if _is_byte_level(tokenizer) else None
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added = {int(i): str(t) for i, t in added.items()}
        self.cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self.cache.get(token_id)
        if hit is None:
            hit = self.cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        if token_id in self.added:
            text = self.added[token_id]
            return text, text.encode()
        if self.table is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self.table for c in piece):
                raw = bytes(self.table[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), raw
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text, text.encode()

    def logprobs_text(self, lp: TokenLogprobs) -> LogprobsText:
        tokens, token_bytes = zip(*(self.get(t) for t in lp.token_ids), strict=True)
        top_tokens: list[list[str]] = []
        top_bytes: list[list[bytes]] = []
        for ids in lp.top_ids:
            pairs = [self.get(t) for t in ids]
            top_tokens.append([p[0] for p in pairs])
            top_bytes.append([p[1] for p in pairs])
        return LogprobsText(
            list(tokens),
            list(token_bytes),
            list(lp.logprobs),
            top_tokens,
            top_bytes,
            [list(v) for v in lp.top_logprobs],
        )
