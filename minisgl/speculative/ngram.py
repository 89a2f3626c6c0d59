"""N-gram lookup drafts (prompt lookup decoding): copy what followed the sequence's last tokens
the previous time they occurred in its prompt or output. No second model, torch-free.

Stateless: each proposal searches the request's token ids packed as int32 bytes, so the search
runs in C (bytes.rfind) and nothing per request has to be kept, rolled back or released.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.scheduler.request import Request

_ITEM = 4  # bytes per packed token id (int32: vocabularies stay far below 2**31)


def find_draft(ids: Sequence[int], k: int, min_window: int, max_window: int) -> list[int]:
    """Up to k tokens continuing `ids`: the longest suffix of n tokens (n from max_window down
    to min_window) that also occurs earlier, its latest earlier occurrence, and what followed.

    The copy may run into the tokens it drafts itself (a periodic sequence keeps its period),
    so a match always yields k tokens. [] when no suffix of min_window tokens recurs."""
    n_ids = len(ids)
    if k <= 0 or n_ids < 2:
        return []
    buf = array("i", ids).tobytes()
    for n in range(min(max_window, n_ids - 1), min_window - 1, -1):
        suffix = buf[(n_ids - n) * _ITEM :]
        # Occurrences must end before the last token: what follows them is known.
        end = (n_ids - 1) * _ITEM
        while True:
            at = buf.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % _ITEM == 0:
                return _copy(ids, at // _ITEM + n, k)
            end = at + len(suffix) - 1  # a match across token boundaries: look further left
    return []


def _copy(ids: Sequence[int], src: int, k: int) -> list[int]:
    out: list[int] = []
    n_ids = len(ids)
    for i in range(src, src + k):
        out.append(ids[i] if i < n_ids else out[i - n_ids])
    return out


class NgramDrafter:
    needs_hidden_states = False

    def __init__(self, min_window: int = 1, max_window: int = 12) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(
                f"ngram match windows need 1 <= min <= max, got min={min_window} max={max_window}"
            )
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [
            find_draft(r.all_ids, k, self.min_window, self.max_window)
            for r, k in zip(reqs, num_tokens, strict=True)
        ]

    def accepted(
        self,
        reqs: Sequence[Request],
        num_accepted: Sequence[int],
        hidden: Any,
        rows: Sequence[Sequence[int]] | None,
    ) -> None:
        """Nothing to extend: the next proposal reads the request's tokens afresh."""

    def release(self, req: Request) -> None:
        """Nothing is kept per request."""
