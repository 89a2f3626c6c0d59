"""The streaming parsers' shared helper: how much of a text's tail could begin a marker."""

from __future__ import annotations


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`.

    A stream must hold that tail back: the next chunk may complete the marker, and a marker's
    text must never leak into what the client sees.
    """
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
