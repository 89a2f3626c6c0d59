"""EAGLE-3 drafts: the head (eagle3.py) run as a chain of K greedy steps per request.

Per request the drafter keeps the head's own K/V for the positions the target has accepted
(pair i: token i + 1 with the target's hidden states of position i), in one contiguous tensor per
request grown by doubling (simple; not paged, and not counted in the KV cache's page budget).
The target's captured hidden states arrive with `accepted` after every forward that computed
KV for the request (prefill chunks, decodes, verifications); they are run through the head
lazily, batched over requests, at the next `propose`. Drafting then chains from the head's
output at the last accepted position: each step feeds the drafted token and the head's own
output back at the next position. Chained steps write their K/V past the accepted length, so
the next proposal overwrites them: rejected drafts need no undo, and a position sent again
(a request that was rolled back) truncates the context to before it.

A prefix-cache hit skips the target's forward over the cached prompt, so the head sees the
request only from the first recomputed position on (its drafts are poorer for it, the output
unchanged: every draft is verified).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from minisgl.speculative.eagle3 import Eagle3Head, load_eagle3_head

if TYPE_CHECKING:
    from minisgl.config import EngineArgs
    from minisgl.models.config import ModelConfig
    from minisgl.scheduler.request import Request


# Positions a request's features may wait un-run while it is not drafted for (bounds their
# memory: 3 x hidden values each).
MAX_BACKLOG = 512


class _Context:
    """One request's head state: K/V of accepted positions, features not run yet, and the
    (first draft token, output) the chain starts from once caught up."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [capacity, Hkv, D]
        self.v: torch.Tensor | None = None
        self.positions: list[int] = []  # of the first len(positions) K/V rows
        self.pending: list[tuple[int, torch.Tensor]] = []  # (first position, features)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def n(self) -> int:
        return len(self.positions)

    @property
    def end(self) -> int:
        """The position after the last one held (run or pending)."""
        if self.pending:
            start, feats = self.pending[-1]
            return start + feats.shape[0]
        return self.positions[-1] + 1 if self.positions else 0

    def add(self, start: int, feats: torch.Tensor) -> None:
        if start < self.end:  # sent again (rolled back): forget everything from there
            del self.positions[bisect.bisect_left(self.positions, start) :]
            kept = []
            for s, f in self.pending:
                if s < start:
                    kept.append((s, f[: start - s]))
            self.pending = kept
        self.pending.append((start, feats))
        self.last = None

    def reserve(self, rows: int, like: torch.Tensor) -> None:
        """Room for `rows` K/V rows (like: one row's [Hkv, D], for dtype and device)."""
        cap = 0 if self.k is None else self.k.shape[0]
        if rows <= cap:
            return
        new = max(rows, 2 * cap, 64)
        k = like.new_empty((new, *like.shape))
        v = like.new_empty((new, *like.shape))
        if self.k is not None and self.v is not None and self.n:
            k[: self.n] = self.k[: self.n]
            v[: self.n] = self.v[: self.n]
        self.k, self.v = k, v


