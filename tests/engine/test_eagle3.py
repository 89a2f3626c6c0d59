"""EAGLE-3: the draft head loads from the published (SpecForge/SGLang) layout, the target hands
it the outputs of the layers it names, and the drafter's per-request state gives the drafts a
fresh drafter would give for the same history, however the history arrived."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from minisgl.config import EngineArgs
from minisgl.engine.model_runner import ForwardInput, ModelRunner
from minisgl.models.config import ModelConfig
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.request import Request
from minisgl.speculative import make_drafter
from minisgl.speculative.eagle3 import Eagle3Config, capture_layers, load_eagle3_head
from minisgl.speculative.eagle3_drafter import Eagle3Drafter
from minisgl.testing.eagle3_writer import draft_vocabulary, write_eagle3_head

DRAFT_VOCAB = 2048
LAYERS = (0, 1, 1)  # the tiny target has two layers


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eagle3_head(
        tmp_path_factory.mktemp("eagle3-head"),
        tiny_model_dir,
        draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=LAYERS,
    )


def _load(head_dir: Path, target: Path, tuning: str | None = None):
    """The head in float32 on the CPU; tuning None: its weights as loaded (plain F.linear)."""
    cfg = ModelConfig.from_dir(target)
    return load_eagle3_head(head_dir, cfg, target, torch.float32, torch.device("cpu"), tuning)


def test_head_loads_from_the_published_layout(head_dir: Path, tiny_model_dir: Path) -> None:
    from safetensors import safe_open

    head, layers = _load(head_dir, tiny_model_dir)
    assert layers == (0, 1, 1)
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    ids = torch.from_numpy(draft_vocabulary(vocab, DRAFT_VOCAB, 0))
    assert torch.equal(head.draft_to_target, ids)
    # No embed_tokens in the head: the target's is shared.
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(head.embed.weight, f.get_tensor("model.embed_tokens.weight"))
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        q = f.get_tensor("midlayer.self_attn.q_proj.weight")
        assert torch.equal(head.qkv.weight[: q.shape[0]], q)
        assert torch.equal(head.fc.weight, f.get_tensor("fc.weight"))


def test_head_with_its_own_embedding(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    d = write_eagle3_head(
        tmp_path, tiny_model_dir, draft_vocab_size=64, aux_layer_ids=LAYERS, with_embedding=True
    )
    head, _ = _load(d, tiny_model_dir)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert torch.equal(head.embed.weight, f.get_tensor("embed_tokens.weight"))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"extra_tensors": ["midlayer.self_attn.q_norm.weight"]}, "midlayer.self_attn.q_norm"),
        ({"drop_tensors": ["midlayer.hidden_norm.weight"]}, "midlayer.hidden_norm.weight"),
        ({"drop_tensors": ["d2t"]}, "'d2t'"),
    ],
)
def test_a_tensor_too_many_or_missing_is_named(
    tiny_model_dir: Path, tmp_path: Path, kwargs: dict, named: str
) -> None:
    d = write_eagle3_head(
        tmp_path, tiny_model_dir, draft_vocab_size=64, aux_layer_ids=LAYERS, **kwargs
    )
    with pytest.raises(ValueError, match=named):
        _load(d, tiny_model_dir)


def test_a_full_draft_vocabulary_may_leave_out_the_maps(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    d = write_eagle3_head(
        tmp_path,
        tiny_model_dir,
        draft_vocab_size=vocab,
        aux_layer_ids=LAYERS,
        drop_tensors=["d2t", "t2d"],
    )
    head, _ = _load(d, tiny_model_dir)
    assert torch.equal(head.draft_to_target, torch.arange(vocab))
    d = write_eagle3_head(
        tmp_path, tiny_model_dir, draft_vocab_size=vocab, aux_layer_ids=LAYERS, drop_tensors=["t2d"]
    )
    with pytest.raises(ValueError, match="'t2d'"):
        _load(d, tiny_model_dir)


def test_inconsistent_vocabulary_maps_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = write_eagle3_head(tmp_path, tiny_model_dir, draft_vocab_size=64, aux_layer_ids=LAYERS)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["t2d"][int(tensors["d2t"][0])] = False  # draft id 0's target id not marked
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d does not mark"):
        _load(d, tiny_model_dir)


def test_capture_layers_default_and_bounds(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = write_eagle3_head(tmp_path, tiny_model_dir, draft_vocab_size=64)  # names no layers
    cfg = Eagle3Config.from_dir(d)
    target = ModelConfig.from_dir(tiny_model_dir)
    # SGLang's default: outputs of layers 1, L/2 - 1, L - 4 (Qwen3-0.6B: 28 layers).
    deep = ModelConfig(**{**target.__dict__, "num_hidden_layers": 28})
    assert capture_layers(cfg, deep) == (1, 13, 24)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        capture_layers(cfg, target)  # two layers: the default does not fit
    raw = json.loads((d / "config.json").read_text())
    raw["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        Eagle3Config.from_dict(raw)


def test_target_returns_the_named_layers_outputs(tmp_path: Path) -> None:
    """ForwardOutput.hidden holds the outputs of the layers ForwardInput.capture_layers names
    (transformers' hidden_states[i + 1]), in that order, for every token; logits unchanged."""
    import transformers
    from test_model import write_hf_model

    hf = write_hf_model(tmp_path, num_hidden_layers=4)
    args = EngineArgs(
        model=str(tmp_path),
        device="cpu",
        dtype="float32",
        num_pages=32,
        page_size=4,
        cpu_kernel_tuning="off",
    )
    runner = ModelRunner(args, tmp_path, ModelConfig.from_dir(tmp_path), 128)
    seqs = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
    tables = [[0, 1], [2]]

    def step(capture: tuple[int, ...]):
        return runner.forward(
            ForwardInput(
                token_ids=seqs[0] + seqs[1],
                prefix_lens=[0, 0],
                extend_lens=[7, 3],
                page_tables=tables,
                sample_rows=[0, 1],
                sample_params=[SamplingParams(temperature=0)] * 2,
                sample_steps=[0, 0],
                sample_seeds=[0, 0],
                capture_layers=capture,
            )
        )

    plain, captured = step(()), step((2, 0, 2))
    assert plain.hidden is None and captured.tokens == plain.tokens
    assert captured.hidden is not None and captured.hidden.shape == (10, 3 * 64)
    with torch.no_grad():
        assert isinstance(hf, transformers.PreTrainedModel)
        ref = [hf(torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
    for j, layer in enumerate((2, 0, 2)):
        want = torch.cat([r[layer + 1][0] for r in ref])
        got = captured.hidden[:, j * 64 : (j + 1) * 64]
        # fp32 sums in another order than transformers' (our kernels, or oneDNN's AVX-512
        # paths) differ by up to ~3e-4 after a few random layers (seen on an Intel Xeon).
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


# -- the drafter on its own: features stand in for the target's ---------------------------


class History:
    """One request's tokens and the target features of every position, grown as a verify
    step would (accepted drafts + the target's own token)."""

    def __init__(self, rid: str, prompt: list[int], width: int, seed: int) -> None:
        self.req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=64))
        self.gen = torch.Generator().manual_seed(seed)
        self.width = width
        self.features = torch.empty(0, width)

    def compute(self, upto: int) -> list[int]:
        """The target computes positions [num_computed, upto): their feature rows."""
        start = self.req.num_computed
        new = torch.randn(upto - start, self.width, generator=self.gen)
        self.features = torch.cat([self.features[:start], new])
        self.req.num_computed = upto
        return list(range(start, upto))

    def emit(self, tokens: list[int]) -> None:
        self.req.output_ids += tokens


def _feed(drafter: Eagle3Drafter, items: list[tuple[History, list[int]]]) -> None:
    """One step's accepted(): the features of each history's given positions."""
    hidden = torch.cat([h.features[p] for h, p in items])
    rows, at = [], 0
    for _, p in items:
        rows.append(list(range(at, at + len(p))))
        at += len(p)
    drafter.accepted([h.req for h, _ in items], [0] * len(items), hidden, rows)


def test_drafter_proposes_k_valid_deterministic_tokens(
    head_dir: Path, tiny_model_dir: Path
) -> None:
    head, layers = _load(head_dir, tiny_model_dir)
    width = 3 * head.cfg.target_hidden_size

    def drafts() -> list[list[int]]:
        drafter = Eagle3Drafter(head, layers)
        hist = [
            History(f"r{i}", list(range(50 * i, 50 * i + n)), width, i)
            for i, n in enumerate((9, 4, 13))
        ]
        items = []
        for h in hist:
            items.append((h, h.compute(len(h.req.prompt_ids))))
            h.emit([1000 + len(items)])
        _feed(drafter, items)
        return drafter.propose([h.req for h in hist], [4, 0, 2])

    first = drafts()
    assert [len(d) for d in first] == [4, 0, 2]
    assert set(t for d in first for t in d) <= set(head.draft_to_target.tolist())
    assert drafts() == first  # same history, same drafts


def test_partial_acceptance_drafts_as_a_fresh_drafter_would(
    head_dir: Path, tiny_model_dir: Path
) -> None:
    """Verify steps that keep some drafts (and a roll-back that re-sends positions) leave the
    per-request K/V exactly as recomputing the whole history from scratch: the next drafts,
    batched with another request, are those of a new drafter fed everything at once."""
    head, layers = _load(head_dir, tiny_model_dir)
    width = 3 * head.cfg.target_hidden_size
    a = History("a", list(range(100, 111)), width, 1)
    b = History("b", list(range(200, 205)), width, 2)
    live = Eagle3Drafter(head, layers)
    # Prefill: a in two chunks (the first samples nothing), b in one.
    _feed(live, [(a, a.compute(6))])
    pa, pb = a.compute(11), b.compute(5)
    a.emit([7]), b.emit([8])
    _feed(live, [(a, pa), (b, pb)])
    for keep in (2, 0, 4, 1):
        drafts = live.propose([a.req, b.req], [4, 3])
        assert len(drafts[0]) == 4 and len(drafts[1]) == 3
        # a keeps `keep` drafts plus the target's token; b keeps one.
        a.emit(drafts[0][:keep] + [900 + keep])
        b.emit(drafts[1][:1] + [950])
        _feed(live, [(a, a.compute(a.req.num_tokens - 1)), (b, b.compute(b.req.num_tokens - 1))])
    # A roll-back: a's last two positions computed again (new features), re-sent.
    a.req.num_computed -= 2
    _feed(live, [(a, a.compute(a.req.num_tokens - 1))])
    got = live.propose([b.req, a.req], [3, 4])

    fresh = Eagle3Drafter(head, layers)
    for h in (a, b):
        _feed(fresh, [(h, list(range(h.req.num_computed)))])
    want = fresh.propose([b.req, a.req], [3, 4])
    assert got == want
    ctx_a, ctx_b = live._ctx["a"], fresh._ctx["a"]
    assert ctx_a.positions == ctx_b.positions == list(range(a.req.num_tokens - 1))
    assert ctx_a.k is not None and ctx_b.k is not None
    torch.testing.assert_close(ctx_a.k[: ctx_a.n], ctx_b.k[: ctx_b.n], atol=1e-5, rtol=1e-5)


def test_released_and_finished_requests_keep_nothing(head_dir: Path, tiny_model_dir: Path) -> None:
    head, layers = _load(head_dir, tiny_model_dir)
    drafter = Eagle3Drafter(head, layers)
    h = History("x", [1, 2, 3, 4], 3 * head.cfg.target_hidden_size, 0)
    pos = h.compute(4)
    h.emit([5])
    _feed(drafter, [(h, pos)])
    assert len(drafter.propose([h.req], [3])[0]) == 3
    drafter.release(h.req)
    assert drafter._ctx == {}
    assert drafter.propose([h.req], [3]) == [[]]  # nothing known about it: no draft
    h.req.finish_reason = "stop"
    _feed(drafter, [(h, pos)])
    assert drafter._ctx == {}


def test_make_drafter_builds_eagle3_from_the_flags(head_dir: Path, tiny_model_dir: Path) -> None:
    args = EngineArgs(
        model=str(tiny_model_dir),
        speculative_algorithm="eagle3",
        speculative_draft_model_path=str(head_dir),
        cpu_kernel_tuning="off",
    )
    drafter = make_drafter(args, ModelConfig.from_dir(tiny_model_dir), "cpu", torch.float32)
    assert isinstance(drafter, Eagle3Drafter) and drafter.needs_hidden_states
    assert drafter.capture_layers == LAYERS
    no_head = dataclasses.replace(args, speculative_draft_model_path=None)
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        make_drafter(no_head, ModelConfig.from_dir(tiny_model_dir), "cpu", torch.float32)


def test_a_request_not_drafted_for_catches_up_later_to_the_same_drafts(
    head_dir: Path, tiny_model_dir: Path
) -> None:
    """While speculation is off for a request (0 drafts asked) its features wait un-run; the
    first drafts asked for afterwards are those of a drafter that ran them at every step."""
    head, layers = _load(head_dir, tiny_model_dir)
    width = 3 * head.cfg.target_hidden_size
    lazy, eager = Eagle3Drafter(head, layers), Eagle3Drafter(head, layers)
    h = History("r", list(range(300, 310)), width, 4)
    pos = h.compute(10)
    h.emit([5])
    for d in (lazy, eager):
        _feed(d, [(h, pos)])
    for step in range(3):  # plain decode steps: one new position each
        assert lazy.propose([h.req], [0]) == [[]]
        eager.propose([h.req], [2])
        pos = h.compute(h.req.num_tokens)
        h.emit([20 + step])
        for d in (lazy, eager):
            _feed(d, [(h, pos)])
    assert lazy._ctx["r"].positions == []  # nothing run yet
    assert lazy.propose([h.req], [3]) == eager.propose([h.req], [3])
