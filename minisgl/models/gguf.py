"""GGUF files (llama.cpp's format) as checkpoints: `--model path/to/model.gguf`.

A GGUF file carries the model's shape, its tokenizer and its tensors in one file. minisgl opens
it through a directory it prepares once per file (under MINISGL_CACHE_DIR, by default
~/.cache/minisgl/gguf): config.json and generation_config.json written from the file's
metadata, the tokenizer as transformers converts it from the file (its chat template
included), and the file itself linked beside them as model.gguf. Every process then opens that
directory as it opens any checkpoint, and the loader reads the tensors from the GGUF file.

Tensors are renamed to the Hugging Face names the models load (blk.3.attn_q.weight ->
model.layers.3.self_attn.q_proj.weight; a mixture's stacked experts split one per expert) and
read as follows:
- F32, F16, BF16: as they are.
- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q4_K and Q5_K attention and MLP projections,
  and LM head (a tied model's embedding table) under --lm-head-quantization auto: held as they
  are, in minisgl's quantized layout (a scale per 32 weights; 8-bit codes q + 128 and zero
  point 128 for Q8_0, 4-bit codes and zero point 8 for Q4_0, Q5_0's 5-bit values as 8-bit
  codes with zero point 16, IQ4's table values as 8-bit codes with zero point 128; Q4_1's
  4-bit and Q5_1's 5-bit codes with zero point 0 and min -m, Q4_K's 4-bit and Q5_K's 5-bit
  ones with each group's scale d * sc and its min dmin * m), which the CPU kernels (and the
  CUDA path) run as they run GPTQ's, the mins' term subtracted after them (each group's min
  times the inputs' sum over the group).
- An untied embedding table (the file has output.weight) in one of those types or in Q6_K,
  Q3_K or Q2_K (on any device: looked up, not multiplied): held the same way, a lookup
  dequantizing only the rows it reads (Qwen3-8B's Q4_K table: 0.5 GB held where bf16 takes
  1.2 GB).
- Q6_K, Q3_K and Q2_K attention and MLP projections (a mixture's experts included), where the
  CPU kernels take their groups of 16 (the VNNI panels in an AVX512-VNNI build, qgemv and the
  dequantizing kernels in the others; loads with `hold_groups_of_16`): held as 8-bit codes q
  with zero point 32 (Q3_K: 4; Q2_K: 0 and a min dmin * m) and scale d * sc per group of 16;
  elsewhere (a GPU), dequantized at load as below.
- Every other type (IQ1/IQ2/IQ3, TQ, MXFP4, ...), and a quantized router: dequantized at
  load by gguf-py (llama.cpp's own Python package), said in one log line; so are a layer's
  gate/up experts stored in two types (minisgl holds them as one weight). q/k/v or gate/up of
  mixed types (a Q4_K_M file's Q6_K v beside Q4_K q and k) are held in parts, each projection
  as it is read. An LM head stored in such a type is held in int8 per row
  (--lm-head-quantization auto), made from its dequantized values.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.cache import cache_dir
from minisgl.models.gguf_header import GgufHeader, TensorInfo
from minisgl.quant.scheme import GGUF_GROUP_16_TYPES, GGUF_PROJECTION_TYPES, GGUF_TYPES

logger = logging.getLogger("minisgl.models.gguf")  # also as `python -m` (__main__)

# GGUF general.architecture -> (architectures, model_type) of the config.json written for it.
ARCHITECTURES = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
FLOATS = ("F32", "F16", "BF16")
MODEL_FILE = "model.gguf"  # the link to the file in its prepared directory
EMBEDDING = "token_embd.weight"
# In the prepared directory's key: a directory prepared by an earlier minisgl whose config.json
# says less than the loader now reads (2: an untied table held quantized; 3: q/k/v and gate/up
# of mixed types held per projection; 4: Q6_K projections named as held; 5: Q4_1, Q5_1, IQ4_NL,
# IQ4_XS, Q3_K and Q2_K named as held) is prepared anew.
PREPARED_FORMAT = 5

# blk.N.<name> -> model.layers.N.<name> (`{e}`: one of a mixture's stacked experts).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# A mixture's gate/up experts, which minisgl holds as one weight: held as they are only if
# both share one type (its down_proj experts are a weight of their own). q/k/v and a dense
# gate/up of mixed types are held in parts, each projection as it is stored (layers/linear.py).
_FUSED = (("ffn_gate_exps", "ffn_up_exps"),)
_PROJECTIONS = frozenset(
    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    + ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# general.file_type -> the torch_dtype a config.json of its source would name.
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


# A GGUF file on the Hugging Face hub, as vLLM and llama.cpp name one: "<owner>/<repo>:<type>".
_HUB_FILE = re.compile(r"([\w.-]+/[\w.-]+):([\w.-]+)")


def is_gguf(model: str | Path) -> bool:
    """A local .gguf file's path, or a hub repository's file: "Qwen/Qwen3-8B-GGUF:Q8_0"."""
    return str(model).endswith(".gguf") or _HUB_FILE.fullmatch(str(model)) is not None


def local_file(model: str | Path) -> Path:
    """The GGUF file `model` names: a local path as is; "<owner>/<repo>:<type>" fetched from
    the hub (or found in the HF_HOME cache when HF_HUB_OFFLINE=1): the repository's one .gguf
    file whose name ends in <type> (any case), e.g. Qwen3-8B-Q8_0.gguf for Q8_0."""
    m = _HUB_FILE.fullmatch(str(model))
    if m is None:
        return Path(model).expanduser()
    from huggingface_hub import snapshot_download

    repo, kind = m.groups()
    # fnmatch is case-sensitive: each letter as a [xX] class.
    pattern = "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in kind)
    try:
        folder = Path(snapshot_download(repo_id=repo, allow_patterns=[f"*{pattern}.gguf"]))
    except Exception as e:  # the hub raises many types: offline, 404, auth, network
        raise FileNotFoundError(
            f"GGUF {model!r}: cannot fetch {repo!r} from the Hugging Face hub: "
            f"{type(e).__name__}: {e}"
        ) from e
    found = sorted(
        f for f in folder.rglob("*.gguf") if f.name.lower().endswith(f"{kind}.gguf".lower())
    )
    if len(found) != 1:
        what = ", ".join(f.name for f in found) if found else "none"
        raise FileNotFoundError(
            f"GGUF {model!r}: {repo} has {len(found)} files whose name ends in "
            f"{kind}.gguf ({what}); name one file: {repo}:<its type>, or a local path"
        )
    return found[0]


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor as minisgl reads it."""

    gguf_name: str
    hf_names: tuple[str, ...]  # one, or one per expert of a stacked mixture tensor
    shape: tuple[int, ...]  # [out, in] (a stacked one: [experts, out, in]) as torch orders it
    stored: str  # its GGUF type
    held: str  # what minisgl reads it as: `stored` where kept as is, else F32 (dequantized)


