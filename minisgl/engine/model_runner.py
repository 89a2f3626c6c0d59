"""The device side of a step: weights, KV pool, attention metadata, forward and sampling."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from minisgl import heap
from minisgl.config import EngineArgs
from minisgl.engine.cuda_graph import DecodeGraphs, graphs_wanted, is_graph_decode
from minisgl.engine.memory import agree_num_pages, default_num_pages
from minisgl.kvcache.kv_pool import KVPool, cache_dtype, kv_cache_name
from minisgl.layers import cpu_kernels
from minisgl.layers.attention import create_attention_backend, resolve_backend_name
from minisgl.layers.attention.base import BatchLayout
from minisgl.layers.logprobs import pick, prompt_logprobs, row_stats
from minisgl.layers.penalties import (
    PenaltyBatch,
    PenaltyState,
    PenaltyUndo,
    apply_penalties,
    ban_tokens,
    undo_penalties,
)
from minisgl.layers.sampling import SamplingBatch, sample
from minisgl.logprobs import TokenLogprobs
from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model, resolve_device, resolve_dtype
from minisgl.sampling_params import SamplingParams
from minisgl.speculative.verify import expand, expand_states, verify

logger = logging.getLogger(__name__)


class SampleState(Protocol):
    """What the sampler reads (and keeps) per sampled request: the scheduler's Request."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    penalty_state: Any  # PenaltyState once penalties ran for it; owned by this runner


@dataclass
class PromptRows:
    """Prompt positions of one sequence to score: flat rows [start, start + len(targets)) of
    this step's tokens, each predicting the next prompt token in `targets`."""

    start: int
    targets: list[int]
    k: int  # top alternatives per token


@dataclass
class ForwardInput:
    """One step, as plain lists: the scheduler's batch flattened in request order."""

    token_ids: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    page_tables: list[list[int]]
    sample_rows: list[int]  # index of each sampled request within the batch
    sample_params: list[SamplingParams]
    sample_steps: list[int]
    sample_seeds: list[int]
    # int32 token bitmask [len(sample_rows), words] for structured outputs; None: no row is
    # constrained (the common case costs nothing).
    grammar_bitmask: Any = None
    grammar_rows: list[int] | None = None  # which rows of the bitmask are constrained
    # Per sampled request: its state for penalties (None: no request needs penalties).
    sample_states: Sequence[SampleState] | None = None
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # Decoder layers whose outputs an EAGLE-3 drafter reads (its config's order); () = none
    # (no capture, no cost).
    capture_layers: tuple[int, ...] = ()
    # Speculative decoding: per sampled request, the draft tokens that end its tokens (scored
    # at every position after them too); None: no request has any this step.
    sample_drafts: list[list[int]] | None = None
    # min_tokens: (rows, tokens) of the sampled logits (one row per scored position) set to
    # -inf before sampling; None: no request holds back its stop tokens this step.
    stop_bans: tuple[list[int], list[int]] | None = None


