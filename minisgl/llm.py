"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.config import RENAMED_FIELDS, EngineArgs
from minisgl.engine.engine import Engine, StepOutput
from minisgl.engine.factory import create_engine, shutdown_engine
from minisgl.logprobs import TokenLogprobs
from minisgl.sampling_params import SamplingParams
from minisgl.tokenizer.incremental import IncrementalDecoder


@dataclass
class CompletionOutput:
    """One sample of a prompt (n > 1 gives several)."""

    index: int
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: TokenLogprobs | None = None  # per generated token, with SamplingParams.logprobs


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only (of the first sample)
    text: str
    finish_reason: str  # "stop" | "length"
    outputs: list[CompletionOutput] = field(default_factory=list)  # every sample, by index
    logprobs: TokenLogprobs | None = None  # the first sample's
    # With SamplingParams.prompt_logprobs: one entry per prompt token (the first is None).
    prompt_logprobs: TokenLogprobs | None = None


class LLM:
    """Run a Qwen3 model in this process, with the same engine the server uses."""

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        num_pages: int | None = None,
        page_size: int | None = None,
        max_seq_len: int | None = None,
        tp_size: int = 1,
        **engine_kwargs: Any,
    ) -> None:
        for old, new in RENAMED_FIELDS.items():  # e.g. cpu_int4_activations, the old name
            if old in engine_kwargs:
                engine_kwargs.setdefault(new, engine_kwargs.pop(old))
        # Offline, nobody waits for a first token: a batch's prefill is not split for one.
        engine_kwargs.setdefault("prefill_chunk_overhead", 0.0)
        given = dict(
            model=model,
            dtype=dtype,
            device=device,
            num_pages=num_pages,
            page_size=page_size,
            max_seq_len_override=max_seq_len,
            tp_size=tp_size,
            **engine_kwargs,
        )
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = set(given) - names
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        self.args = EngineArgs(**{k: v for k, v in given.items() if v is not None})
        self.engine: Engine = create_engine(self.args)
        self._tokenizer: Any = None
        self._next_call = 0
        # One call steps the engine at a time: the engine is not thread-safe, and a call that
        # stepped it would be handed another thread's outputs. Calls from threads take turns.
        self._lock = threading.RLock()
        self._closed = False  # shutdown() was called

    def shutdown(self) -> None:
        """Stop the tensor-parallel follower processes (also done at exit). The LLM is
        closed then: generate() raises."""
        with self._lock:
            self._closed = True
            shutdown_engine(self.engine)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    from transformers import AutoTokenizer

                    path = str(self.engine.model_path)
                    self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); outputs in input order.
        Safe to call from several threads: the calls run one after the other."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = _per_prompt(sampling_params, len(prompts))
        texts: list[str | None] = []
        prompt_ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts.append(p)
                prompt_ids.append(list(self.tokenizer.encode(p)))
            elif isinstance(p, Iterable) and not isinstance(p, bytes | dict):
                texts.append(None)
                prompt_ids.append([_token_id(t, i) for t in p])
            else:
                raise TypeError(
                    f"prompt {i} has type {type(p).__name__}: each prompt is a string or a list "
                    "of token ids (one prompt of ids is [[1, 2, 3]], not [1, 2, 3])"
                )
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    "this LLM was shut down (shutdown() or the end of its with block)"
                )
            return self._generate(texts, prompt_ids, params_list, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations, as vLLM's `LLM.chat`: `messages` is one
        conversation (a list of {"role", "content"} dicts) or a list of them. Each is rendered
        with the model's own chat template exactly as the server's /v1/chat/completions does
        (same message rules, `chat_template_kwargs` such as enable_thinking, tools), then
        generated as generate() does; outputs (raw text, in input order) like generate()'s.
        add_generation_prompt: True unless continue_final_message (the model goes on from the
        last message, an assistant's). A request's own template (`chat_template`) is refused,
        as the server refuses it: only the model's template renders. Bad input: ValueError."""
        conversations = _conversations(messages)
        texts: list[str | None] = []
        prompt_ids: list[list[int]] = []
        for conv in conversations:
            text = self._render_chat(
                conv,
                dict(chat_template_kwargs or {}),
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template,
            )
            texts.append(text)
            prompt_ids.append(list(self.tokenizer.encode(text, add_special_tokens=False)))
        params_list = _per_prompt(sampling_params, len(conversations))
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    "this LLM was shut down (shutdown() or the end of its with block)"
                )
            return self._generate(texts, prompt_ids, params_list, use_tqdm)

    def _render_chat(
        self,
        conversation: list[Mapping[str, Any]],
        kwargs: dict[str, Any],
        add_generation_prompt: bool | None,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template: str | None,
    ) -> str:
        """The prompt text of one conversation, through the server's request model and rules."""
        from pydantic import ValidationError

        from minisgl.server.chat_prompt import chat_prompt
        from minisgl.server.errors import APIError
        from minisgl.server.protocol import ChatCompletionRequest
        from minisgl.structured.template_kwargs import TEMPLATE_PARAM
        from minisgl.tokenizer.chat_render import render_chat

        body: dict[str, Any] = {
            "messages": list(conversation),
            "chat_template_kwargs": kwargs,
            "continue_final_message": continue_final_message,
        }
        if add_generation_prompt is not None:
            body["add_generation_prompt"] = add_generation_prompt
        if tools is not None:
            body["tools"] = list(tools)
        if chat_template is not None:
            body["chat_template"] = chat_template
        try:
            req = ChatCompletionRequest.model_validate(body)
            prompt = chat_prompt(req, trusted=False)
        except ValidationError as exc:
            raise ValueError(_first_problem(exc)) from None
        except APIError as exc:
            if exc.param is not None and exc.param.endswith(TEMPLATE_PARAM):
                raise ValueError(
                    f"{exc.param} is refused: LLM.chat renders only the model's own chat "
                    "template (no request-supplied templates)"
                ) from None
            raise ValueError(exc.message) from None
        return render_chat(
            self.tokenizer,
            prompt.messages,
            prompt.template_kwargs,
            prompt.tools,
            prompt.add_generation_prompt,
        )

    def _generate(
        self,
        texts: list[str | None],
        prompt_ids: list[list[int]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        for ids, params in zip(prompt_ids, params_list):
            self.engine.validate(ids, params)
        call = self._next_call
        self._next_call += 1
        rids = [f"offline-{call}-{i}" for i in range(len(prompt_ids))]
        try:
            for rid, ids, params in zip(rids, prompt_ids, params_list):
                self.engine.add_request(rid, ids, params)
            return self._run(rids, texts, prompt_ids, params_list, use_tqdm)
        finally:
            # Interrupted (Ctrl-C, an exception): leave nothing of this call in the engine,
            # or a later call would get its outputs. Finished requests are unknown: a no-op.
            for rid in rids:
                self.engine.abort_request(rid)

    def _decoder(self, params: SamplingParams) -> IncrementalDecoder:
        """The server's detokenizer rules: the same stop strings, hidden tokens and cuts."""
        hidden = list(params.stop_token_ids)
        if not params.ignore_eos:
            hidden += list(self.engine.eos_token_ids)
        return IncrementalDecoder(
            self.tokenizer,
            stop=params.stop,
            hidden_token_ids=hidden,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def _run(
        self,
        rids: list[str],
        texts: list[str | None],
        prompt_ids: list[list[int]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        index = {rid: i for i, rid in enumerate(rids)}
        samples = [[_Sample(self._decoder(p)) for _ in range(p.n)] for p in params_list]
        prompt_lps: list[TokenLogprobs | None] = [None] * len(rids)
        left = [p.n for p in params_list]
        results: list[RequestOutput | None] = [None] * len(rids)
        bar = _progress(len(rids), use_tqdm)
        while any(r is None for r in results):
            outs = self.engine.step()
            if not outs and not self.engine.has_unfinished():
                raise RuntimeError("the engine stopped with requests unanswered")
            for out in outs:
                i = index[out.rid]
                if out.error is not None:
                    raise RuntimeError(f"prompt {i}: {out.error}")
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                one = samples[i][out.index]
                if one.done is not None:
                    continue  # stopped by a stop string: its abort is on the way
                if self._take(one, out):
                    left[i] -= 1
                if left[i]:
                    continue
                results[i] = self._result(texts[i], prompt_ids[i], samples[i], prompt_lps[i])
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [r for r in results if r is not None]

    def _take(self, one: _Sample, out: StepOutput) -> bool:
        """Add a step's output to its sample; True once the sample is complete."""
        one.tokens += out.new_token_ids
        if out.logprobs is not None:
            one.logprobs = one.logprobs or TokenLogprobs()
            one.logprobs.extend(out.logprobs)
        dec = one.decoder
        if not out.finished and not dec.stop:
            return False  # without stop strings, the text is decoded once, at the end
        dec.feed(
            one.tokens[dec.num_tokens :], finished=out.finished, finish_reason=out.finish_reason
        )
        if dec.stopped:
            # A run of several tokens may go past the stop string: keep those up to it.
            del one.tokens[dec.num_tokens :]
            if one.logprobs is not None:
                one.logprobs = one.logprobs.head(dec.num_tokens)
        if dec.stopped and not out.finished:
            self.engine.abort_request(out.rid, out.index)  # the engine would keep generating
        if not (out.finished or dec.stopped):
            return False
        one.done = "stop" if dec.stopped else str(out.finish_reason)
        return True

    @staticmethod
    def _result(
        prompt: str | None,
        prompt_ids: list[int],
        samples: list[_Sample],
        prompt_logprobs: TokenLogprobs | None,
    ) -> RequestOutput:
        outputs = [
            CompletionOutput(j, s.tokens, s.decoder.text, s.done or "stop", s.logprobs)
            for j, s in enumerate(samples)
        ]
        first = outputs[0]
        return RequestOutput(
            prompt,
            prompt_ids,
            first.token_ids,
            first.text,
            first.finish_reason,
            outputs,
            first.logprobs,
            prompt_logprobs,
        )


@dataclass
class _Sample:
    decoder: IncrementalDecoder  # the server's text rules (stop strings, hidden tokens)
    tokens: list[int] = field(default_factory=list)
    logprobs: TokenLogprobs | None = None
    done: str | None = None  # the finish reason, once complete


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _token_id(t: Any, prompt: int) -> int:
    if isinstance(t, bool | float | str | bytes) or not hasattr(t, "__index__"):
        raise TypeError(f"prompt {prompt} holds {t!r}: token ids are integers")
    return int(t)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")


def _conversations(messages: Any) -> list[list[Mapping[str, Any]]]:
    """One conversation (a list of message dicts) or several (a list of such lists)."""
    if isinstance(messages, Mapping | str | bytes):
        raise TypeError(
            "messages is a conversation (a list of {'role', 'content'} dicts) or a list of them"
        )
    items = list(messages)
    if not items:
        raise ValueError("messages must not be empty")
    if all(isinstance(m, Mapping) for m in items):
        return [items]
    for i, conv in enumerate(items):
        if isinstance(conv, Mapping | str | bytes) or not isinstance(conv, Iterable):
            raise TypeError(
                f"messages[{i}] has type {type(conv).__name__}: give one conversation (a list "
                "of message dicts) or a list of conversations, not a mix"
            )
    return [list(conv) for conv in items]


def _first_problem(exc: Any) -> str:
    """A pydantic ValidationError as one line naming the field (as the server's 400s do)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err.get('msg', 'invalid value')}" if where else str(err.get("msg"))