class GgufFile:
    """A GGUF file's metadata and tensors (memory-mapped: gguf_header)."""

    def __init__(
        self, path: str | Path, hold_head: bool = False, hold_groups_of_16: bool = False
    ) -> None:
        """`hold_head`: read an LM head (a tied model's embedding table) of a type minisgl holds
        (GGUF_TYPES) as its raw blocks, for --lm-head-quantization auto to hold as stored; else
        as floats. `hold_groups_of_16`: read Q6_K, Q3_K and Q2_K projections as their blocks
        (where the kernels take groups of 16: the loader's choice; the prepared config names
        them either way), else as floats."""
        self.path = Path(path)
        self._header = GgufHeader(self.path)
        self.fields: dict[str, Any] = {
            key: self._header.value(key)
            for key in self._header.fields
            # 150k-entry arrays: the tokenizer conversion reads them itself
            if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                           "tokenizer.ggml.token_type")
        }  # fmt: skip
        self.architecture = str(self.fields.get("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: unsupported GGUF architecture {self.architecture!r}; minisgl "
                f"reads {', '.join(ARCHITECTURES)}"
            )
        self._raw = {t.name: t for t in self._header.tensors}
        self.head = "output.weight" if "output.weight" in self._raw else EMBEDDING
        # Whole tensors read as their blocks -> the types they are so in: the head in those
        # the kernels multiply; an untied table (the head is output.weight) in any held type,
        # groups of 16 included whatever the kernels (it is looked up, not multiplied: its
        # lookups dequantize only the rows they read).
        held: dict[str, Collection[str]] = {self.head: GGUF_TYPES} if hold_head else {}
        if self.head != EMBEDDING:
            held[EMBEDDING] = GGUF_PROJECTION_TYPES
        self.hold_groups_of_16 = hold_groups_of_16
        self.tensors = _tensors(self._header.tensors, held, hold_groups_of_16)

    def tokenizer_digest(self) -> str:
        """A digest of every tokenizer.* field, as stored."""
        h = hashlib.sha256()
        for key in self._header.fields:
            if key.startswith("tokenizer."):
                h.update(key.encode())
                h.update(self._header.raw(key))
        return h.hexdigest()[:16]

    def meta(self, key: str, default: Any = None) -> Any:
        """An architecture's key (`block_count` for qwen3.block_count), or `default`."""
        return self.fields.get(f"{self.architecture}.{key}", default)

    def headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor the model reads, by its Hugging Face name: (the float weight's shape,
        the type it is read as: its GGUF type for those held quantized, else a float type)."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for t in self.tensors:
            shape = t.shape[1:] if len(t.hf_names) > 1 else t.shape
            out |= {name: (shape, t.held) for name in t.hf_names}
        return out

    def dequantized(self) -> dict[str, int]:
        """GGUF type -> how many of its tensors are dequantized at load (none: all held)."""
        out: dict[str, int] = {}
        for t in self.tensors:
            if t.held != t.stored:
                out[t.stored] = out.get(t.stored, 0) + 1
        return out

    def dequantized_line(self, dtype: str, itemsize: int) -> str:
        """The start-up log's line on what is dequantized at load to `dtype` (`itemsize` bytes
        a weight), and the memory that takes against the file's bytes."""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.dequantized().items()))
        floated = [self._raw[t.gguf_name] for t in self.tensors if t.held != t.stored]
        held = sum(int(r.n_elements) for r in floated) * itemsize / 2**30
        stored = sum(int(r.n_bytes) for r in floated) / 2**30
        g16 = "/".join(GGUF_GROUP_16_TYPES)
        sixteens = (
            f"{g16} projections and untied tables too"
            if self.hold_groups_of_16
            else (
                f"{g16} untied tables too, {g16} projections where the CPU kernels run (not here)"
            )
        )
        return (
            f"GGUF {self.path.name}: {kinds} tensor(s) dequantized at load to {dtype} (up to "
            f"{held:.2f} GiB in memory for {stored:.2f} GiB in the file; minisgl's kernels run "
            f"{', '.join(GGUF_TYPES)} projections, LM heads and embedding tables as they are "
            f"stored, {sixteens}; other types, routers and a layer's gate/up experts of mixed "
            "types are read as floats)"
        )

    def iter_tensors(self, progress: bool = False) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, torch tensor): a held-quantized one as its raw blocks, uint8
        [out, in / weights a block * block bytes]; the rest as float tensors."""
        from tqdm import tqdm

        with tqdm(total=len(self.tensors), desc="Loading weights", unit="tensor",
                  disable=not progress) as bar:  # fmt: skip
            for t in self.tensors:
                tensor = self._read(t)
                if len(t.hf_names) == 1:
                    yield t.hf_names[0], tensor
                else:
                    yield from zip(t.hf_names, tensor.unbind(0), strict=True)
                bar.update(1)

    def tensor(self, hf_name: str) -> Any:
        """One tensor by its Hugging Face name (a stacked expert's included)."""
        for t in self.tensors:
            if hf_name in t.hf_names:
                whole = self._read(t)
                return whole if len(t.hf_names) == 1 else whole[t.hf_names.index(hf_name)]
        raise KeyError(hf_name)

    def _named(self, gguf_name: str) -> Tensor:
        return next(t for t in self.tensors if t.gguf_name == gguf_name)

    def _read(self, t: Tensor) -> Any:
        import torch
        from gguf import GGMLQuantizationType, dequantize

        data = np.array(self._raw[t.gguf_name].data)  # a copy: not the mapping's pages
        if t.held != t.stored:
            values = dequantize(data, GGMLQuantizationType[t.stored])
            tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        elif t.stored == "BF16":
            tensor = torch.from_numpy(data).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(data)  # F32 / F16 floats, or held blocks
        return tensor.reshape(*t.shape[:-1], -1)

    def config(self) -> dict[str, Any]:
        """The config.json of the model, from the file's metadata."""
        arch, model_type = ARCHITECTURES[self.architecture]
        heads = int(self.meta("attention.head_count"))
        hidden = int(self.meta("embedding_length"))
        head_dim = int(self.meta("attention.key_length", hidden // heads))
        if int(self.meta("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"{self.path}: keys and values of different lengths")
        names = {t.gguf_name for t in self.tensors}
        embed = self._named(EMBEDDING)
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": embed.shape[0],
            "hidden_size": hidden,
            "intermediate_size": int(self.meta("feed_forward_length")),
            "num_hidden_layers": int(self.meta("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.meta("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self.meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.meta("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names and self.architecture != "qwen2",
            "torch_dtype": self._dtype(),
            "bos_token_id": self.fields.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._eos_ids(),
        }
        scaling = self.meta("rope.scaling.type")
        if scaling and scaling != "none":
            out["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(self.meta("rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(
                    self.meta(
                        "rope.scaling.original_context_length", out["max_position_embeddings"]
                    )
                ),
            }
        if self.meta("expert_count"):
            out |= {
                "num_experts": int(self.meta("expert_count")),
                "num_experts_per_tok": int(self.meta("expert_used_count")),
                "moe_intermediate_size": int(self.meta("expert_feed_forward_length")),
                # llama.cpp's qwen3moe always renormalises the chosen experts' weights.
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        held = self.held_modules()
        head = self.head_type()
        table = self.embedding_type()
        if held or head or table:
            out["quantization_config"] = {"quant_method": "gguf", "modules": held}
            if head:
                out["quantization_config"]["lm_head"] = head
            if table:
                out["quantization_config"]["embed_tokens"] = table
        return out

    def head_type(self) -> str | None:
        """How --lm-head-quantization auto holds the file's LM head: as its blocks (GGUF_TYPES),
        int8 per row where it is stored in another quantized type, None (float) where the
        file has it in float."""
        stored = self._named(self.head).stored
        if stored in GGUF_TYPES:
            return stored
        return None if stored in FLOATS else "int8"

    def embedding_type(self) -> str | None:
        """The GGUF type an untied embedding table is held in as stored (None: tied, float,
        or a type dequantized at load)."""
        if self.head == EMBEDDING:
            return None
        table = self._named(EMBEDDING)
        return table.held if table.held in GGUF_PROJECTION_TYPES else None

    def held_modules(self) -> dict[str, str]:
        """Hugging Face module -> its GGUF type, for every projection held quantized (a
        mixture's experts as one `re:` pattern per layer and projection)."""
        out = {}
        for t in self.tensors:
            if t.held not in GGUF_PROJECTION_TYPES or t.gguf_name in (self.head, EMBEDDING):
                continue  # the head: head_type(); an untied table: embedding_type()
            module = t.hf_names[0].removesuffix(".weight")
            if len(t.hf_names) > 1:  # model.layers.3.mlp.experts.0.up_proj
                first, _, proj = module.rpartition(".")
                module = "re:" + re.escape(first.rpartition(".")[0]) + r"\.\d+\." + proj + "$"
            out[module] = t.held
        return out

    def generation_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"eos_token_id": self._eos_ids()}
        if self.fields.get("tokenizer.ggml.bos_token_id") is not None:
            out["bos_token_id"] = self.fields["tokenizer.ggml.bos_token_id"]
        # The sampling defaults a model's authors recommend, where the file records them.
        for key, name in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                          ("min_p", "min_p")):  # fmt: skip
            value = self.fields.get(f"general.sampling.{key}")
            if value is not None:
                out[name] = value
        return out

    def _eos_ids(self) -> list[int]:
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = [self.fields.get(f"tokenizer.ggml.{k}") for k in keys]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def _dtype(self) -> str:
        """The compute dtype `--dtype auto` gives: a float file's own; bf16 for a quantized one
        (the dtype Qwen's releases are in)."""
        return _FILE_DTYPES.get(int(self.fields.get("general.file_type", -1)), "bfloat16")


def _tensors(raw: list[TensorInfo], whole: dict[str, Collection[str]], g16: bool) -> list[Tensor]:
    """Every tensor renamed, with the type minisgl reads it as (`whole`: the LM head's and an
    untied embedding table's names -> the types they are read as their blocks in; `g16`:
    Q6_K / Q3_K / Q2_K projections held)."""
    stored = {t.name: t.type for t in raw}
    out = []
    for t in raw:
        hf, part = _hf_name(t.name)
        shape = tuple(reversed(t.dims))  # GGUF lists the innermost first
        names = (hf,) if "{e}" not in hf else tuple(hf.format(e=e) for e in range(shape[0]))
        kind = stored[t.name]
        held = kind if kind in whole.get(t.name, ()) else _held(t.name, part, stored, g16)
        out.append(Tensor(t.name, names, shape, kind, held))
    return out


def _hf_name(name: str) -> tuple[str, str]:
    """(the Hugging Face name, the GGUF tensor's base name: attn_q, token_embd, ...)."""
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}", m.group(2)
    base, _, suffix = name.rpartition(".")
    if base in _TOP_TENSORS and suffix == "weight":
        return f"{_TOP_TENSORS[base]}.weight", base
    raise ValueError(
        f"GGUF tensor {name!r} is not one minisgl's models read (it reads "
        f"{', '.join(sorted(_LAYER_TENSORS))} in blk.N and {', '.join(_TOP_TENSORS)})"
    )


def _held(name: str, part: str, stored: dict[str, str], g16: bool) -> str:
    kind = stored[name]
    if kind in FLOATS:
        return kind
    g16 = g16 and kind in GGUF_GROUP_16_TYPES
    if not (kind in GGUF_TYPES or g16) or part not in _PROJECTIONS or not name.endswith(".weight"):
        return "F32"
    for fused in _FUSED:
        if part in fused:
            layer = name.split(".")[1]
            kinds = {stored.get(f"blk.{layer}.{p}.weight") for p in fused}
            if len(kinds) > 1:
                return "F32"
    return kind


def prepared_dir(path: str | Path) -> Path:
    """The directory minisgl opens a GGUF file through, prepared on first use (one process
    prepares it; the others wait for it under a file lock)."""
    file, out = _file_and_dir(path)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".prepare.lock", "w") as lock:  # one at a time: seconds, once a file
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            _prepare(file.resolve(), out)
    return out


def ready_dir(path: str | Path) -> Path | None:
    """The file's prepared directory if it is prepared already (None: not yet)."""
    out = _file_and_dir(path)[1]
    return out if (out / "config.json").is_file() else None


def _file_and_dir(path: str | Path) -> tuple[Path, Path]:
    """(the GGUF file, where its prepared directory is): one per file path, size and time."""
    file = local_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {str(file)!r} does not exist")
    st = file.stat()
    stamp = f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns}:{PREPARED_FORMAT}"
    key = hashlib.sha256(stamp.encode()).hexdigest()
    return file, cache_dir() / "gguf" / f"{file.stem}-{key[:16]}"


def _prepare(path: Path, out: Path) -> None:
    import shutil

    logger.info("GGUF %s: writing its config and tokenizer to %s (once per file)", path, out)
    model = GgufFile(path, hold_groups_of_16=True)  # the config names them; each load decides
    tokenizer = _tokenizer_dir(model, out.parent / "tokenizers")
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in tokenizer.iterdir():  # linked: tokenizer.json alone is ~11 MB for Qwen
            (tmp / f.name).symlink_to(f)
        (tmp / MODEL_FILE).symlink_to(path)
        _write_json(tmp / "generation_config.json", model.generation_config())
        _write_json(tmp / "config.json", model.config())
        shutil.rmtree(out, ignore_errors=True)  # a run killed while preparing it
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)


def _tokenizer_dir(model: GgufFile, root: Path) -> Path:
    """The tokenizer transformers converts from the file's vocabulary, merges, special tokens
    and chat template (~15 s for Qwen's 151k tokens), kept by those fields' digest: the files
    of one model in several types share it."""
    import shutil

    from transformers import AutoTokenizer

    out = root / model.tokenizer_digest()
    if (out / "tokenizer_config.json").is_file():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model.path.parent), gguf_file=model.path.name)
    tokenizer.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)
    except OSError:  # another process put the same one there first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def model_file(directory: Path) -> Path | None:
    """The GGUF file of a prepared directory (None: not one)."""
    f = directory / MODEL_FILE
    return f if f.exists() else None


def main(argv: list[str] | None = None) -> None:
    """`python -m minisgl.models.gguf FILE [LOG_LEVEL]`: prepare FILE's directory and print
    its path (the server's launcher runs this before its workers: the tokenizer conversion
    needs torch, which neither the launcher nor the tokenizer workers load)."""
    import sys

    from minisgl.process import setup_logging

    args = sys.argv[1:] if argv is None else argv
    log = setup_logging(args[1] if len(args) > 1 else "info", "gguf")
    try:
        print(prepared_dir(args[0]))
    except (OSError, ValueError) as exc:
        log.error("cannot open GGUF file %s: %s", args[0], exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
