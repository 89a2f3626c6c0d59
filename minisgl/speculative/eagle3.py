"""The EAGLE-3 draft head in the layout SpecForge trains and SGLang serves
(`architectures: ["LlamaForCausalLMEagle3"]`), in plain PyTorch (CPU and CUDA).

One Llama decoder layer reads, per position i, the embedding of token i + 1 next to a hidden
state of position i, and predicts token i + 2:
- the hidden state is the target's: three of its layers' outputs side by side, [3 * target
  hidden], projected by `fc` to the head's width; or, chaining drafts, the head's own output of
  the previous position (pre-norm, already the head's width);
- `input_layernorm` normalises the embedding, `hidden_norm` the hidden state; their
  concatenation (2 * hidden wide) feeds q/k/v; the residual stream starts at the hidden state;
- `norm` + `lm_head` give logits over a smaller draft vocabulary; `d2t[i]` is what to add to
  draft id i to get the target's id (`t2d` marks the target ids the draft vocabulary has).

Checkpoint tensors: fc.weight, midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
input_layernorm, hidden_norm, post_attention_layernorm}.weight, norm.weight, lm_head.weight,
d2t and t2d (optional when draft_vocab_size is the target's), and optionally embed_tokens.weight
(otherwise the target's embedding is used). Each one is read or refused by name; a tensor the
head does not have is refused too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers import cpu_linear
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.linear import LinearBase
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding, apply_rotary
from minisgl.models.config import ModelConfig

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
EMBED = "embed_tokens.weight"
VOCAB_MAPS = {"d2t", "t2d"}


@dataclass(frozen=True)
class Eagle3Config:
    """A head's config.json: its decoder layer's shape (read as a Llama config, so rope and
    head_dim defaults are transformers' own) plus the EAGLE-3 keys."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # eagle_config's; None: SGLang's default
    fc_bias: bool

    @classmethod
    def from_dir(cls, path: str | Path) -> Eagle3Config:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"draft model directory {path} has no config.json")
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Eagle3Config:
        archs = list(raw.get("architectures") or [])
        if ARCHITECTURE not in archs:
            raise ValueError(
                f"the draft model's config.json names architectures {archs}; "
                f"--speculative-algorithm eagle3 needs an {ARCHITECTURE} head"
            )
        layers = int(raw.get("num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(
                f"the EAGLE-3 head declares num_hidden_layers={layers}; minisgl runs the "
                "published one-layer heads"
            )
        layer = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get(
            "eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids")
        )
        return cls(
            layer=layer,
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
            fc_bias=bool(raw.get("bias", False)),
        )


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SGLang's choice when the head names none: the outputs of layers 1, L/2 - 1 and L - 4
    (it captures the inputs of layers 2, L // 2 and L - 3)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def capture_layers(cfg: Eagle3Config, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose outputs the head reads, in the order `fc` takes them (ascending
    layer, as SGLang concatenates them); refused when they do not fit the target."""
    named = cfg.aux_layer_ids is not None
    ids = (
        cfg.aux_layer_ids
        if cfg.aux_layer_ids is not None
        else default_aux_layers(target.num_hidden_layers)
    )
    source = (
        "the head's eagle_config.eagle_aux_hidden_state_layer_ids"
        if named
        else "the default for a head naming none (outputs of layers 1, L/2-1, L-4)"
    )
    if len(ids) != 3:
        raise ValueError(f"an EAGLE-3 head reads 3 target layers; {source} lists {list(ids)}")
    bad = [i for i in ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ValueError(
            f"{source} is {list(ids)}, but the target has {target.num_hidden_layers} layers "
            f"(0..{target.num_hidden_layers - 1}); set eagle_config."
            "eagle_aux_hidden_state_layer_ids in the head's config.json"
        )
    return tuple(sorted(ids))


def expected_tensors(cfg: Eagle3Config, vocab_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, the config.json values it follows from), embed_tokens excepted."""
    c = cfg.layer
    h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    hid = f"hidden_size={h}"
    q_why = f"num_attention_heads={c.num_attention_heads} x head_dim={d}, 2 x {hid}"
    kv_why = f"num_key_value_heads={c.num_key_value_heads} x head_dim={d}, 2 x {hid}"
    mlp_why = f"intermediate_size={inter}, {hid}"
    out = {
        "fc.weight": ((h, 3 * cfg.target_hidden_size), f"{hid}, 3 x target hidden size"),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), q_why),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), kv_why),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), kv_why),
        "midlayer.self_attn.o_proj.weight": ((h, q), f"{hid}, {q_why.split(',')[0]}"),
        "midlayer.mlp.gate_proj.weight": ((inter, h), mlp_why),
        "midlayer.mlp.up_proj.weight": ((inter, h), mlp_why),
        "midlayer.mlp.down_proj.weight": ((h, inter), mlp_why),
        "midlayer.input_layernorm.weight": ((h,), hid),
        "midlayer.hidden_norm.weight": ((h,), hid),
        "midlayer.post_attention_layernorm.weight": ((h,), hid),
        "norm.weight": ((h,), hid),
        "lm_head.weight": ((cfg.draft_vocab_size, h), f"draft_vocab_size={cfg.draft_vocab_size}"),
        "d2t": ((cfg.draft_vocab_size,), f"draft_vocab_size={cfg.draft_vocab_size}"),
        "t2d": ((vocab_size,), f"vocab_size={vocab_size}"),
    }
    if cfg.fc_bias:
        out["fc.bias"] = ((h,), f"bias=true, {hid}")
    return out


