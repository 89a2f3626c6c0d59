"""Per-request logit adjustments before sampling: logit_bias, the three penalties, min_tokens.

Semantics (the ones OpenAI, vLLM and HF document):
- logit_bias: `bias[t]` is added to token t's logit (-100 bans it in practice);
- repetition_penalty r (HF/vLLM): a token seen in the prompt or the output has its logit
  divided by r when positive, multiplied by r when negative;
- frequency_penalty f and presence_penalty p (OpenAI): over the generated tokens only,
  `logit[t] -= f * count[t] + p * (count[t] > 0)`.
Applied in that order (bias, repetition, frequency/presence), as vLLM does.

Sparse on purpose: a request only ever touches the tokens of its prompt, its output and its
bias, a few thousand of a 150k vocabulary. Each request keeps those ids once (with their bias,
seen flag and output count) in host arrays that grow by the tokens generated since the last
step; a step gathers exactly those logits of all penalised rows in one go, adjusts them with a
handful of small ops and scatters them back. No [rows, vocab] tensor is built, so requests that
ask for nothing pay nothing and those that ask pay in proportion to their own tokens.

min_tokens (vLLM's; SGLang's min_new_tokens): while a request has generated fewer tokens, its
stop tokens (EOS and stop_token_ids) are set to -inf, after the bias and penalties (nothing
revives them) and before the grammar mask; log-probabilities stay those of the raw logits, as
vLLM reports them by default. A row whose grammar allows nothing but a stop token is left as it
is: the grammar wins, and the request ends there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minisgl.sampling_params import SamplingParams

_COLUMNS = 3  # bias, seen (0/1), output count


class PenaltyState:
    """One request's touched tokens: ids (unique) and, per id, [bias, seen, count]."""

    def __init__(self, capacity: int = 64) -> None:
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.values = np.zeros((capacity, _COLUMNS), dtype=np.float32)
        self.size = 0
        self.where: dict[int, int] = {}  # token id -> its row in ids/values
        self.num_counted = 0  # output tokens already counted

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: Sequence[int],
    ) -> PenaltyState:
        state = cls(max(64, 2 * len(params.logit_bias)))
        for tok, bias in params.logit_bias.items():
            state._row(tok)[0] = bias
        if params.repetition_penalty != 1.0:  # only repetition looks at the prompt
            for tok in prompt_ids:
                state._row(tok)[1] = 1.0
        return state

    def copy(self) -> PenaltyState:
        """An independent copy (speculative decoding scores positions past drafted tokens,
        each with the counts as if those tokens had been generated)."""
        out = PenaltyState.__new__(PenaltyState)
        out.ids = self.ids.copy()
        out.values = self.values.copy()
        out.size = self.size
        out.where = dict(self.where)
        out.num_counted = self.num_counted
        return out

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Count the tokens generated since the last call (usually one)."""
        for tok in output_ids[self.num_counted :]:
            row = self._row(tok)
            row[1] = 1.0
            row[2] += 1.0
        self.num_counted = len(output_ids)

    def _row(self, tok: int) -> np.ndarray:
        pos = self.where.get(tok)
        if pos is None:
            if self.size == len(self.ids):
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.values = np.concatenate([self.values, np.zeros_like(self.values)])
            pos = self.where[tok] = self.size
            self.ids[pos] = tok
            self.size += 1
        return self.values[pos]


@dataclass
class PenaltyBatch:
    """Every (row, token) the penalised rows of one batch touch, flattened."""

    rows: torch.Tensor  # [N] long: the logits row of each entry
    tokens: torch.Tensor  # [N] long: its token
    values: torch.Tensor  # [N, 6] float32: bias, seen, count, repetition, frequency, presence

    @classmethod
    def build(
        cls,
        rows: list[int],
        params: list[SamplingParams],
        states: list[PenaltyState],
        device: torch.device | str,
    ) -> PenaltyBatch:
        ids, values, coeffs, bases = [], [], [], []
        for row, p, s in zip(rows, params, states, strict=True):
            ids.append(s.ids[: s.size])
            values.append(s.values[: s.size])
            coeffs.append(
                np.broadcast_to(
                    np.array(
                        [p.repetition_penalty, p.frequency_penalty, p.presence_penalty],
                        dtype=np.float32,
                    ),
                    (s.size, 3),
                )
            )
            bases.append(np.full(s.size, row, dtype=np.int64))
        table = np.concatenate([np.concatenate(values), np.concatenate(coeffs)], axis=1)
        return cls(
            rows=torch.from_numpy(np.concatenate(bases)).to(device),
            tokens=torch.from_numpy(np.concatenate(ids)).to(device),
            values=torch.from_numpy(np.ascontiguousarray(table)).to(device),
        )


@dataclass
class PenaltyUndo:
    """The flat positions apply_penalties changed and their values before."""

    flat: torch.Tensor
    raw: torch.Tensor


def apply_penalties(logits: torch.Tensor, batch: PenaltyBatch) -> PenaltyUndo | None:
    """Adjust the penalised rows of `logits` [B, V] (contiguous) in place; returns what
    undo_penalties needs to restore the raw values (None: nothing changed)."""
    if batch.tokens.numel() == 0:
        return None
    flat = batch.rows * logits.shape[1] + batch.tokens
    view = logits.view(-1)
    raw = view.index_select(0, flat)
    bias, seen, count, rep, freq, pres = batch.values.unbind(1)
    x = raw + bias
    x = torch.where(seen > 0, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * count - pres * (count > 0).to(x.dtype)
    view.index_copy_(0, flat, x)
    return PenaltyUndo(flat, raw)


def undo_penalties(logits: torch.Tensor, undo: PenaltyUndo) -> None:
    """Put back the raw logits apply_penalties changed (log-probabilities report those)."""
    logits.view(-1).index_copy_(0, undo.flat, undo.raw)


# ---- min_tokens ---------------------------------------------------------------------------
def min_tokens_bans(
    steps: Sequence[int],
    widths: Sequence[int],
    min_tokens: Sequence[int],
    stop_ids: Sequence[Sequence[int]],
    forced_end: Callable[[int, Sequence[int]], bool] | None = None,
) -> tuple[list[int], list[int]] | None:
    """The (row, token) pairs a step masks for min_tokens, as two flat lists; None: none.

    Request i has generated steps[i] tokens and is scored at widths[i] rows (its next token,
    then one more past each draft under speculative decoding), row r of it drawing output token
    steps[i] + r: that row bans stop_ids[i] while steps[i] + r < min_tokens[i], unless
    forced_end(row, ids) says its grammar allows nothing else there (the grammar wins)."""
    rows: list[int] = []
    tokens: list[int] = []
    row = 0
    for step, width, least, ids in zip(steps, widths, min_tokens, stop_ids, strict=True):
        for r in range(min(width, least - step)):
            if ids and not (forced_end is not None and forced_end(row + r, ids)):
                rows += [row + r] * len(ids)
                tokens += ids
        row += width
    return (rows, tokens) if rows else None


def only_allows(bitmask_row: torch.Tensor, ids: Sequence[int]) -> bool:
    """Whether a grammar's token bitmask row (int32 words, bit set = allowed) allows no token
    but some of `ids`."""
    words = bitmask_row.cpu().numpy().view(np.uint32).copy()
    for t in ids:
        if t >> 5 < len(words):
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
    return not words.any()


def ban_tokens(logits: torch.Tensor, bans: tuple[list[int], list[int]]) -> None:
    """logits[rows[i], tokens[i]] = -inf, in place."""
    rows, tokens = bans
    index = torch.tensor([rows, tokens], dtype=torch.long).to(logits.device)
    logits.index_put_((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))
