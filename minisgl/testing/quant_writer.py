"""Quantized checkpoints in the published layouts, written from a float test checkpoint, each
with its dequantized twin (a float checkpoint of exactly the weights the quantized one
encodes), for token-for-token parity tests.

The packing here follows the formats' specifications with plain loops and shifts over numpy
arrays, on purpose apart from minisgl/quant's vectorised unpacking: a test whose writer and
reader share code would pass on a shared misreading.

- fp8 (Qwen's FP8 releases): `weight` float8_e4m3fn [N, K], `weight_scale_inv` float32 per
  128 x 128 block; weight = code * scale_inv.
- compressed-tensors FP8: `weight` float8_e4m3fn, `weight_scale` [N, 1] or [1].
- AWQ (AutoAWQ GEMM): `qweight` int32 [K, N/8]: nibble i of word c of input row k holds the
  code of output feature 8c + AWQ_PACK_ORDER[i]; `qzeros` int32 [K/g, N/8] packed alike;
  `scales` float16 [K/g, N].
- GPTQ: `qweight` int32 [K / (32/b), N]: code j of word r of column n is input feature
  r * (32/b) + j at bit j*b; `qzeros` int32 [G, N / (32/b)] packed along N in the same order
  (checkpoint_format gptq: each zero point minus one); `scales` float16 [G, N]; `g_idx` [K].
- compressed-tensors integer weights (llm-compressor's W4A16, W8A16, W8A8): signed codes q
  stored as q + 2^(b-1). pack-quantized (`ct-pack`): `weight_packed` int32 [N, K*b/32], code j
  of word c of row n is input feature c*(32/b) + j at bit j*b; `weight_shape` [N, K];
  int-quantized (`ct-int8`): `weight` int8 [N, K]. `weight_scale` bfloat16 [N, G] ([1]: one
  for the tensor); with zero points `weight_zero_point` (pack-quantized: packed along N alike,
  [N*b/32, G]; int-quantized: int8 [N, G]); actorder group: `weight_g_idx` int32 [K].
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
    r"\.weight"
)


@dataclass(frozen=True)
class QuantFormat:
    method: str  # fp8, ct-fp8-channel, ct-fp8-tensor, awq, gptq, ct-pack, ct-int8
    bits: int = 4
    group_size: int = 128  # -1: one group per row (gptq, ct-*); 0: one scale a tensor (ct-*)
    sym: bool = True
    desc_act: bool = False
    gptq_v2: bool = False
    not_converted: tuple[str, ...] = ()  # module names kept in float (modules_to_not_convert)
    # gptq / awq tensors under Intel AutoRound's config (packing_format auto_round:auto_gptq or
    # auto_round:auto_awq; the kept-float modules in its extra_config as 16 bits)
    auto_round: bool = False
    # Mixed precision: (regex matched from a module name's start, the format those modules are
    # in), the first match deciding; written as compressed-tensors' extra config_groups,
    # GPTQModel's `dynamic` or AutoRound's extra_config.
    mixed: tuple[tuple[str, QuantFormat], ...] = ()

    def format_of(self, module: str) -> QuantFormat:
        return next((f for rx, f in self.mixed if re.match(rx, module)), self)

    def quantization_config(self, modules: tuple[str, ...] = ()) -> dict[str, Any]:
        """config.json's quantization_config; `modules`: the linears' names (AutoRound's
        extra_config names each module in another format)."""
        config = self._config()
        if not self.mixed:
            return config
        if self.method.startswith("ct-"):
            groups = [self._ct_group(), *(f._ct_group() for _, f in self.mixed)]
            for (_, group), (rx, _) in zip(groups[1:], self.mixed, strict=True):
                group["targets"] = [f"re:{rx}"]
            formats = {fmt for fmt, _ in groups}
            config["format"] = formats.pop() if len(formats) == 1 else "mixed-precision"
            config["config_groups"] = {
                f"group_{i}": group | {"format": fmt} for i, (fmt, group) in enumerate(groups)
            }
        elif self.auto_round:
            config["extra_config"] |= {
                m: {"bits": f.bits, "group_size": f.group_size, "sym": f.sym, "data_type": "int"}
                for m in modules
                if (f := self.format_of(m)) is not self
            }
        else:
            config["dynamic"] = {
                f"+:{rx}": {
                    "bits": f.bits, "group_size": f.group_size, "sym": f.sym,
                    "desc_act": f.desc_act,
                }
                for rx, f in self.mixed
            }  # fmt: skip
        return config

    def _config(self) -> dict[str, Any]:
        if self.method == "fp8":
            return {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": list(self.not_converted) or None,
            }
        if self.method.startswith("ct-"):
            fmt, group = self._ct_group()
            return {
                "quant_method": "compressed-tensors",
                "format": fmt,
                "quantization_status": "compressed",
                "config_groups": {"group_0": group},
                "ignore": ["lm_head", *self.not_converted],
                "kv_cache_scheme": None,
            }
        if self.auto_round:
            return {
                "quant_method": "auto-round",
                "autoround_version": "0.16.1",  # the keys its export writes
                "amp": False,
                "block_name_to_quantize": "model.layers",
                "enable_quanted_input": False,
                "bits": self.bits,
                "group_size": self.group_size,
                "sym": self.sym,
                "data_type": "int",
                "packing_format": f"auto_round:auto_{self.method}",
                "extra_config": {m: {"bits": 16, "data_type": "float"} for m in self.not_converted},
            }
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": 4,
                "group_size": self.group_size,
                "zero_point": True,
                "version": "gemm",
                "modules_to_not_convert": list(self.not_converted) or None,
            }
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "checkpoint_format": "gptq_v2" if self.gptq_v2 else "gptq",
            "static_groups": False,
            "true_sequential": True,
            "damp_percent": 0.01,
            "lm_head": False,
            "modules_to_not_convert": list(self.not_converted) or None,
        }

    def _ct_group(self) -> tuple[str, dict[str, Any]]:
        """This format's compressed-tensors format and config group: llm-compressor's FP8
        (float-quantized, activations rounded to fp8 per token at run time), W4A16 / W8A16
        (pack-quantized) and W8A8 (int-quantized, activations rounded to int8 per token)."""
        if self.method.startswith("ct-fp8"):
            strategy = self.method.rsplit("-", 1)[1]
            weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                       "dynamic": False}  # fmt: skip
            acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
            fmt = "float-quantized"
        else:
            strategy = {-1: "channel", 0: "tensor"}.get(self.group_size, "group")
            weights = {
                "num_bits": self.bits,
                "type": "int",
                "symmetric": self.sym,
                "strategy": strategy,
                "group_size": self.group_size if strategy == "group" else None,
                "block_structure": None,
                "dynamic": False,
                "actorder": "group" if self.desc_act else None,
                "observer": "minmax",
                "observer_kwargs": {},
            }
            acts = None
            if self.method == "ct-int8":
                acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                        "dynamic": True, "observer": None}  # fmt: skip
            fmt = "pack-quantized" if self.method == "ct-pack" else "int-quantized"
        group = {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": acts,
            "output_activations": None,
        }
        return fmt, group


def _to_float16(s: np.ndarray) -> np.ndarray:
    return s.astype(np.float16).astype(np.float32)


def _to_bfloat16(s: np.ndarray) -> np.ndarray:
    return torch.from_numpy(s.astype(np.float32)).to(torch.bfloat16).float().numpy()


def _int_codes(
    w: np.ndarray, bits: int, sym: bool, groups: list[np.ndarray], scale_of=_to_float16
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] -> codes [N, K], zero points [N, G], scales [N, G] (float32 values the stored
    dtype holds exactly: `scale_of` rounds them to it); group j covers the input features
    groups[j]."""
    top = (1 << bits) - 1
    n, k = w.shape
    q = np.zeros((n, k), np.int64)
    zeros = np.zeros((n, len(groups)), np.int64)
    scales = np.zeros((n, len(groups)), np.float32)
    for j, cols in enumerate(groups):
        part = w[:, cols]
        if sym:
            s = np.abs(part).max(axis=1) * 2 / top
            z = np.full(n, 1 << (bits - 1))
        else:
            lo, hi = np.minimum(part.min(axis=1), 0), np.maximum(part.max(axis=1), 0)
            s = (hi - lo) / top
            z = np.clip(np.round(-lo / s), 0, top).astype(np.int64)
        s16 = scale_of(np.maximum(s, 1e-4))
        q[:, cols] = np.clip(np.round(part / s16[:, None]) + z[:, None], 0, top)
        zeros[:, j], scales[:, j] = z, s16
    return q, zeros, scales


