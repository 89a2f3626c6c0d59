"""`LLM.generate` and the server give the same text for the same request: one rule for what a
stop string or a stop token leaves in the output (vLLM's), on both paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from harness import ServerProcess

from minisgl import LLM, SamplingParams

PROMPTS = ("Hello", "The weather", "1, 2, 3", "Dear friend")


def test_offline_and_served_outputs_are_identical(
    server: ServerProcess, tiny_model_dir: Path, hf_tokenizer: Any
) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=256)
    url = f"{server.url}/v1/completions"
    compared = 0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        base: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
        free = llm.generate([ids], SamplingParams(**base))[0]
        text = free.text
        cases: list[dict[str, Any]] = [{"stop_token_ids": [free.token_ids[4]]}]
        if len(text) >= 6:
            cases.append({"stop": [text[len(text) // 2 : len(text) // 2 + 2]]})
        for case in cases:
            for include in (False, True):
                kw = {**base, **case, "include_stop_str_in_output": include}
                offline = llm.generate([ids], SamplingParams(**kw))[0]
                r = httpx.post(url, json={"prompt": ids, **kw}, timeout=60)
                assert r.status_code == 200, r.text
                served = r.json()["choices"][0]
                assert (served["text"], served["finish_reason"]) == (
                    offline.text,
                    offline.finish_reason,
                ), (prompt, kw)
                assert offline.finish_reason == "stop"
                compared += 1
        # The stop token's own text is shown only when asked for.
        stop_tok = free.token_ids[4]
        upto = free.token_ids[: free.token_ids.index(stop_tok)]
        kw = {**base, "stop_token_ids": [stop_tok]}
        assert llm.generate([ids], SamplingParams(**kw))[0].text == hf_tokenizer.decode(
            upto, skip_special_tokens=True
        )
    assert compared >= 2 * len(PROMPTS)
    server.wait_idle(within=10.0)
