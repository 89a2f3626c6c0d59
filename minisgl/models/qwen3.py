"""Qwen3 (dense) in plain PyTorch over a paged KV cache, tensor-parallel aware.

The batch arrives flattened: T tokens of all requests in request order, each with its position;
the attention backend knows which tokens belong to which request. Only the rows named by
`sample_indices` (usually each request's last token) go through the final norm and LM head.

The decoder here is shared by the other families (qwen2.py, llama.py, qwen3_moe.py): they
differ in `AttentionOptions` (q/k norm, biases) and in the MLP a layer gets (`make_mlp`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from minisgl.layers import cpu_chain, cpu_linear
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.attention.base import AttentionBackend, AttentionMetadata
from minisgl.layers.attention.torch_backend import TorchAttentionBackend
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from minisgl.layers.moe import FusedMoE, SparseMoeBlock, prepare_routers
from minisgl.layers.norm import RMSNorm, head_rms_norm_rotary
from minisgl.layers.rotary import RotaryEmbedding, apply_rotary
from minisgl.models.config import ModelConfig
from minisgl.quant.weight import QuantWeight

logger = logging.getLogger(__name__)


def plain_submodules(module: nn.Module) -> None:
    """Each direct submodule also as a plain instance attribute, read without nn.Module's
    __getattr__ (a Python call after a failed lookup, per read). A decode step reads ~20 a
    layer, each on cold caches: the matmuls between them stream the caches out. Made once the
    model is loaded (loader.py): assigning a submodule again goes through nn.Module.__setattr__,
    which drops the plain copy first (deleting one, or setting it to None, would not: the
    loading does both, before)."""
    module.__dict__.update(module._modules)


@dataclass(frozen=True)
class AttentionOptions:
    """What the attention block of one family has on top of plain GQA + RoPE."""

    qk_norm: bool = True  # per-head RMSNorm of q and k before the rotation (Qwen3)
    qkv_bias: bool = False
    o_bias: bool = False


class Qwen3Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp_rank: int,
        tp_size: int,
        options: AttentionOptions | None = None,
    ) -> None:
        super().__init__()
        options = options or AttentionOptions()
        self.layer_id = layer_id
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            d,
            config.num_attention_heads,
            config.num_key_value_heads,
            tp_rank,
            tp_size,
            bias=options.qkv_bias,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, tp_rank, tp_size, options.o_bias
        )
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.eps = config.rms_norm_eps
        self._qk_weight: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, d, hq, hkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        # Modules' forward called directly: nn.Module.__call__'s hook checks cost more than
        # a 1-row step's small ops (no hooks are ever set on these).
        qkv = self.qkv_proj.forward(x)
        # q and k heads side by side: one norm and one rotation for both (per-head weights).
        # split_with_sizes: Tensor.split is a Python wrapper in torch around it.
        qk, v = qkv.view(t, hq + 2 * hkv, d).split_with_sizes((hq + hkv, hkv), 1)
        if self.qk_norm:
            qk = head_rms_norm_rotary(qk, self.qk_weight(), self.eps, cos, sin)
        else:
            qk = apply_rotary(qk, cos, sin)
        q, k = qk.split_with_sizes((hq, hkv), 1)
        o = attn.forward(q, k, v, self.layer_id, meta)
        return self.o_proj.forward(o)

    def qk_weight(self) -> torch.Tensor:
        """[Hq + Hkv, D]: q_norm's weight on the query heads, k_norm's on the key heads."""
        w = self._qk_weight
        if w is None or w.device != self.q_norm.weight.device:
            w = torch.cat(
                (
                    self.q_norm.weight.expand(self.num_heads, -1),
                    self.k_norm.weight.expand(self.num_kv_heads, -1),
                )
            )
            self._qk_weight = w
        return w


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [inter, inter], tp_rank, tp_size
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))

    @staticmethod
    def weight_names() -> set[str]:
        return {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}

    def load(self, name: str, t: torch.Tensor) -> bool:
        """`name` relative to the layer's `mlp.`; False for a name that is not ours."""
        if name == "gate_proj.weight":
            self.gate_up_proj.load(t, 0)
        elif name == "up_proj.weight":
            self.gate_up_proj.load(t, 1)
        elif name == "down_proj.weight":
            self.down_proj.load(t)
        else:
            return False
        return True