class Eagle3Drafter:
    needs_hidden_states = True

    def __init__(self, head: Eagle3Head, capture_layers: tuple[int, ...]) -> None:
        self.head = head
        # The target layers whose outputs `accepted` must get, in fc's order.
        self.capture_layers = capture_layers
        self._ctx: dict[str, _Context] = {}
        self._param = head.norm.weight  # the head's device and dtype

    # -- Drafter protocol --------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        # A request drafted for now catches up; the others wait (speculation may be off for
        # them a long while) unless their backlog grows large: run later, batched, it costs no
        # more.
        self._catch_up(
            [
                r
                for r, k in zip(reqs, num_tokens, strict=True)
                if k > 0 or self._backlog(r) > MAX_BACKLOG
            ]
        )
        live = [
            i
            for i, (req, k) in enumerate(zip(reqs, num_tokens, strict=True))
            if k > 0 and self._ready(req)
        ]
        out: list[list[int]] = [[] for _ in reqs]
        if live:
            drafts = self._chain([reqs[i] for i in live], [num_tokens[i] for i in live])
            for i, d in zip(live, drafts, strict=True):
                out[i] = d
        return out

    @torch.inference_mode()
    def accepted(
        self,
        reqs: Sequence[Request],
        num_accepted: Sequence[int],
        hidden: torch.Tensor | None,
        rows: Sequence[Sequence[int]] | None,
    ) -> None:
        """Keep the features of each request's newly computed positions: its KV now ends at
        `num_computed`, and rows[i] are the last len(rows[i]) of those positions."""
        if hidden is None or rows is None:
            return
        for req, r in zip(reqs, rows, strict=True):
            if req.finish_reason is not None:
                self._ctx.pop(req.rid, None)
                continue
            if not len(r):
                continue
            idx = torch.as_tensor(list(r), dtype=torch.long, device=hidden.device)
            feats = hidden.index_select(0, idx).to(self._param.device, self._param.dtype)
            start = req.num_computed - len(r)
            self._ctx.setdefault(req.rid, _Context()).add(start, feats)

    def release(self, req: Request) -> None:
        self._ctx.pop(req.rid, None)

    # -- internals ---------------------------------------------------------------------------

    def _backlog(self, req: Request) -> int:
        ctx = self._ctx.get(req.rid)
        return 0 if ctx is None else sum(f.shape[0] for _, f in ctx.pending)

    def _ready(self, req: Request) -> bool:
        """Caught up: the head has run the last position whose next token is known."""
        ctx = self._ctx.get(req.rid)
        return ctx is not None and ctx.last is not None and ctx.end == req.num_tokens - 1

    def _catch_up(self, reqs: Sequence[Request]) -> None:
        """Run every request's pending features through the head, one batch for all."""
        head, dev = self.head, self._param.device
        work: list[tuple[Request, _Context, list[int]]] = []
        tokens: list[int] = []
        feats: list[torch.Tensor] = []
        for req in reqs:
            ctx = self._ctx.get(req.rid)
            if ctx is None or not ctx.pending:
                continue
            positions: list[int] = []
            for start, f in ctx.pending:
                # Pair i needs token i + 1: a position without its next token waits.
                m = min(f.shape[0], req.num_tokens - 1 - start)
                if m <= 0:
                    break
                positions += range(start, start + m)
                tokens += req.token_slice(start + 1, start + m + 1)
                feats.append(f[:m])
            if positions:
                work.append((req, ctx, positions))
        if not work:
            return
        pos = torch.tensor([p for _, _, ps in work for p in ps], dtype=torch.long, device=dev)
        hidden = head.project(torch.cat(feats))
        q, k, v = head.qkv_rows(torch.tensor(tokens, device=dev), hidden, pos)
        attn = []
        row = 0
        for _, ctx, positions in work:
            m, n = len(positions), ctx.n
            ctx.reserve(n + m, k[0])
            assert ctx.k is not None and ctx.v is not None
            ctx.k[n : n + m] = k[row : row + m]
            ctx.v[n : n + m] = v[row : row + m]
            attn.append(head.attend(q[row : row + m], ctx.k[: n + m], ctx.v[: n + m]))
            ctx.positions += positions
            row += m
        out = head.finish(torch.cat(attn), hidden)
        ends = torch.tensor(
            list(_cumsum([len(ps) for _, _, ps in work])), dtype=torch.long, device=dev
        )
        last_out = out.index_select(0, ends - 1)
        first = head.next_tokens(last_out)
        for j, (_, ctx, positions) in enumerate(work):
            done = positions[-1] + 1
            ctx.pending = _drop_before(ctx.pending, done)
            ctx.last = (first[j], last_out[j]) if not ctx.pending else None

    def _chain(self, reqs: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """K greedy steps from each request's last accepted position; the chained K/V rows sit
        past the accepted ones and are overwritten by the next catch-up."""
        head, dev = self.head, self._param.device
        ctxs = [self._ctx[r.rid] for r in reqs]
        tok = torch.stack([c.last[0] for c in ctxs if c.last is not None])
        hid = torch.stack([c.last[1] for c in ctxs if c.last is not None])
        steps = [tok]
        act = list(range(len(reqs)))
        for c, k_max in zip(ctxs, num_tokens, strict=True):
            assert c.k is not None
            c.reserve(c.n + k_max, c.k[0])  # before any chained row: growing keeps only c.n
        for s in range(1, max(num_tokens)):
            act = [a for a in act if num_tokens[a] > s]
            if not act:
                break
            sel = torch.tensor(act, dtype=torch.long, device=dev)
            # The pair (draft s, the head's output at the position before) sits at position
            # num_tokens - 2 + s: the last accepted position is num_tokens - 2.
            pos = torch.tensor([reqs[a].num_tokens - 2 + s for a in act], device=dev)
            h_in = hid.index_select(0, sel)
            q, k, v = head.qkv_rows(tok.index_select(0, sel), h_in, pos)
            attn = []
            for j, a in enumerate(act):
                c = ctxs[a]
                at = c.n + s - 1
                assert c.k is not None and c.v is not None
                c.k[at] = k[j]
                c.v[at] = v[j]
                attn.append(head.attend(q[j : j + 1], c.k[: at + 1], c.v[: at + 1]))
            o = head.finish(torch.cat(attn), h_in)
            nxt = head.next_tokens(o)
            tok = tok.index_copy(0, sel, nxt)
            hid = hid.index_copy(0, sel, o)
            steps.append(tok)
        table = torch.stack(steps, 1).tolist()  # one device sync for all drafts
        return [row[:k] for row, k in zip(table, num_tokens, strict=True)]


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _drop_before(pending: list[tuple[int, torch.Tensor]], pos: int) -> list[tuple[int, Any]]:
    """Pending segments with the positions before `pos` removed (they have been run)."""
    kept = []
    for start, f in pending:
        if start + f.shape[0] <= pos:
            continue
        cut = max(0, pos - start)
        kept.append((start + cut, f[cut:]))
    return kept


def make_eagle3_drafter(
    args: EngineArgs, model_config: ModelConfig, device: Any, dtype: Any
) -> Eagle3Drafter:
    """The drafter for `--speculative-algorithm eagle3` (its head from
    `--speculative-draft-model-path`, in the target's dtype on the target's device)."""
    from minisgl.models.loader import resolve_model_path

    if not args.speculative_draft_model_path:
        raise ValueError(
            "--speculative-algorithm eagle3 needs --speculative-draft-model-path (a directory or "
            "hub id of an EAGLE-3 head, e.g. one trained with SpecForge)"
        )
    head_path = resolve_model_path(args.speculative_draft_model_path)
    head, layers = load_eagle3_head(
        head_path,
        model_config,
        resolve_model_path(args.model),
        dtype,
        torch.device(device),
        args.cpu_kernel_tuning,
    )
    return Eagle3Drafter(head, layers)
