"""Engine: the scheduler's bookkeeping plus the model runner, one `step()` at a time.

Token-level only: the engine knows token ids, never text (stop strings are handled by the
caller: `LLM.generate` or the detokenizer worker, which aborts a request once it has hit one).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from minisgl.config import EngineArgs
from minisgl.engine.model_runner import ForwardInput, ModelRunner, PromptRows
from minisgl.layers.penalties import min_tokens_bans, only_allows
from minisgl.layers.sampling import INVALID_TOKEN
from minisgl.logprobs import TokenLogprobs
from minisgl.models.config import ModelConfig
from minisgl.models.loader import resolve_model_path
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.prefill_budget import PrefillBudget
from minisgl.scheduler.request import Request
from minisgl.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerStats
from minisgl.speculative import Drafter, make_drafter
from minisgl.speculative.adaptive import AdaptiveSpeculation
from minisgl.speculative.tp import share_drafts
from minisgl.structured.compile_worker import CompileOutcome, GrammarCompileService
from minisgl.structured.grammar import CACHE_LIMIT_BYTES, GrammarBackend

logger = logging.getLogger(__name__)

SAMPLING_FAILED = (
    "sampling failed: the model produced NaN or infinite logits for this request "
    "(a numerical overflow, e.g. in float16); try another dtype"
)


@dataclass
class StepOutput:
    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" when finished
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_time: float | None = None  # arrival -> first scheduled; set on the first output only
    error: str | None = None  # why the request failed, when finish_reason is "error"
    index: int = 0  # which of the request's n samples
    logprobs: TokenLogprobs | None = None  # of new_token_ids, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # every prompt token's; on the first output
    # Speculative decoding, this step: draft tokens verified for the request, and how many of
    # them it kept (new_token_ids holds those and the target's own next token).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class Engine:
    def __init__(self, args: EngineArgs, *, tp_rank: int = 0) -> None:
        self.args = args
        self.model_path: Path = resolve_model_path(args.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        self.max_seq_len = args.max_seq_len or self.model_config.max_position_embeddings
        if self.max_seq_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                f"({self.model_config.max_position_embeddings})"
            )
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self.runner = ModelRunner(
            args,
            self.model_path,
            self.model_config,
            self.max_seq_len,
            tp_rank=tp_rank,
            tp_size=args.tp_size,
        )
        self.num_pages = self.runner.num_pages
        self.scheduler = Scheduler(
            num_pages=self.num_pages,
            page_size=args.page_size,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            max_seq_len=self.max_seq_len,
            eos_token_ids=self.eos_token_ids,
            enable_prefix_cache=not args.disable_prefix_cache,
        )
        # A burst's prefill in chunks sized from this engine's measured step costs. Not with
        # tensor parallelism: every rank schedules for itself, and timings differ per rank.
        self.prefill_budget: PrefillBudget | None = None
        if args.prefill_chunk_overhead > 0 and args.tp_size == 1:
            self.prefill_budget = PrefillBudget(
                args.max_prefill_tokens, args.page_size, args.prefill_chunk_overhead
            )
        # Followers of a tensor-parallel group keep exactly the grammars rank 0 sends them.
        limit = None if tp_rank > 0 else CACHE_LIMIT_BYTES
        self.grammars = GrammarBackend(
            str(self.model_path), self.vocab_size, self.eos_token_ids, cache_limit_bytes=limit
        )
        self._compiles: GrammarCompileService | None = None  # the server's, on first need
        self._seed_rng = random.Random(args.seed)
        self._arrival: dict[str, float] = {}  # rid -> arrival, until first scheduled
        self._queue_time: dict[str, float] = {}  # rid -> queue time, until its first token
        self._groups: dict[str, list[str]] = {}  # rid of an n > 1 request -> its samples' rids
        # Speculative decoding: rank 0 drafts; the other ranks verify what it sends them.
        self.speculative = args.speculative_algorithm is not None
        self.drafter: Drafter | None = None
        self.adaptive: AdaptiveSpeculation | None = None
        if self.speculative and tp_rank == 0:
            self.drafter = make_drafter(
                args, self.model_config, self.runner.device, self.runner.dtype
            )
            assert self.drafter is not None
            # How many drafts each request gets per step, from its acceptance and the measured
            # cost of this engine's steps (speculative/adaptive.py).
            self.adaptive = AdaptiveSpeculation(
                args.speculative_num_draft_tokens, adaptive=not args.disable_speculative_adaptive
            )
            self.scheduler.on_release = self._release_speculation

    # -- requests -------------------------------------------------------------------------
    def validate(
        self, prompt_ids: list[int], params: SamplingParams, *, compile_grammar: bool = True
    ) -> None:
        """Raise ValueError with a user-facing message when a request cannot be served
        (without `compile_grammar`, whatever its grammar turns out to be)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        problem = self.scheduler.check_prompt(len(prompt_ids))
        if problem is not None:
            raise ValueError(problem)
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_seq_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_seq_len} tokens, but "
                f"{len(prompt_ids)} prompt tokens plus max_tokens={params.max_tokens} were "
                f"requested ({need})"
            )
        if len(prompt_ids) + params.min_tokens > self.max_seq_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_seq_len} tokens, but "
                f"{len(prompt_ids)} prompt tokens plus min_tokens={params.min_tokens} were "
                f"requested ({len(prompt_ids) + params.min_tokens})"
            )
        params.validate()
        if params.grammar_kind is not None and compile_grammar:
            assert params.grammar is not None
            self.grammars.compile(params.grammar_kind, params.grammar)  # cached: GrammarError

    # -- grammars compiled off the caller's loop (the server) -----------------------------
    def grammar_ready(self, kind: str, value: str) -> bool:
        """Whether `add_request` would find this grammar compiled (no compile in the call)."""
        return self.grammars.has(kind, value)

    def request_grammar(self, kind: str, value: str) -> None:
        """Start compiling a grammar in the compile worker; `finished_grammars` reports it."""
        if self._compiles is None:
            self._compiles = GrammarCompileService(self.grammars, self.args.grammar_compile_timeout)
        self._compiles.submit(kind, value)

    def cancel_grammar(self, kind: str, value: str) -> None:
        """No request waits for this grammar any more: its compile is skipped or stopped."""
        if self._compiles is not None:
            self._compiles.cancel(kind, value)

    def finished_grammars(self) -> list[CompileOutcome]:
        """Compiles done since the last call (`install_grammar` puts a compiled one to use)."""
        return self._compiles.outcomes() if self._compiles is not None else []

    def install_grammar(self, outcome: CompileOutcome) -> None:
        """Cache a compiled grammar; the grammars evicted for it are noted on the outcome."""
        assert outcome.compiled is not None
        outcome.evicted = self.grammars.install(
            outcome.kind, outcome.value, outcome.compiled, outcome.serialized
        )

    @property
    def grammar_info_json(self) -> str | None:
        """The vocabulary analysis the compile worker made, serialized (for other ranks)."""
        return self._compiles.info_json if self._compiles is not None else None

    def shutdown(self) -> None:
        if self._compiles is not None:
            self._compiles.close()
            self._compiles = None

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.validate(prompt_ids, params)
        if self.is_live(rid):
            raise ValueError(f"request id {rid!r} is already scheduled")
        arrival = time.time() if arrival_time is None else arrival_time
        n = params.n
        reqs = []
        for i in range(n):
            sample = params.sample_params(i) if n > 1 else params
            key = rid if n == 1 else f"{rid}#{i}"
            req = Request(key, list(prompt_ids), sample, arrival_time=arrival, group=rid, index=i)
            req.seed = sample.seed if sample.seed is not None else self.draw_seed()
            if sample.grammar_kind is not None:  # each sample walks its own grammar
                assert sample.grammar is not None
                req.grammar = self.grammars.matcher(sample.grammar_kind, sample.grammar)
            reqs.append(req)
        self.scheduler.add_group(reqs)  # may refuse them (e.g. a duplicate id): record after
        for req in reqs:
            self._arrival[req.rid] = arrival
        if n > 1:
            self._groups[rid] = [r.rid for r in reqs]

    def is_live(self, rid: str) -> bool:
        """Whether request `rid` (any of its samples) is still waiting or running."""
        return rid in self._groups or self.scheduler.get_request(rid) is not None

    def draw_seed(self) -> int:
        """A seed for an unseeded request: from the engine's own stream (EngineArgs.seed)."""
        return self._seed_rng.getrandbits(63)

    def abort_request(self, rid: str, index: int | None = None) -> bool:
        """Drop request `rid` (all its samples, or only sample `index`); False if unknown."""
        keys = self._groups.get(rid, [rid])
        if index is not None:
            keys = [k for i, k in enumerate(keys) if i == index]
        found = False
        for key in keys:
            self._arrival.pop(key, None)
            self._queue_time.pop(key, None)
            found = self.scheduler.abort_request(key) is not None or found
        self._forget_group(rid)
        return found

    def _forget_group(self, rid: str) -> None:
        keys = self._groups.get(rid)
        if keys is not None and all(self.scheduler.get_request(k) is None for k in keys):
            del self._groups[rid]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def num_live_requests(self) -> int:
        """Entries in every per-request map (scheduler and engine): 0 once idle, or a leak."""
        spec = self.adaptive.num_requests if self.adaptive is not None else 0
        return (
            self.scheduler.num_live
            + len(self._arrival)
            + len(self._queue_time)
            + len(self._groups)
            + spec
        )

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule(self._propose if self.speculative else None)
        if batch is None:
            return []
        outputs = self._step(batch)
        if self.prefill_budget is not None:
            prefill = batch.num_prefill_tokens
            budget = self.prefill_budget
            budget.observe(prefill, batch.num_tokens - prefill, time.perf_counter() - started)
            self.scheduler.soft_prefill_tokens = budget.tokens()
        if self.adaptive is not None and all(s.is_decode for s in batch.seqs):
            # Decode and verify steps only: a prefill chunk's cost per token is another regime.
            drafts = sum(len(s.draft_ids) for s in batch.seqs)
            scored = sum(len(s.token_ids) for s in batch.seqs)
            self.adaptive.observe_step(scored, drafts, time.perf_counter() - started)
        return outputs

    def _step(self, batch: ScheduledBatch) -> list[StepOutput]:
        now = time.time()
        for seq in batch.seqs:
            arrival = self._arrival.pop(seq.req.rid, None)
            if arrival is not None:
                self._queue_time[seq.req.rid] = now - arrival
        inp = self._forward_input(batch)
        result = self.runner.forward(inp)
        self._keep_prompt_logprobs(batch, inp, result.prompt_logprobs)
        next_ids = result.tokens
        runs = result.runs
        seqs = [s for s in batch.seqs if s.sample]
        if self.adaptive is not None:  # before any request finishes here and is released
            for seq, run in zip(seqs, runs, strict=True):
                if seq.draft_ids:  # kept as verified, before a stop or max_tokens cut the run
                    kept = max(0, min(len(run) - 1, len(seq.draft_ids)))
                    self.adaptive.verified(seq.req.rid, len(seq.draft_ids), kept)
        sampled = [s.req for s in seqs]
        before = [len(r.output_ids) for r in sampled]
        failed = {r.rid for r, t in zip(sampled, next_ids) if t == INVALID_TOKEN}
        failed_groups = {r.group for r in sampled if r.rid in failed}
        for group in failed_groups:
            # Its pages (every sample's) go back now; process_batch_output skips a request no
            # longer running, and its other samples end with it (the reply is one error).
            self.abort_request(group)
        self._advance_grammars(sampled, runs)
        finished = {r.rid for r in self.scheduler.process_batch_output(batch, runs)}
        if self.drafter is not None:
            self._tell_drafter(batch, result.hidden, failed_groups)
        outputs = []
        reported: set[str] = set()
        for seq, req, old, run, logprobs in zip(
            seqs, sampled, before, runs, result.logprobs, strict=True
        ):
            if req.group in failed_groups:
                if req.group not in reported:  # one error reply per request
                    reported.add(req.group)
                    outputs.append(self._failed_output(req))
                continue
            done = req.rid in finished
            generated = req.params.max_tokens > 0
            new = req.output_ids[old:]  # the run, cut where the request finished
            if logprobs is not None and len(logprobs) > len(new):
                logprobs = logprobs.head(len(new))
            outputs.append(
                StepOutput(
                    rid=req.group,
                    new_token_ids=new if generated else [],
                    finished=done,
                    finish_reason=req.finish_reason if done else None,
                    prompt_tokens=len(req.prompt_ids),
                    cached_tokens=req.num_cached_tokens,
                    completion_tokens=len(req.output_ids),
                    queue_time=self._queue_time.pop(req.rid, None),
                    index=req.index,
                    logprobs=logprobs if generated else None,
                    prompt_logprobs=self._take_prompt_logprobs(req),
                    spec_draft_tokens=len(seq.draft_ids),
                    spec_accepted_tokens=min(len(run) - 1, len(new)),
                )
            )
            if done and req.group in self._groups:
                self._forget_group(req.group)
        return outputs

    def _keep_prompt_logprobs(
        self, batch: ScheduledBatch, inp: ForwardInput, found: list[TokenLogprobs]
    ) -> None:
        owners = [s.req for s in batch.seqs if self._scores_prompt(s.req)]
        for req, part in zip(owners, found, strict=True):
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(part)

    @staticmethod
    def _take_prompt_logprobs(req: Request) -> TokenLogprobs | None:
        """The whole prompt's logprobs, once (then the request keeps no copy)."""
        lp = req.prompt_logprobs
        if lp is None or len(lp) < len(req.prompt_ids):
            return None
        req.prompt_logprobs = None  # every position scored: the prefix cache may serve it
        return lp

    @staticmethod
    def _scores_prompt(req: Request) -> bool:
        lp = req.prompt_logprobs
        return lp is not None and len(lp) < len(req.prompt_ids)

    def _failed_output(self, req: Request) -> StepOutput:
        logger.error("rid=%s: the logits hold NaN or inf; ending the request", req.rid)
        return StepOutput(
            rid=req.group,
            new_token_ids=[],
            finished=True,
            finish_reason="error",
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.num_cached_tokens,
            completion_tokens=len(req.output_ids),
            queue_time=self._queue_time.pop(req.rid, None),
            index=req.index,
            error=SAMPLING_FAILED,
        )

    def _advance_grammars(self, sampled: list[Request], runs: list[list[int]]) -> None:
        """Feed each constrained request's sampled tokens (accepted drafts, then the target's
        own) to its matcher.

        The mask only allowed tokens the matcher accepts, so a refusal is a bug: the request
        then goes on unconstrained rather than failing. Its state lives on the request, so a
        preemption (which recomputes KV but never resamples) leaves it as it is.
        """
        for req, run in zip(sampled, runs):
            for token in run:
                matcher = req.grammar
                if matcher is None or token == INVALID_TOKEN:  # no draw: the request ends anyway
                    break
                if not matcher.accept_token(token):
                    logger.error("rid=%s: the grammar refused sampled token %d", req.rid, token)
                    req.grammar = None
                elif matcher.is_terminated():
                    # It took the end token; with ignore_eos the request goes on, unconstrained.
                    req.grammar = None

    # -- speculative decoding -----------------------------------------------------------------
    def _propose(self, reqs: list[Request]) -> list[list[int]]:
        """Draft tokens for the decoding requests (the scheduler keeps those that fit). Rank 0
        drafts; every rank gets its drafts, so all verify the same tokens."""
        k_max = self.args.speculative_num_draft_tokens
        drafts: list[list[int]] | None = None
        if self.drafter is not None:
            ks = self._draft_lengths(reqs)
            drafts = [list(d[:k]) for d, k in zip(self.drafter.propose(reqs, ks), ks, strict=True)]
            for i, req in enumerate(reqs):
                if req.grammar is not None and drafts[i]:
                    # A token the grammar forbids would be rejected anyway: don't score it.
                    drafts[i] = self.grammars.grammar_prefix(req.grammar, drafts[i])
                if req.params.min_tokens > len(req.output_ids) and drafts[i]:
                    # A stop token min_tokens masks would be rejected anyway: don't score it.
                    drafts[i] = self._drafts_before_stop(req, drafts[i])
        if self.args.tp_size > 1:
            drafts = share_drafts(drafts, len(reqs), k_max)
        assert drafts is not None
        return drafts

    def _drafts_before_stop(self, req: Request, drafts: list[int]) -> list[int]:
        """The drafts before the first that is a stop token at a position min_tokens masks
        (draft j would be output token len(output_ids) + j)."""
        stops = set(self.stop_ids(req.params))
        step = len(req.output_ids)
        for j, t in enumerate(drafts):
            if t in stops and step + j < req.params.min_tokens:
                return drafts[:j]
        return drafts

    def _draft_lengths(self, reqs: list[Request]) -> list[int]:
        """How many drafts to ask for, per request: the adaptive controller's plan for a step
        that, without drafts, scores these decodes and the prefill work waiting beside them."""
        assert self.adaptive is not None
        limits = [r.params.max_tokens - len(r.output_ids) - 1 for r in reqs]
        running = self.scheduler.running
        prefill = sum(r.num_remaining for r in running if r.num_computed < r.prefill_target)
        scored = len(reqs) + min(prefill, self.args.max_prefill_tokens)
        return self.adaptive.plan(
            [r.rid for r in reqs], limits, scored_tokens=scored, emitted_tokens=len(reqs)
        )

    def _release_speculation(self, req: Request) -> None:
        assert self.drafter is not None and self.adaptive is not None
        self.drafter.release(req)
        self.adaptive.release(req.rid)

    def _tell_drafter(self, batch: ScheduledBatch, hidden: object, failed_groups: set[str]) -> None:
        """The drafter learns what each request kept: its accepted drafts, and (for a drafter
        that reads hidden states) the flat rows of this step's positions whose tokens are now
        the request's (their KV is in the cache; the last one predicted the newest token)."""
        assert self.drafter is not None
        reqs, accepted, rows = [], [], []
        offset = 0
        for seq in batch.seqs:
            req = seq.req
            if req.group not in failed_groups and req.status in ("running", "finished"):
                kept = req.num_computed - seq.start  # set before any release
                reqs.append(req)
                accepted.append(max(0, min(len(seq.draft_ids), kept - 1)) if seq.draft_ids else 0)
                rows.append(range(offset, offset + kept))
            offset += len(seq.token_ids)
        if self.drafter.needs_hidden_states:
            self.drafter.accepted(reqs, accepted, hidden, rows)  # type: ignore[arg-type]
        else:
            self.drafter.accepted(reqs, accepted, None, None)

    def _grammar_bitmask(
        self, reqs: list[Request], drafts: list[list[int]] | None
    ) -> tuple[object, list[int]] | None:
        """The sampled rows' token bitmask and its constrained rows, or None when none is.
        With drafts, a request's rows are its positions: one, then one past each draft."""
        widths = [1] * len(reqs) if drafts is None else [1 + len(d) for d in drafts]
        starts = [sum(widths[:i]) for i in range(len(reqs))]
        rows = [
            starts[i] + j
            for i, r in enumerate(reqs)
            if r.grammar is not None
            for j in range(widths[i])
        ]
        if not rows:
            return None
        return self.grammars.fill_bitmask([r.grammar for r in reqs], drafts), rows

    def _forward_input(self, batch: ScheduledBatch) -> ForwardInput:
        prefix_lens, extend_lens, page_tables = batch.layout_lists()
        rows = [i for i, s in enumerate(batch.seqs) if s.sample]
        reqs = [batch.seqs[i].req for i in rows]
        drafts: list[list[int]] | None = [batch.seqs[i].draft_ids for i in rows]
        if not any(drafts or ()):
            drafts = None
        mask = self._grammar_bitmask(reqs, drafts)
        bans = None
        if any(r.params.min_tokens for r in reqs):  # a plain batch pays this one pass only
            bans = self._min_tokens_bans(reqs, drafts, mask)
        return ForwardInput(
            stop_bans=bans,
            sample_drafts=drafts,
            grammar_bitmask=mask[0] if mask else None,
            grammar_rows=mask[1] if mask else None,
            token_ids=[t for s in batch.seqs for t in s.token_ids],
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_tables=page_tables,
            sample_rows=rows,
            sample_params=[r.params for r in reqs],
            sample_steps=[len(r.output_ids) for r in reqs],
            sample_seeds=[r.seed or 0 for r in reqs],
            sample_states=reqs if any(r.params.has_penalties for r in reqs) else None,
            prompt_rows=self._prompt_rows(batch),
            # EAGLE-3 (rank 0, which drafts): the target layers its head reads, every step.
            capture_layers=getattr(self.drafter, "capture_layers", ()),
        )

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """The tokens min_tokens holds back: EOS (with ignore_eos too, as vLLM) and the
        request's stop_token_ids (those inside the vocabulary)."""
        ids = dict.fromkeys(self.eos_token_ids + params.stop_token_ids)
        return [t for t in ids if 0 <= t < self.vocab_size]

    def _min_tokens_bans(
        self,
        reqs: list[Request],
        drafts: list[list[int]] | None,
        mask: tuple[object, list[int]] | None,
    ) -> tuple[list[int], list[int]] | None:
        """min_tokens: the stop tokens each sampled row must not draw (see penalties.py)."""
        bitmask = mask[0] if mask is not None else None
        grammar_rows: set[int] = set(mask[1]) if mask is not None else set()

        def forced_end(row: int, ids: Sequence[int]) -> bool:
            # Where a grammar allows only a stop token (it is complete), the grammar wins.
            return row in grammar_rows and only_allows(bitmask[row], ids)  # type: ignore[index]

        return min_tokens_bans(
            [len(r.output_ids) for r in reqs],
            [1] * len(reqs) if drafts is None else [1 + len(d) for d in drafts],
            [r.params.min_tokens for r in reqs],
            [self.stop_ids(r.params) if r.params.min_tokens else [] for r in reqs],
            forced_end if grammar_rows else None,
        )

    def _prompt_rows(self, batch: ScheduledBatch) -> list[PromptRows]:
        """The positions of this step whose logits score a prompt token (the next one)."""
        out = []
        offset = 0
        for seq in batch.seqs:
            req = seq.req
            if self._scores_prompt(req):
                assert req.prompt_logprobs is not None
                # Position p predicts token p + 1; tokens [0, scored) are done.
                first = max(seq.start, len(req.prompt_logprobs) - 1)
                end = min(seq.start + len(seq.token_ids), len(req.prompt_ids) - 1)
                assert seq.start <= len(req.prompt_logprobs) - 1, "an unscored position"
                k = req.params.prompt_logprobs or 0
                targets = req.prompt_ids[first + 1 : end + 1] if end > first else []
                out.append(PromptRows(offset + first - seq.start, targets, k))
            offset += len(seq.token_ids)
        return out