@dataclass
class ForwardOutput:
    tokens: list[int]  # one per sampled request (the last of its run)
    logprobs: list[TokenLogprobs | None]  # per sampled request, of its run: None unless asked
    prompt_logprobs: list[TokenLogprobs]  # per PromptRows entry, in order
    # With ForwardInput.capture_layers: those layers' outputs side by side for every token of
    # the step, in the step's order ([tokens, len(capture_layers) * hidden]).
    hidden: torch.Tensor | None = None
    # Per sampled request, the tokens it emits: its accepted drafts, then the target's own.
    runs: list[list[int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        args: EngineArgs,
        model_path: Path,
        config: ModelConfig,
        max_seq_len: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.config = config
        self.page_size = args.page_size
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, config, self.device)
        held = cache_dtype(args.kv_cache_dtype, self.dtype)  # a bad name stops us before loading
        self.model = load_model(
            model_path,
            config,
            self.dtype,
            self.device,
            tp_rank,
            tp_size,
            cpu_kernel_tuning=args.cpu_kernel_tuning,
            quantization=args.quantization,
            lm_head_quantization=args.lm_head_quantization,
            cpu_weight_copies_max_gb=args.cpu_weight_copies_max_gb,
            cpu_quantized_activations=args.cpu_quantized_activations,
        )
        # --cpu-quantized-activations is one switch of the C kernels per process, which another
        # model loaded into it (a second LLM) sets too: each step sets this model's own.
        self.quantized_activations = (
            args.cpu_quantized_activations if self.device.type == "cpu" else None
        )
        num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        num_heads = config.num_attention_heads // tp_size
        bytes_per_page = KVPool.bytes_per_page(
            config.num_hidden_layers, self.page_size, num_kv_heads, config.head_dim, held
        )
        self.num_pages = args.num_pages or agree_num_pages(
            default_num_pages(
                bytes_per_page=bytes_per_page,
                page_size=self.page_size,
                max_seq_len=max_seq_len,
                max_running_requests=args.max_running_requests,
                memory_fraction=args.memory_fraction,
                device=self.device,
            )
        )
        backend = resolve_backend_name(args.attention_backend, self.device.type, self.dtype)
        eager_why = graphs_wanted(args.disable_cuda_graph, self.device.type, backend)
        # Decode graphs' padding rows write their K/V to a page of their own: one past the
        # scheduler's pages.
        self.kv_pool = KVPool(
            config.num_hidden_layers,
            self.num_pages + (eager_why is None),
            self.page_size,
            num_kv_heads,
            config.head_dim,
            self.dtype,
            self.device,
            cache_dtype=held,
        )
        self.attn = create_attention_backend(
            args.attention_backend,
            kv_pool=self.kv_pool,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5,
        )
        logger.info(
            "KV cache: %d pages x %d tokens (%.1f MiB), dtype %s on %s",
            self.num_pages,
            self.page_size,
            self.num_pages * bytes_per_page / 2**20,
            kv_cache_name(held),
            self.device,
        )
        self.decode_graphs: DecodeGraphs | None = None
        self.warm_up(backend)  # before the decode graphs: their capture must not compile
        if self.device.type == "cpu":
            # The weights are in place: from here on a step's freed temporaries stay mapped
            # for the next step (heap.py).
            heap.keep_freed_memory()
        if eager_why is None:
            self.decode_graphs = DecodeGraphs.start(
                lambda ids, pos, meta, rows: self.model(ids, pos, self.attn, meta, rows),
                self.attn,
                self.device,
                args.cuda_graph_max_bs,
                self.page_size,
                scratch_page=self.num_pages,
                max_pages_per_seq=-(-max_seq_len // self.page_size),
            )
        elif self.device.type == "cuda":
            logger.info("CUDA graphs off: %s", eager_why)

    def warm_up(self, backend: str) -> None:
        """One tiny prefill and a decode through the model before the server may say it is
        ready: every attention kernel of this head layout is loaded now (FlashInfer reads it
        from its prebuilt cache, or compiles it) rather than inside the first request, and a
        failure stops the start-up with its error. Every tensor-parallel rank runs it at the
        same point, so their collectives line up. The pages it writes belong to no request
        yet; a request that gets them writes each slot before it reads it."""
        start = time.perf_counter()
        pages = list(range(min(self.num_pages, -(-3 // self.page_size))))
        prefill = min(2, len(pages) * self.page_size - 1)
        greedy = SamplingParams(temperature=0, max_tokens=1)
        for prefix, extend in [(0, prefill), (prefill, 1)] if prefill else [(0, 1)]:
            self.forward(
                ForwardInput([0] * extend, [prefix], [extend], [pages], [0], [greedy], [0], [0])
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "warm-up: a prefill and a decode through the %s attention backend "
            "(%d heads, %d KV heads of %d) in %.2f s",
            backend,
            self.attn.num_heads,
            self.attn.num_kv_heads,
            self.attn.head_dim,
            time.perf_counter() - start,
        )

    @torch.inference_mode()
    def forward(self, inp: ForwardInput) -> ForwardOutput:
        """Run one batch: the sampled token of every request in `sample_rows`, plus the
        log-probabilities the requests asked for."""
        if self.quantized_activations is not None:
            cpu_kernels.set_quantized_activations(self.quantized_activations)
        logits = self._graph_logits(inp)
        if logits is not None:
            return self._sample(logits, inp, [])
        layout = BatchLayout(self.page_size, inp.prefix_lens, inp.extend_lens, inp.page_tables)
        meta = self.attn.prepare(layout)
        if all(n == 1 for n in inp.extend_lens):  # a decode step: one token per request
            positions = np.asarray(inp.prefix_lens, dtype=np.int64)
            ends = np.arange(len(positions), dtype=np.int64)
        else:
            positions = np.concatenate(
                [
                    np.arange(p, p + n, dtype=np.int64)
                    for p, n in zip(inp.prefix_lens, inp.extend_lens)
                ]
            )
            ends = np.cumsum(np.asarray(inp.extend_lens, dtype=np.int64)) - 1
        input_ids = torch.tensor(inp.token_ids, dtype=torch.long, device=self.device)
        pos_t = torch.from_numpy(positions).to(self.device)
        scored = ends[inp.sample_rows]
        if inp.sample_drafts is not None:  # a request with drafts is scored after each of them
            scored = np.concatenate(
                [
                    np.arange(e - len(d), e + 1, dtype=np.int64)
                    for e, d in zip(scored, inp.sample_drafts, strict=True)
                ]
            )
        sample_idx = torch.from_numpy(scored).to(self.device)
        prompt: list[TokenLogprobs] = []
        captured: dict[int, torch.Tensor] = {}
        if inp.prompt_rows or inp.capture_layers:
            rows = [np.arange(r.start, r.start + len(r.targets)) for r in inp.prompt_rows]
            extra = torch.from_numpy(np.concatenate(rows or [np.zeros(0, np.int64)]))
            hidden = self.model.hidden_states(
                input_ids,
                pos_t,
                self.attn,
                meta,
                torch.cat([sample_idx, extra.to(self.device)]),
                inp.capture_layers,
                captured,
            )
            logits = self.model.lm_head(hidden[: len(scored)])
            if inp.prompt_rows:
                prompt = self._score_prompts(hidden[len(scored) :], inp.prompt_rows)
        else:
            logits = self.model(input_ids, pos_t, self.attn, meta, sample_idx)
        aux = torch.cat([captured[i] for i in inp.capture_layers], -1) if captured else None
        if not inp.sample_rows:
            return ForwardOutput([], [], prompt, aux)
        out = self._sample(logits, inp, prompt)
        out.hidden = aux
        return out

    def _graph_logits(self, inp: ForwardInput) -> torch.Tensor | None:
        """The sampled rows' logits by a decode graph's replay; None: run eagerly."""
        graphs = self.decode_graphs
        n = len(inp.extend_lens)
        if (
            graphs is None
            or inp.capture_layers
            or not inp.sample_rows
            or not is_graph_decode(inp.extend_lens, bool(inp.prompt_rows))
            or graphs.bucket(n) is None
        ):
            return None
        logits = graphs.run(inp.token_ids, inp.prefix_lens, inp.page_tables)
        return logits if inp.sample_rows == list(range(n)) else logits[inp.sample_rows]

    def _sample(
        self, logits: torch.Tensor, inp: ForwardInput, prompt: list[TokenLogprobs]
    ) -> ForwardOutput:
        # Log-probabilities come from the raw logits: their stats are taken before any
        # adjustment, and the penalties' changes undone after the draw (the grammar mask never
        # touches a token that can be drawn), so the drawn tokens' raw logits are read in place.
        # With drafts every scored position is a row (grammar rows count them already).
        drafts = inp.sample_drafts
        params = inp.sample_params if drafts is None else expand(inp.sample_params, drafts)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        ks = [params[i].logprobs or 0 for i in lp_rows]
        stats = row_stats(logits, lp_rows, max(ks)) if lp_rows else None
        undo = None
        if inp.sample_states is not None:
            states = inp.sample_states
            undo = self._apply_penalties(
                logits, states if drafts is None else expand_states(states, drafts)
            )
        if inp.stop_bans is not None:  # min_tokens: after the bias, which cannot revive them
            ban_tokens(logits, inp.stop_bans)
        # The grammar mask goes last, so no penalty or bias can revive a disallowed token.
        if inp.grammar_rows:
            apply_grammar_mask(logits, inp.grammar_bitmask, inp.grammar_rows)
        if drafts is None:
            batch = SamplingBatch.build(
                inp.sample_params, inp.sample_steps, inp.sample_seeds, self.device
            )
            tokens_t = sample(logits, batch)
            runs = [[t] for t in tokens_t.tolist()]
        else:
            tokens_t, runs = verify(
                logits, drafts, inp.sample_params, inp.sample_seeds, inp.sample_steps
            )
        logprobs: list[TokenLogprobs | None] = [None] * len(inp.sample_rows)
        if stats is not None:
            if undo is not None:
                undo_penalties(logits, undo)
            drawn = tokens_t[lp_rows].clamp(min=0)  # no draw: that request ends with an error
            per_row: list[TokenLogprobs | None] = [None] * len(params)
            for i, one in zip(lp_rows, pick(logits, lp_rows, stats, drawn, ks).rows(), strict=True):
                per_row[i] = one
            first = 0
            for r, run in enumerate(runs):  # a run's tokens were drawn at its first positions
                if per_row[first] is not None:
                    logprobs[r] = _joined(per_row[first : first + len(run)])
                first += 1 + (len(drafts[r]) if drafts is not None else 0)
        return ForwardOutput([run[-1] for run in runs], logprobs, prompt, runs=runs)

    def _apply_penalties(
        self, logits: torch.Tensor, states: Sequence[SampleState]
    ) -> PenaltyUndo | None:
        rows = [i for i, s in enumerate(states) if s.params.has_penalties]
        if not rows:
            return None
        picked = [states[i] for i in rows]
        for s in picked:
            if s.penalty_state is None:
                s.penalty_state = PenaltyState.create(s.params, s.prompt_ids)
            s.penalty_state.catch_up(s.output_ids)
        batch = PenaltyBatch.build(
            rows, [s.params for s in picked], [s.penalty_state for s in picked], self.device
        )
        return apply_penalties(logits, batch)

    def _score_prompts(
        self, hidden: torch.Tensor, entries: list[PromptRows]
    ) -> list[TokenLogprobs]:
        out = []
        start = 0
        for r in entries:
            n = len(r.targets)
            targets = torch.tensor(r.targets, dtype=torch.long, device=self.device)
            out.append(
                prompt_logprobs(
                    hidden[start : start + n],
                    self.model.lm_head,
                    self.config.vocab_size,
                    targets,
                    r.k,
                )
            )
            start += n
        return out


def _joined(parts: Sequence[TokenLogprobs | None]) -> TokenLogprobs:
    out = TokenLogprobs()
    for p in parts:
        assert p is not None
        out.extend(p)
    return out


def apply_grammar_mask(logits: torch.Tensor, bitmask: Any, rows: list[int]) -> None:
    """Structured outputs: disallowed tokens of the constrained rows to -inf, in place."""
    from minisgl.structured.grammar import apply_bitmask

    apply_bitmask(logits, bitmask, rows)
