"""The Drafter protocol: where a step's draft tokens come from (ngram lookup, EAGLE-3 head).

The engine asks a drafter for up to K tokens per running request before a step, verifies them
all in one target forward, then tells the drafter how many each request kept. The drafter owns
its per-request state; the engine never looks inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from minisgl.scheduler.request import Request


class Drafter(Protocol):
    # True (eagle3): the engine asks the model for the capture layers' hidden states on verify
    # forwards and hands them to `accepted`. False (ngram): `hidden` and `rows` are None.
    needs_hidden_states: bool

    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Up to num_tokens[i] draft token ids continuing reqs[i] (prompt + output so far);
        [] means no draft for that request this step."""
        ...

    def accepted(
        self,
        reqs: Sequence[Request],
        num_accepted: Sequence[int],
        hidden: torch.Tensor | None,
        rows: Sequence[Sequence[int]] | None,
    ) -> None:
        """After verification (reqs[i].output_ids already holds the accepted tokens and the
        target's own next token): num_accepted[i] of the drafts were kept. For drafters with
        `needs_hidden_states`, `hidden` is the verify forward's captured hidden states
        ([tokens, k * hidden]) and rows[i] the row indices in it of reqs[i]'s accepted
        positions (the last one is the position that produced the bonus token), so the drafter
        can extend its own state."""
        ...

    def release(self, req: Request) -> None:
        """The request finished, was aborted or preempted: drop whatever is kept for it."""
        ...