class _Linear(LinearBase):
    """One unsharded matmul (the head is small: every rank that drafts holds all of it); on
    CPU it takes the kernel measured fastest for its shape, as the target's layers do."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, 0, 1, bias)
        self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul_bias(x)


class _Embedding(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Eagle3Head(nn.Module):
    """The head's weights and its per-token math; the drafter owns the attention context."""

    draft_to_target: torch.Tensor  # [draft vocab] target id of each draft id (d2t applied)

    def __init__(self, cfg: Eagle3Config, vocab_size: int, max_positions: int) -> None:
        super().__init__()
        c = cfg.layer
        h, d = c.hidden_size, c.head_dim
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            d,
        )
        self.fc = _Linear(3 * cfg.target_hidden_size, h, bias=cfg.fc_bias)
        # q, k and v fused: one matmul over the [embedding, hidden] concatenation.
        self.qkv = _Linear(2 * h, (self.num_heads + 2 * self.num_kv_heads) * d, bias=False)
        self.o_proj = _Linear(self.num_heads * d, h, bias=False)
        self.gate_up = _Linear(h, 2 * c.intermediate_size, bias=False)
        self.down = _Linear(c.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = _Linear(h, cfg.draft_vocab_size, bias=False)
        self.lm_head.kernel_out_dtype = torch.float32  # argmax over float32 logits is fast
        self.embed = _Embedding(vocab_size, h)
        self.register_buffer("draft_to_target", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.rotary = RotaryEmbedding(
            d, c.rope_theta, c.rope_scaling, max(c.max_position_embeddings, max_positions)
        )
        self.scale = d**-0.5

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's captured layers [T, 3 * target hidden] -> the head's width."""
        return self.fc(features)

    def qkv_rows(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] (q and k rotated) of the pairs (token i + 1,
        hidden state of position i) at `positions`."""
        x = torch.cat((self.input_layernorm(self.embed(tokens)), self.hidden_norm(hidden)), -1)
        t, d, hq, hkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv(x)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q = apply_rotary(qkv[:, : hq * d].view(t, hq, d), cos, sin)
        k = apply_rotary(qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d), cos, sin)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One request's queries q [n, Hq, D], the last n of its keys k/v [L, Hkv, D] (all
        earlier keys its context), causally -> [n, Hq * D]."""
        n, total = q.shape[0], k.shape[0]
        if n == 1:  # a chained draft: two small matmuls beat an SDPA call (~ms on CPU)
            return self._attend_one(q[0], k, v)
        mask = None
        if n > 1:
            rows = torch.arange(total - n, total, device=q.device)[:, None]
            mask = torch.arange(total, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [Hq, D] over k/v [L, Hkv, D] -> [1, Hq * D]; scores in float32."""
        hkv, d = self.num_kv_heads, self.head_dim
        qg = q.view(hkv, self.num_heads // hkv, d).float()  # query heads grouped by KV head
        scores = torch.matmul(qg, k.permute(1, 2, 0).float()) * self.scale  # [Hkv, g, L]
        o = torch.matmul(scores.softmax(-1), v.transpose(0, 1).float())  # [Hkv, g, D]
        return o.to(q.dtype).reshape(1, self.num_heads * d)

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output (pre-norm, [T, hidden]): what chains into the next draft step."""
        h, residual = self.post_attention_layernorm.add_forward(self.o_proj(attn), hidden)
        return self.down(silu_and_mul(self.gate_up(h))) + residual

    def next_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids) [T] from layer outputs [T, hidden]."""
        return self.draft_to_target[self.lm_head(self.norm(out)).float().argmax(-1)]

    # -- weights ---------------------------------------------------------------------------

    def load_tensor(self, name: str, t: torch.Tensor) -> None:
        """Copy one checkpoint tensor (a name expected_tensors lists, or embed_tokens.weight)."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        with torch.no_grad():
            if name == "d2t":
                ids = t.to(torch.long) + torch.arange(t.shape[0])
                self.draft_to_target.copy_(ids)
                return
            if name == "t2d":
                return  # checked against d2t by the loader
            fused = {
                "midlayer.self_attn.q_proj.weight": (self.qkv.weight, 0, hq * d),
                "midlayer.self_attn.k_proj.weight": (self.qkv.weight, hq * d, hkv * d),
                "midlayer.self_attn.v_proj.weight": (self.qkv.weight, (hq + hkv) * d, hkv * d),
                "midlayer.mlp.gate_proj.weight": (self.gate_up.weight, 0, self.down.in_features),
                "midlayer.mlp.up_proj.weight": (
                    self.gate_up.weight,
                    self.down.in_features,
                    self.down.in_features,
                ),
            }
            if name in fused:
                dst, start, n = fused[name]
                dst[start : start + n].copy_(t)
                return
            plain = {
                "fc.weight": self.fc.weight,
                "midlayer.self_attn.o_proj.weight": self.o_proj.weight,
                "midlayer.mlp.down_proj.weight": self.down.weight,
                "midlayer.input_layernorm.weight": self.input_layernorm.weight,
                "midlayer.hidden_norm.weight": self.hidden_norm.weight,
                "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm.weight,
                "norm.weight": self.norm.weight,
                "lm_head.weight": self.lm_head.weight,
                EMBED: self.embed.weight,
            }
            if self.fc.bias is not None:
                plain["fc.bias"] = self.fc.bias
            plain[name].copy_(t)


def load_eagle3_head(
    path: str | Path,
    target: ModelConfig,
    target_path: Path,
    dtype: torch.dtype,
    device: torch.device,
    cpu_kernel_tuning: str | None = "cached",
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head at `path` on `device` in `dtype`, and the target layers it reads. A head without
    embed_tokens.weight takes the target's (`model.embed_tokens.weight` at `target_path`).
    On CPU its matmuls get measured kernels (`cpu_kernel_tuning` as for the target; None: plain
    F.linear, the weights kept as loaded)."""
    from minisgl.models.loader import checkpoint_files, iter_tensors, tensor_shapes

    path = Path(path)
    cfg = Eagle3Config.from_dir(path)
    layers = capture_layers(cfg, target)
    files = checkpoint_files(path)
    shapes = tensor_shapes(files)
    want = expected_tensors(cfg, target.vocab_size)
    _check(path, cfg, target, shapes, want)
    with torch.device("meta"):
        head = Eagle3Head(cfg, target.vocab_size, target.max_position_embeddings)
    head = head.to_empty(device=device).to(dtype)  # the id buffer stays int64
    head.draft_to_target.copy_(torch.arange(cfg.draft_vocab_size))  # no d2t: the identity
    t2d: torch.Tensor | None = None
    for name, t in iter_tensors(files, progress=False):
        if name == "t2d":
            t2d = t
        head.load_tensor(name, t)
    if EMBED not in shapes:
        head.load_tensor(EMBED, _target_embedding(target_path))
    _check_vocab_maps(path, head.draft_to_target, t2d, target.vocab_size)
    head.eval()
    if cpu_kernel_tuning is not None and device.type == "cpu" and cpu_linear.prepack_enabled():
        mats = [m for m in head.modules() if isinstance(m, _Linear)]
        cpu_linear.prepack_modules(mats, cpu_kernel_tuning)
    logger.info(
        "EAGLE-3 head %s: hidden %d, draft vocabulary %d of %d, reads target layers %s%s",
        path,
        cfg.layer.hidden_size,
        cfg.draft_vocab_size,
        target.vocab_size,
        list(layers),
        "" if EMBED in shapes else ", the target's embedding",
    )
    return head, layers


def _check(
    path: Path,
    cfg: Eagle3Config,
    target: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    want: dict[str, tuple[tuple[int, ...], str]],
) -> None:
    """Refuse, naming the tensor, a head whose tensors do not fit its config or the target."""
    problems = []
    if cfg.layer.vocab_size != target.vocab_size:
        problems.append(
            f"its config.json declares vocab_size={cfg.layer.vocab_size}, the target's "
            f"is {target.vocab_size}"
        )
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(
            f"it reads target hidden states of {cfg.target_hidden_size} (target_hidden_size or "
            f"hidden_size), the target's are {target.hidden_size}"
        )
    if cfg.draft_vocab_size > target.vocab_size:
        problems.append(
            f"draft_vocab_size={cfg.draft_vocab_size} exceeds the target's {target.vocab_size}"
        )
    embed = (target.vocab_size, cfg.layer.hidden_size)
    if EMBED in shapes:
        want = {**want, EMBED: (embed, f"vocab_size, hidden_size={cfg.layer.hidden_size}")}
    elif cfg.layer.hidden_size != target.hidden_size:
        problems.append(
            f"it has no {EMBED} and its hidden_size={cfg.layer.hidden_size} differs from the "
            f"target's {target.hidden_size}, so it cannot share the target's embedding"
        )
    # A full draft vocabulary may leave both maps out (the identity).
    no_maps = cfg.draft_vocab_size == target.vocab_size and not VOCAB_MAPS & set(shapes)
    for name, (shape, why) in want.items():
        if no_maps and name in VOCAB_MAPS:
            continue
        if name not in shapes:
            problems.append(f"it has no tensor {name!r}, which an {ARCHITECTURE} head needs")
        elif tuple(shapes[name]) != shape:
            problems.append(
                f"{name} is {list(shapes[name])}, but config.json implies {list(shape)} ({why})"
            )
    for name in sorted(set(shapes) - set(want)):
        problems.append(f"it has a tensor {name!r} that an {ARCHITECTURE} head does not have")
    if problems:
        raise ValueError(f"EAGLE-3 draft model {path}: " + "; ".join(problems))


def _check_vocab_maps(
    path: Path, draft_to_target: torch.Tensor, t2d: torch.Tensor | None, vocab: int
) -> None:
    """d2t must map into the target vocabulary, one draft id per target id, on exactly the
    target ids t2d marks."""
    ids = draft_to_target.cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(set(ids.tolist())) != len(ids):
        raise ValueError(
            f"EAGLE-3 draft model {path}: d2t does not map the draft ids to distinct target ids "
            f"in 0..{vocab - 1}"
        )
    if t2d is None:  # a full draft vocabulary without the maps: the identity
        return
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[ids] = True
    if not torch.equal(marked, t2d.to(torch.bool)):
        raise ValueError(
            f"EAGLE-3 draft model {path}: t2d does not mark exactly the target ids d2t maps to"
        )


def _target_embedding(target_path: Path) -> torch.Tensor:
    from safetensors import safe_open

    from minisgl.models import gguf
    from minisgl.models.loader import checkpoint_files

    name = "model.embed_tokens.weight"
    files = checkpoint_files(target_path)
    if gguf.is_gguf(files[0]):  # a GGUF target's table, as the target model reads it
        return gguf.GgufFile(files[0]).tensor(name)
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            if name in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                return h.get_tensor(name)
    raise FileNotFoundError(f"target checkpoint {target_path} has no tensor {name!r}")