def _dequant(
    q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group_of: np.ndarray
) -> np.ndarray:
    """(q - zero) * scale per element, in float32 (as exact as the loader's)."""
    z = zeros[:, group_of].astype(np.float32)
    s = scales[:, group_of].astype(np.float32)
    return (q.astype(np.float32) - z) * s


def _words(values: list[np.ndarray], bits: int) -> np.ndarray:
    """Pack values[j] (same shape) into int32 words, values[j] at bit j * bits."""
    out = np.zeros(values[0].shape, np.uint32)
    for j, v in enumerate(values):
        out |= (v.astype(np.uint32) & ((1 << bits) - 1)) << np.uint32(j * bits)
    return out.view(np.int32)


def _gptq(w: np.ndarray, f: QuantFormat, order: np.ndarray) -> tuple[dict, np.ndarray]:
    n, k = w.shape
    b, g = f.bits, (f.group_size if f.group_size > 0 else k)
    g_idx = np.zeros(k, np.int32)
    g_idx[order] = np.arange(k) // g  # the features in `order` fill the groups in turn
    groups = [np.flatnonzero(g_idx == j) for j in range(-(-k // g))]
    q, zeros, scales = _int_codes(w, b, f.sym, groups)
    per = 32 // b
    qt = q.T  # [K, N]
    qweight = np.stack(
        [_words([qt[r * per + j] for j in range(per)], b) for r in range(k // per)]
    )  # [K/per, N]
    stored = zeros.T - (0 if f.gptq_v2 else 1)  # [G, N]
    qzeros = np.stack(
        [_words([stored[:, c * per + j] for j in range(per)], b) for c in range(n // per)],
        axis=1,
    )  # [G, N/per]
    parts = {
        "qweight": qweight, "qzeros": qzeros, "scales": scales.T.astype(np.float16), "g_idx": g_idx,
    }  # fmt: skip
    return parts, _dequant(q, zeros, scales, g_idx)


def _awq(w: np.ndarray, f: QuantFormat) -> tuple[dict, np.ndarray]:
    n, k = w.shape
    g = f.group_size
    g_idx = np.arange(k) // g
    groups = [np.arange(j * g, (j + 1) * g) for j in range(k // g)]
    q, zeros, scales = _int_codes(w, 4, False, groups)
    qt, zt = q.T, zeros.T  # [K, N], [G, N]

    def pack(a: np.ndarray) -> np.ndarray:
        cols = [
            _words([a[:, 8 * c + AWQ_PACK_ORDER[i]] for i in range(8)], 4) for c in range(n // 8)
        ]
        return np.stack(cols, axis=1)

    parts = {"qweight": pack(qt), "qzeros": pack(zt), "scales": scales.T.astype(np.float16)}
    return parts, _dequant(q, zeros, scales, g_idx)


def _ct_int(w: np.ndarray, f: QuantFormat, order: np.ndarray) -> tuple[dict, np.ndarray]:
    n, k = w.shape
    b, mid = f.bits, 1 << (f.bits - 1)
    if f.group_size == 0:  # one scale for the whole tensor
        s = np.float32(_to_bfloat16(np.array([np.abs(w).max() * 2 / ((1 << b) - 1)]))[0])
        q = np.clip(np.round(w / s) + mid, 0, (1 << b) - 1).astype(np.int64)
        zeros, scales = np.full((n, 1), mid), np.full((n, 1), s, np.float32)
        g_idx = np.zeros(k, np.int32)
        stored = torch.tensor([s]).to(torch.bfloat16)
    else:
        g = f.group_size if f.group_size > 0 else k
        g_idx = np.zeros(k, np.int32)
        g_idx[order] = np.arange(k) // g  # as GPTQ's desc_act: `order` fills the groups in turn
        groups = [np.flatnonzero(g_idx == j) for j in range(-(-k // g))]
        q, zeros, scales = _int_codes(w, b, f.sym, groups, _to_bfloat16)
        stored = torch.from_numpy(scales).to(torch.bfloat16)
    parts: dict[str, Any] = {"weight_scale": stored}
    if f.method == "ct-pack":
        per = 32 // b
        parts["weight_packed"] = np.stack(
            [_words([q[:, c * per + j] for j in range(per)], b) for c in range(k // per)], axis=1
        )  # [N, K/per]
        parts["weight_shape"] = torch.tensor([n, k])
        if not f.sym:  # zero points + 2^(b-1), packed along the output features
            parts["weight_zero_point"] = np.stack(
                [_words([zeros[r * per + j] for j in range(per)], b) for r in range(n // per)]
            )  # [N/per, G]
    else:
        parts["weight"] = (q - mid).astype(np.int8)
        if not f.sym:
            parts["weight_zero_point"] = (zeros - mid).astype(np.int8)
    if f.desc_act:
        parts["weight_g_idx"] = g_idx
    return parts, _dequant(q, zeros, scales, g_idx)


def _fp8(w: np.ndarray, f: QuantFormat) -> tuple[dict, np.ndarray]:
    n, k = w.shape
    t = torch.from_numpy(w)
    if f.method == "fp8":
        scale = torch.zeros(-(-n // 128), -(-k // 128))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                block = t[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                scale[i, j] = block.abs().max() / 448
        full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        name = "weight_scale_inv"
    elif f.method == "ct-fp8-channel":
        scale = t.abs().amax(dim=1, keepdim=True) / 448
        full, name = scale.expand(n, k), "weight_scale"
    else:
        scale = (t.abs().max() / 448).reshape(1)
        full, name = scale.expand(n, k), "weight_scale"
    codes = (t / full).to(torch.float8_e4m3fn)
    twin = codes.float() * full
    return {"weight": codes, name: scale.float()}, twin.numpy()


def _input_of(module: str) -> str:
    """Modules that read the same input (q/k/v; gate/up) share it: GPTQ's desc_act order
    follows the input's Hessian, so they get the same g_idx."""
    return re.sub(r"\.[qkv]_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", module))


def write_quantized_pair(
    src: Path,
    quant_dir: Path,
    twin_dir: Path,
    fmt: QuantFormat,
    extra: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> None:
    """From the float checkpoint `src`: `quant_dir` in `fmt`'s layout (plus the `extra`
    tensors), `twin_dir` with the weights it encodes, dequantized, in float32."""
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(seed)
    for out in (quant_dir, twin_dir):
        shutil.copytree(src, out, dirs_exist_ok=True)
        for f in out.glob("model*.safetensors*"):
            f.unlink()
    quant: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    orders: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(f)
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if not LINEAR.fullmatch(name) or module in fmt.not_converted:
            quant[name] = twin[name] = t
            continue
        w = t.float().numpy()
        own = fmt.format_of(module)
        if own.method == "awq":
            parts, deq = _awq(w, own)
        elif own.method in ("gptq", "ct-pack", "ct-int8"):
            k = w.shape[1]
            order = orders.setdefault(
                _input_of(module), rng.permutation(k) if own.desc_act else np.arange(k)
            )
            parts, deq = (_gptq if own.method == "gptq" else _ct_int)(w, own, order)
        else:
            parts, deq = _fp8(w, own)
        for suffix, v in parts.items():
            quant[f"{module}.{suffix}"] = v if isinstance(v, torch.Tensor) else torch.from_numpy(v)
        twin[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
    quant |= extra or {}
    save_file({k: v.contiguous() for k, v in quant.items()}, str(quant_dir / "model.safetensors"))
    save_file(twin, str(twin_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (twin_dir / "config.json").write_text(json.dumps(config, indent=2))
    linears = tuple(n.rsplit(".", 1)[0] for n in tensors if LINEAR.fullmatch(n))
    config["quantization_config"] = fmt.quantization_config(linears)
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))