class Mlp(Protocol):
    """A layer's MLP (dense or mixture of experts): forward, and its own HF weight names."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
    def weight_names(self) -> set[str]: ...
    def load(self, name: str, t: torch.Tensor) -> bool: ...


# (config, layer_id, tp_rank, tp_size) -> the layer's MLP (dense, or mixture of experts)
MlpFactory = Callable[[ModelConfig, int, int, int], nn.Module]


def dense_mlp(config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
    return Qwen3MLP(config, tp_rank, tp_size)


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp_rank: int,
        tp_size: int,
        options: AttentionOptions | None = None,
        make_mlp: MlpFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_id, tp_rank, tp_size, options)
        self.mlp = make_mlp(config, layer_id, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mlp_weights(self) -> Mlp:
        return cast(Mlp, self.mlp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it); the next layer's norm adds the two."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn.forward(h, cos, sin, attn, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp.forward(h), residual


class Qwen3Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp_rank: int,
        tp_size: int,
        options: AttentionOptions | None = None,
        make_mlp: MlpFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank, tp_size
        )
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, tp_rank, tp_size, options, make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model = Qwen3Model(
            config, tp_rank, tp_size, self.attention_options(config), self.make_mlp
        )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qk_norm=True, qkv_bias=bias, o_bias=bias)

    @staticmethod
    def make_mlp(config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module:
        return dense_mlp(config, layer_id, tp_rank, tp_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        sample_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(sample_indices), vocab] (float32) of the rows `sample_indices`."""
        return self._run(input_ids, positions, attn, meta, sample_indices, (), None, head=True)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        indices: torch.Tensor,
        capture: Sequence[int] = (),
        captured: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states [len(indices), hidden] of the rows `indices`: the
        LM head's input, for callers that turn many rows into logits a block at a time.

        `capture`: decoder layers whose output (the residual stream after the layer, before any
        norm; every row) goes into `captured` by layer id, for an EAGLE-3 draft head."""
        return self._run(input_ids, positions, attn, meta, indices, capture, captured, head=False)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        indices: torch.Tensor,
        capture: Sequence[int],
        captured: dict[int, torch.Tensor] | None,
        head: bool,
    ) -> torch.Tensor:
        """hidden_states, or with `head` the LM head's logits of them."""
        residual: torch.Tensor | None = None
        chained = (
            None if capture else self._run_chain(input_ids, positions, attn, meta, indices, head)
        )
        if isinstance(chained, torch.Tensor):
            return chained
        if chained is not None:
            x, residual = chained
        else:
            cos, sin = self.rotary.cos_sin(positions, self.model.embed_tokens.dtype)
            x = self.model.embed_tokens(input_ids)
            for i, layer in enumerate(self.model.layers):
                x, residual = layer.forward(x, residual, cos, sin, attn, meta)
                if i in capture:
                    assert captured is not None
                    captured[i] = x + residual
        assert residual is not None
        h = self.model.norm(x[indices] + residual[indices])
        return self.lm_head(h) if head else h

    def _run_chain(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        indices: torch.Tensor,
        head: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
        """A CPU decode step's layers as one C call (layers/cpu_chain.py): (the last layer's
        output, the residual stream before it), or None where the step or the model is not
        one it runs (then the layers run one by one). With `head`, where the rows asked for
        are every row in order and the chain has the final norm and the LM head: the logits
        (float32), from the same call. The embedding's rows too where the chain looks them up
        (a quantized table: `_lay_embedding`), else by the embedding module. The rotary rows
        of the step's positions are the chain's own op (`Chain.rope`)."""
        if not input_ids.is_cpu or not isinstance(attn, TorchAttentionBackend):
            return None
        embed = self.model.embed_tokens
        dtype, rows = embed.dtype, input_ids.shape[0]
        inputs = attn.decode_chain_inputs(meta)
        if inputs is None or not cpu_chain.positions_ok(positions, rows):
            return None
        # By backend too: a chain writes its KV pool. Each chain keeps its backend alive, so
        # the id is not another's while the entry is here.
        chains = self.__dict__.setdefault("_cpu_chains", {})
        key = (rows, dtype, id(attn))
        got = chains.get(key, False)
        if got is False:
            got = chains[key] = self._build_chain(rows, dtype, attn)
        if got is None:
            return None
        chain, out, residual, vocab = got
        assert chain.backend is attn
        ids: torch.Tensor | None = input_ids
        x = None
        if chain.embedded is None or not cpu_chain.ids_ok(input_ids, rows):
            ids, x = None, embed(input_ids)
            if not cpu_chain.x_ok(x, dtype):
                return None
        if head and vocab and _every_row(indices, rows):
            logits = torch.empty(rows, vocab, dtype=torch.float32)
            return logits if chain.run(x, positions, *inputs, out=logits, ids=ids) else None
        if not chain.run(x, positions, *inputs, upto=chain.layers_end, ids=ids):
            return None  # a position past the rotary tables: the layers' way reports it
        return out, residual

    def _build_chain(
        self, rows: int, dtype: torch.dtype, attn: TorchAttentionBackend
    ) -> tuple[cpu_chain.Chain, torch.Tensor, torch.Tensor, int] | None:
        """The chain of every layer at `rows` rows, with the buffers it leaves the last
        layer's output and the residual in, and the logits' width where the final norm and the
        LM head follow them (0 where the head is not one it expresses); None where some
        layer's call is not one it expresses."""
        if rows > cpu_chain.MAX_ROWS or not cpu_chain.available(dtype):
            return None
        arena = self.__dict__.setdefault("_cpu_chain_buffers", {})
        try:
            return self._lay_chain(cpu_chain.Chain(rows, dtype, attn, arena), attn)
        except cpu_chain.Unsupported as e:
            logger.info("a step of %d rows runs layer by layer: %s", rows, e)
            return None

    def _lay_chain(
        self, chain: cpu_chain.Chain, attn: TorchAttentionBackend
    ) -> tuple[cpu_chain.Chain, torch.Tensor, torch.Tensor, int]:
        """Each layer's calls as Qwen3DecoderLayer.forward makes them. The layer's input and
        the residual alternate between two buffers, as add_forward's sum into x does."""
        cfg = self.config
        layers = list(self.model.layers)
        first = layers[0]
        assert isinstance(first, Qwen3DecoderLayer)
        a0 = first.self_attn
        hq, hkv, d = a0.num_heads, a0.num_kv_heads, a0.head_dim
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (hq, hkv, d):
            raise cpu_chain.Unsupported("attention heads unlike the layers'")
        hidden = cfg.hidden_size
        h, y, mlp_out = (chain.buffer(name, hidden) for name in ("normed", "attn", "mlp"))
        qkv, qk = chain.buffer("qkv", (hq + 2 * hkv) * d), chain.buffer("qk", hq + hkv, d)
        o = chain.buffer("o", hq * d)
        self._lay_embedding(chain)
        chain.rope(self.rotary.table(torch.device("cpu")))
        x: torch.Tensor | int = cpu_chain.FROM_STEP_X
        residual: torch.Tensor | int = cpu_chain.FROM_STEP_X
        for i, layer in enumerate(layers):
            if not isinstance(layer, Qwen3DecoderLayer):
                raise cpu_chain.Unsupported("a layer other than Qwen3's")
            sa, mlp = layer.self_attn, layer.mlp
            if type(mlp) not in (Qwen3MLP, SparseMoeBlock):
                raise cpu_chain.Unsupported("an MLP other than Qwen3's dense or sparse one")
            if not sa.qk_norm or (sa.num_heads, sa.num_kv_heads, sa.head_dim) != (hq, hkv, d):
                raise cpu_chain.Unsupported("attention without q/k norm, or other heads")
            norm = layer.input_layernorm
            if i == 0:
                chain.norm(x, norm.weight, norm.eps, h)
            else:
                chain.norm(x, norm.weight, norm.eps, h, residual=residual, sum_into=mlp_out)
                residual = mlp_out
            qk_rows, v = self._lay_qkv(chain, sa.qkv_proj, h, qkv, (hq + hkv) * d)
            stride = qk_rows.stride(0)
            chain.norm(
                qk_rows, sa.qk_weight(), sa.eps, qk, group=hq + hkv, x_stride=stride, rope=True
            )
            k_pool, v_pool = (
                attn.kv_pool.k_buffers[sa.layer_id],
                attn.kv_pool.v_buffers[sa.layer_id],
            )
            chain.attention(qk, v, k_pool, v_pool, o, (hq, hkv, d), attn.scale)
            chain.matmul(sa.o_proj, o, y)
            norm = layer.post_attention_layernorm
            chain.norm(y, norm.weight, norm.eps, h, residual=residual, sum_into=y)
            residual = y
            if isinstance(mlp, SparseMoeBlock):
                chain.moe(mlp, h, mlp_out)
            else:
                assert isinstance(mlp, Qwen3MLP)
                gate_up = chain.buffer("gate_up", mlp.gate_up_proj.out_features)
                act = chain.buffer("act", gate_up.shape[1] // 2)
                chain.matmul(mlp.gate_up_proj, h, gate_up)
                chain.silu_mul(gate_up, act)
                chain.matmul(mlp.down_proj, act, mlp_out)
            x = mlp_out
        assert isinstance(residual, torch.Tensor)
        chain.layers_end = chain.mark()
        vocab = self._lay_head(chain, mlp_out, residual)
        chain.seal()
        return chain, mlp_out, residual, vocab

    @staticmethod
    def _lay_qkv(
        chain: cpu_chain.Chain,
        proj: QKVParallelLinear,
        h: torch.Tensor,
        qkv: torch.Tensor,
        qk_width: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k/v matmul into `qkv` (or, where its weight is held as a q/k part and a v part,
        each part into a buffer of its own): (the q/k rows, the v rows), views a row apart by
        their buffer's width."""
        parts = proj.part_list()
        if not parts:
            chain.matmul(proj, h, qkv)
            return qkv, qkv[:, qk_width:]
        if [p.out_features for p in parts] != [qk_width, qkv.shape[1] - qk_width]:
            raise cpu_chain.Unsupported("a q/k/v weight held in parts other than q/k and v")
        qk_rows, v = chain.buffer("qk_rows", qk_width), chain.buffer("v", qkv.shape[1] - qk_width)
        chain.matmul(parts[0], h, qk_rows)
        chain.matmul(parts[1], h, v)
        return qk_rows, v

    def _lay_embedding(self, chain: cpu_chain.Chain) -> None:
        """A quantized embedding table's lookup as the chain's first op (its rows then are the
        step's input rows): a decode step's ~10 torch and ctypes calls of QuantWeight.rows
        (0.07 ms a row warm, 0.3 ms after a step's weight stream, 1 thread, AMD EPYC VM) in
        C; so is a bf16 table kept only as its tied LM head's panels (torch indexing ops). A
        float table of its own (one F.embedding call) stays the module's."""
        embed = self.model.embed_tokens
        if embed.tp_size != 1:
            return
        try:
            if isinstance(embed.weight, QuantWeight):
                chain.embedding(embed.weight)
            elif embed.panels is not None:
                chain.embedding_panels(embed.panels)
        except cpu_chain.Unsupported as e:
            logger.info("a step of %d rows looks the embedding up apart: %s", chain.rows, e)

    def _lay_head(self, chain: cpu_chain.Chain, x: torch.Tensor, residual: torch.Tensor) -> int:
        """The final norm and the LM head after the layers, as hidden_states and forward call
        them for every row (the sum x + residual goes into x, which nothing reads after), the
        logits into the step's output buffer: their width, or 0 (the chain ends with the
        layers) where the head is not one it expresses. Saves the step's indexing, add, norm
        and head calls in Python and their temporaries."""
        norm, head = self.model.norm, self.lm_head
        vocab = head.weight.shape[0]
        # Only its shape and dtype are read: the step's own buffer takes its place.
        logits = torch.empty(chain.rows, vocab, dtype=torch.float32)
        mark = chain.mark()
        try:
            if head.kernel_out_dtype != torch.float32:
                raise cpu_chain.Unsupported("an LM head that does not give float32")
            final = chain.buffer("final", x.shape[1])
            chain.norm(x, norm.weight, norm.eps, final, residual=residual, sum_into=x)
            chain.matmul(head, final, logits, step_out=True)
        except cpu_chain.Unsupported as e:
            logger.info("a step of %d rows runs the LM head apart: %s", chain.rows, e)
            chain.drop_after(mark)
            return 0
        return vocab

    # -- weights ---------------------------------------------------------------------------

    def expected_weights(self) -> set[str]:
        """The checkpoint tensor names this model needs (HF naming)."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        opts = self.attention_options(self.config)
        attn = [f"self_attn.{x}_proj.weight" for x in "qkvo"]
        attn += [f"self_attn.{x}_norm.weight" for x in "qk"] if opts.qk_norm else []
        attn += [f"self_attn.{x}_proj.bias" for x in "qkv"] if opts.qkv_bias else []
        attn += ["self_attn.o_proj.bias"] if opts.o_bias else []
        norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            names |= {p + s for s in attn + norms}
            assert isinstance(layer, Qwen3DecoderLayer)
            names |= {p + "mlp." + s for s in layer.mlp_weights.weight_names()}
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this rank's (fused, sharded) parameters; returns the names
        used. Unknown names are ignored (e.g. rotary caches some exporters save)."""
        loaded: set[str] = set()
        layers = self.model.layers
        for name, tensor in weights:
            if name == "model.embed_tokens.weight":
                self.model.embed_tokens.load(tensor)
            elif name == "lm_head.weight":
                if self.config.tie_word_embeddings:
                    continue  # the embedding is the head
                self.lm_head.load(tensor)
            elif name == "model.norm.weight":
                self.model.norm.weight.data.copy_(tensor)
            elif name.startswith("model.layers."):
                idx_str, _, rest = name[len("model.layers.") :].partition(".")
                if int(idx_str) >= len(layers) or not self._load_layer(
                    layers[int(idx_str)], rest, tensor
                ):
                    continue
            else:
                continue
            loaded.add(name)
        for m in self.modules():
            if isinstance(m, Qwen3Attention):
                m._qk_weight = None  # derived from the norms just loaded
        self.__dict__.pop("_cpu_chains", None)  # bound to the tensors replaced
        return loaded

    @staticmethod
    def _load_layer(layer: nn.Module, rest: str, t: torch.Tensor) -> bool:
        assert isinstance(layer, Qwen3DecoderLayer)
        attn = layer.self_attn
        if rest.startswith("mlp."):
            return layer.mlp_weights.load(rest[len("mlp.") :], t)
        if rest in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ) or (
            attn.qkv_proj.bias is not None
            and rest in ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
        ):
            attn.qkv_proj.load(t, rest.split(".")[1][0])
        elif rest == "self_attn.o_proj.weight" or (
            rest == "self_attn.o_proj.bias" and attn.o_proj.bias is not None
        ):
            attn.o_proj.load(t)
        else:
            norms = {
                "input_layernorm.weight": layer.input_layernorm,
                "post_attention_layernorm.weight": layer.post_attention_layernorm,
            }
            if attn.qk_norm:
                norms["self_attn.q_norm.weight"] = attn.q_norm
                norms["self_attn.k_norm.weight"] = attn.k_norm
            if rest not in norms:
                return False
            norms[rest].weight.data.copy_(t)
        return True

    def prepack(self, tuning: str = "cached", copies_max_bytes: int = 0) -> None:
        """Give CPU matmuls the fastest kernel per row count, measured (see cpu_linear.py):
        each weight in one layout unless `copies_max_bytes` allows second ones."""
        self.__dict__.pop("_cpu_chains", None)  # bound to the kernels about to be picked
        # Quantized layers multiply through their own path (minisgl/quant/).
        mods = [
            m
            for m in self.modules()
            if isinstance(m, (LinearBase, ParallelLMHead))
            and m.weight is not None  # a weight held in parts: each its own LinearBase
            and not isinstance(m.weight, QuantWeight)
        ]
        embed, head = self.model.embed_tokens, self.lm_head
        # A quantized head (and the tied table it is) is no float matmul's: nothing to share.
        tied = head.weight is embed.weight and not isinstance(head.weight, QuantWeight)
        # Weights other modules read too keep their row-major original; a tied embedding is the
        # exception: it can read its rows from the head's panels.
        shared = {
            id(p)
            for m in self.modules()
            if not isinstance(m, (LinearBase, ParallelLMHead)) and not (tied and m is embed)
            for p in m.parameters(recurse=False)
        }
        lookup = {id(head.weight)} if tied else set()
        cpu_linear.prepack_modules(mods, tuning, shared, lookup, copies_max_bytes)
        if tied and head.weight.device.type == "meta":
            panels = head.kernel.packed.get(cpu_linear.SELF_CONTAINED) if head.kernel else None
            if panels is not None:
                embed.use_panels(panels)
            else:  # e.g. all oneDNN: a layout no lookup reads, so the table stays, shared again
                head.weight = embed.weight
        # A mixture's experts: every layer's experts share two shapes, measured once each.
        lines: list[str] = []
        for m in self.modules():
            if isinstance(m, FusedMoE):
                lines += m.prepare_cpu_kernels(tuning)
        for line in dict.fromkeys(lines):
            logger.info("experts: %s", line)
        routers = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        for line in prepare_routers(routers, tuning):
            logger.info("routers: %s", line)


def _every_row(indices: torch.Tensor, rows: int) -> bool:
    """Whether `indices` are 0 .. rows - 1 in order (a plain decode step's sampled rows)."""
    return (
        indices.shape[0] == rows
        and indices.dtype == torch.int64
        and bool(torch.equal(indices, _aranges(rows, indices.device)))
    )


@functools.lru_cache(maxsize=64)
def _aranges(rows: int, device: torch.device) -> torch.Tensor:
    return torch.arange(rows, device=device)
