"""Incremental detokenization with stop strings.

Byte-level BPE splits multi-byte characters (CJK, emoji) across tokens, so decoding token by
token would show half characters as U+FFFD. We decode a small window (the last complete
boundary onwards) and only advance once the window decodes without a trailing U+FFFD. Stop
strings are searched in the complete text; any tail that could still grow into a stop string is
held back, so a stream never shows text that the final answer cuts.
"""

from __future__ import annotations

from typing import Any, Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(
        self,
        tokenizer: Decoder | Any,
        *,
        stop: list[str] | None = None,
        hidden_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        skip_ids: frozenset[int] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # vLLM's rule: the stop string, or the text of the stop/EOS token that ended the
        # request, is cut from the output unless this is set.
        self.include_stop = include_stop_str_in_output
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.hidden = set(hidden_token_ids or [])
        self.skip_special = skip_special_tokens
        # Set: skip exactly these ids and decode the rest with their special tokens (skipping
        # special tokens, but for a few kept ones, e.g. the output parsers' tags).
        self.skip_ids = skip_ids
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoding from here is context-stable
        self.read_offset = 0  # ids before this are already in self.text
        self.text = ""  # complete text so far (cut at the stop string once one hits)
        self.sent = 0  # chars of self.text already handed out
        self.num_tokens = 0  # every generated token, hidden ones included
        self.stopped = False  # a stop string hit
        # vLLM's min_tokens: stop strings are matched only once more tokens than this are
        # generated, and only where they end in the text of those later tokens (one may begin
        # before).
        self.min_tokens = min_tokens

    def _decode(self, ids: list[int]) -> str:
        if self.skip_ids is not None:
            kept = [i for i in ids if i not in self.skip_ids]
            return self.tokenizer.decode(kept, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) > len(prefix) and (final or not window.endswith(_REPLACEMENT)):
            self.text += window[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _held_back(self) -> int:
        """Chars at the end of text that are a proper prefix of some stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def feed(self, token_ids: list[int], *, finished: bool, finish_reason: str | None) -> str:
        """Add new tokens; return the text that may be shown now ("" when none).

        After a stop string hit, `stopped` is True and the text is final.
        """
        if self.stopped:
            return ""
        if self.stop and len(token_ids) > 1:
            # Several tokens at once (speculative decoding's accepted runs): one at a time, so
            # a stop string ends the output at the token that completed it, as it would have
            # one step at a time (`num_tokens` then counts only the tokens up to it).
            last = len(token_ids) - 1
            return "".join(
                self.feed([t], finished=finished and i == last, finish_reason=finish_reason)
                for i, t in enumerate(token_ids)
            )
        self.num_tokens += len(token_ids)
        ids = list(token_ids)
        ends = finished and finish_reason == "stop" and ids and ids[-1] in self.hidden
        if ends and not self.include_stop:
            ids.pop()  # EOS / stop token: it ends the text, it is not part of it
        checked = len(self.text)
        self.ids.extend(ids)
        self._advance(final=finished)
        end = len(self.text)
        if self.stop and self.num_tokens <= self.min_tokens:
            if not finished:
                end -= self._held_back()  # it may begin a stop string that ends later
        elif self.stop:
            # A hit ends in the new text: the text before was searched, or (the first
            # min_tokens tokens' text) is never searched.
            hits = [
                (p, p + len(s))
                for s in self.stop
                if (p := self.text.find(s, max(0, checked - len(s) + 1))) >= 0
            ]
            if hits:
                self.stopped = True
                first, last = min(hits)
                self.text = self.text[: max(last if self.include_stop else first, self.sent)]
                end = len(self.text)
            elif not finished:
                end -= self._held_back()
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta
