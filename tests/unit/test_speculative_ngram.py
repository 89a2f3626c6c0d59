"""The ngram drafter against a brute-force reference, over every short sequence of a few token
ids (chosen so their int32 bytes also match across token boundaries)."""

from __future__ import annotations

import itertools

import pytest

from minisgl.speculative.ngram import NgramDrafter, find_draft

# 0 and 1 share bytes with 256 and 2**24 at shifted offsets: a byte search that forgot token
# boundaries would find matches that are not there.
ALPHABET = (0, 1, 256, 1 << 24)


def reference(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix (hi down to lo) that occurs earlier, its latest occurrence, and the
    k tokens after it, the copy reading on into what it copies."""
    n_ids = len(ids)
    for n in range(min(hi, n_ids - 1), lo - 1, -1):
        suffix = ids[n_ids - n :]
        for start in range(n_ids - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                seq = list(ids)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[n_ids:]
    return []


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 3), (2, 4), (1, 12)])
def test_matches_reference_on_every_short_sequence(lo, hi):
    checked = 0
    for length in range(0, 7):
        for ids in itertools.product(ALPHABET, repeat=length):
            for k in (1, 3):
                assert find_draft(list(ids), k, lo, hi) == reference(list(ids), k, lo, hi), (
                    ids,
                    k,
                )
                checked += 1
    assert checked > 10_000


def test_longest_match_wins_over_a_later_shorter_one():
    # Suffix [7, 8, 9] occurs at the start (followed by 1); [9] alone later (followed by 2).
    ids = [7, 8, 9, 1, 5, 9, 2, 7, 8, 9]
    assert find_draft(ids, 2, 1, 12) == [1, 5]
    assert find_draft(ids, 2, 1, 1) == [2, 7]  # window 1: the latest 9


def test_periodic_sequence_keeps_its_period():
    assert find_draft([3, 4, 5, 3, 4], 5, 1, 12) == [5, 3, 4, 5, 3]


def test_no_draft_without_a_recurring_suffix():
    assert find_draft([1, 2, 3, 4], 4, 1, 12) == []
    assert find_draft([5], 4, 1, 12) == []
    assert find_draft([5, 5], 0, 1, 12) == []


class _Req:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.all_ids = prompt + output


def test_drafter_reads_prompt_and_output_and_respects_each_length():
    drafter = NgramDrafter(min_window=1, max_window=4)
    reqs = [_Req([1, 2, 3, 4], [1, 2]), _Req([9, 9], []), _Req([1, 2], [])]
    assert drafter.propose(reqs, [2, 3, 4]) == [[3, 4], [9, 9, 9], []]
    assert drafter.needs_hidden_states is False
    with pytest.raises(ValueError, match="windows"):
        NgramDrafter(min_window=3, max_window=2)
