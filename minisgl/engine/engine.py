"""Engine: the scheduler's bookkeeping plus the model runner, one `step()` at a time.

Token-level only: the engine knows token ids, never text (stop strings are handled by the
caller: `LLM.generate` or the detokenizer worker, which aborts a request once it has hit one).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from minisgl.config import EngineArgs
from minisgl.engine.model_runner import ForwardInput, ModelRunner
from minisgl.layers.sampling import INVALID_TOKEN
from minisgl.models.config import ModelConfig
from minisgl.models.loader import resolve_model_path
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.request import Request
from minisgl.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerStats
from minisgl.structured.grammar import GrammarBackend

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
        self.grammars = GrammarBackend(
            str(self.model_path), self.vocab_size, self.eos_token_ids
        )  # sets itself up in the background
        self._seed_rng = random.Random(args.seed)
        self._arrival: dict[str, float] = {}  # rid -> arrival, until first scheduled
        self._queue_time: dict[str, float] = {}  # rid -> queue time, until its first token

    # -- requests -------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a user-facing message when a request cannot be served."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        problem = self.scheduler.check_prompt(len(prompt_ids))
        if problem is not None:
            raise ValueError(problem)
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_seq_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_seq_len} tokens, but "
                f"{len(prompt_ids)} prompt tokens plus max_tokens={params.max_tokens} were "
                f"requested ({need})"
            )
        params.validate()
        if params.grammar_kind is not None:
            assert params.grammar is not None
            self.grammars.compile(params.grammar_kind, params.grammar)  # cached: GrammarError

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.validate(prompt_ids, params)
        arrival = time.time() if arrival_time is None else arrival_time
        req = Request(rid, list(prompt_ids), params, arrival_time=arrival)
        req.seed = params.seed if params.seed is not None else self.draw_seed()
        if params.grammar_kind is not None:
            assert params.grammar is not None
            req.grammar = self.grammars.matcher(params.grammar_kind, params.grammar)
        self.scheduler.add_request(req)  # may refuse it (e.g. a duplicate id): record after
        self._arrival[rid] = arrival

    def draw_seed(self) -> int:
        """A seed for an unseeded request: from the engine's own stream (EngineArgs.seed)."""
        return self._seed_rng.getrandbits(63)

    def abort_request(self, rid: str) -> bool:
        self._arrival.pop(rid, None)
        self._queue_time.pop(rid, None)
        return self.scheduler.abort_request(rid) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def num_live_requests(self) -> int:
        """Entries in every per-request map (scheduler and engine): 0 once idle, or a leak."""
        return self.scheduler.num_live + len(self._arrival) + len(self._queue_time)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        now = time.time()
        for seq in batch.seqs:
            arrival = self._arrival.pop(seq.req.rid, None)
            if arrival is not None:
                self._queue_time[seq.req.rid] = now - arrival
        next_ids = self.runner.forward(self._forward_input(batch))
        sampled = [s.req for s in batch.seqs if s.sample]
        failed = {r.rid for r, t in zip(sampled, next_ids) if t == INVALID_TOKEN}
        for rid in failed:
            # Its pages go back now; process_batch_output skips a request no longer running.
            self.scheduler.abort_request(rid)
        self._advance_grammars(sampled, next_ids)
        finished = {r.rid for r in self.scheduler.process_batch_output(batch, next_ids)}
        outputs = []
        for req, token in zip(sampled, next_ids):
            if req.rid in failed:
                outputs.append(self._failed_output(req))
                continue
            done = req.rid in finished
            outputs.append(
                StepOutput(
                    rid=req.rid,
                    new_token_ids=[token],
                    finished=done,
                    finish_reason=req.finish_reason if done else None,
                    prompt_tokens=len(req.prompt_ids),
                    cached_tokens=req.num_cached_tokens,
                    completion_tokens=len(req.output_ids),
                    queue_time=self._queue_time.pop(req.rid, None),
                )
            )
        return outputs

    def _failed_output(self, req: Request) -> StepOutput:
        logger.error("rid=%s: the logits hold NaN or inf; ending the request", req.rid)
        return StepOutput(
            rid=req.rid,
            new_token_ids=[],
            finished=True,
            finish_reason="error",
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.num_cached_tokens,
            completion_tokens=len(req.output_ids),
            queue_time=self._queue_time.pop(req.rid, None),
            error=SAMPLING_FAILED,
        )

    def _advance_grammars(self, sampled: list[Request], next_ids: list[int]) -> None:
        """Feed each constrained request's sampled token to its matcher.

        The mask only allowed tokens the matcher accepts, so a refusal is a bug: the request
        then goes on unconstrained rather than failing. Its state lives on the request, so a
        preemption (which recomputes KV but never resamples) leaves it as it is.
        """
        for req, token in zip(sampled, next_ids):
            matcher = req.grammar
            if matcher is None or token == INVALID_TOKEN:  # no draw: the request ends anyway
                continue
            if not matcher.accept_token(token):
                logger.error("rid=%s: the grammar refused sampled token %d", req.rid, token)
                req.grammar = None
            elif matcher.is_terminated():
                # It took the end token; with ignore_eos the request goes on, unconstrained.
                req.grammar = None

    def _grammar_bitmask(self, reqs: list[Request]) -> tuple[object, list[int]] | None:
        """The sampled rows' token bitmask and its constrained rows, or None when none is."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        return self.grammars.fill_bitmask([r.grammar for r in reqs]), rows

    def _forward_input(self, batch: ScheduledBatch) -> ForwardInput:
        prefix_lens, extend_lens, page_tables = batch.layout_lists()
        rows = [i for i, s in enumerate(batch.seqs) if s.sample]
        reqs = [batch.seqs[i].req for i in rows]
        mask = self._grammar_bitmask(reqs)
        return ForwardInput(
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
        )
