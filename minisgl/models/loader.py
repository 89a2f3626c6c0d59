"""Find a model (local directory or Hugging Face hub id), pick dtype and device, load weights."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from minisgl.layers import cpu_kernels
from minisgl.models import gguf
from minisgl.models.checkpoint import mismatches, surplus_layers
from minisgl.models.config import ModelConfig
from minisgl.models.qwen3 import Qwen3ForCausalLM, plain_submodules
from minisgl.models.registry import model_class
from minisgl.quant import cpu_choice, cpu_gemv, cpu_vpanel
from minisgl.quant import loading as quant_loading
from minisgl.quant.weight import multiplied_weights

logger = logging.getLogger(__name__)

HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "tokenizer*",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str) -> Path:
    """A local directory as is; a GGUF file through the directory prepared for it (gguf.py);
    otherwise a hub id fetched (or found in the HF_HOME cache when HF_HUB_OFFLINE=1) with
    huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if gguf.is_gguf(model):
        return gguf.prepared_dir(model)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=model, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # the hub raises many types: offline, 404, auth, network
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set and it is not in the cache)" if offline else ""
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub{hint}: {type(e).__name__}: {e}"
        ) from e


def resolve_dtype(
    name: str, config: ModelConfig, device: torch.device | None = None
) -> torch.dtype:
    """`auto` takes the checkpoint's dtype (float32 when it names none). On CPU a float16
    checkpoint runs in bfloat16: CPU float16 matmuls are slow and bf16 has the range fp16
    checkpoints were trained to avoid overflowing anyway."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    dtype = DTYPES.get(config.torch_dtype.replace("torch.", ""), torch.float32)
    if dtype == torch.float16 and device is not None and device.type == "cpu":
        return torch.bfloat16
    return dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return device


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the lone file(s); or
    the GGUF file of a directory prepared for one."""
    gguf_file = gguf.model_file(path)
    if gguf_file is not None:
        return [gguf_file]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for shard in shards:
            if not (path / shard).is_file():
                raise FileNotFoundError(
                    f"checkpoint shard {path / shard} is listed in {index.name} but missing"
                )
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (expected model.safetensors)")
    return files


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the safetensors headers (no data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(h.get_slice(name).get_shape())
    return shapes


def check_against_config(
    path: Path,
    files: list[Path],
    config: ModelConfig,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Refuse, in config.json's terms, a checkpoint whose tensors do not fit its config
    (`shapes`: a quantized checkpoint's, with each quantized linear as its float weight)."""
    attn = model_class(config.architecture).attention_options(config)
    shapes = tensor_shapes(files) if shapes is None else shapes
    note = surplus_layers(config, shapes)
    if note:
        logger.warning("checkpoint %s: %s", path, note)
    problems = mismatches(config, attn, shapes)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            f"checkpoint {path} does not match its config.json: {'; '.join(problems[:3])}{more}"
        )


def iter_tensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            total += len(list(h.keys()))
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        # One file mapped at a time: a finished shard's pages leave the process, so a big
        # checkpoint does not sit in its resident memory next to the weights built from it.
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for name in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, h.get_tensor(name)
                    bar.update(1)


def _log_int8_activations(model: torch.nn.Module) -> None:
    """Say whether --cpu-quantized-activations int8 rounds any matmul's x: integer weights
    the C kernels' 8-bit path takes (cpu_vpanel.rounds_x_in_int8: with AVX512-VNNI 8- and
    4-bit codes, without it 4-bit codes in groups of 64 or more, or of 32 in rows of a
    multiple of 64 inputs), so a model without them
    (fp8, float; 8-bit or AWQ in groups of 32 without VNNI) runs exactly as without the
    flag."""
    rows = cpu_kernels.int8_activation_rows()
    if not rows:
        logger.info(
            "--cpu-quantized-activations int8 unused: these CPU kernels have no 8-bit "
            "activation path (an AVX-512 build without AVX512-VNNI); every matmul stays exact"
        )
        return
    weights = multiplied_weights(model)
    taken = sum(cpu_vpanel.rounds_x_in_int8(w.view(0 if w.experts else None)) for w in weights)
    vnni = cpu_gemv.takes_8_bit_codes()
    which = "8- or 4-bit integer codes" if vnni else "4-bit codes in groups of 32 or more"
    if not taken:
        logger.warning(
            f"--cpu-quantized-activations int8 unused: the model has no weights in {which}, "
            "the only ones it applies to on this CPU; every matmul stays exact"
        )
        return
    where = (
        "in decode batches and prefill"
        if rows >= cpu_kernels.ALL_ROWS
        else f"in decode batches of up to {rows} rows"
    )
    logger.info(
        f"integer weights {where}: x rounded to 8 bits per "
        f"block of at most 128 features (--cpu-quantized-activations int8, {which}) in "
        f"{taken} of {len(weights)} quantized weights, not exact"
    )


def load_model(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    progress: bool | None = None,
    prepack: bool = True,
    cpu_kernel_tuning: str = "cached",
    quantization: str | None = None,
    cpu_weight_copies_max_gb: float = 0.0,
    lm_head_quantization: str = "auto",
    cpu_quantized_activations: str = "int16",
) -> Qwen3ForCausalLM:
    """Build the model for this rank on `device` (its class picked by config.json's
    `architectures`, see registry.py) and fill it from the checkpoint at `path`.

    `prepack` (CPU only) gives each matmul the kernel measured fastest here for its shape and
    row count (`cpu_kernel_tuning`: cached, full or off; see cpu_linear.py); set
    MINISGL_CPU_PREPACK=0 (or pass False) to keep plain F.linear.
    A quantized checkpoint (config.json's quantization_config) loads as it is; `quantization`
    (int8, int4, fp8) quantizes a float one as it streams in (see minisgl/quant/), and
    `lm_head_quantization` the LM head (auto: int8 under `quantization`, else as it is).
    Each weight is kept once (in the layout measured best over all row counts) unless
    `cpu_weight_copies_max_gb` allows second layouts. `cpu_quantized_activations` (int16,
    int8) sets what integer weights' CPU decode matmuls multiply their codes by (cpu_kernels).
    """
    if cpu_weight_copies_max_gb < 0:
        raise ValueError(f"cpu_weight_copies_max_gb must be >= 0, not {cpu_weight_copies_max_gb}")
    files = checkpoint_files(Path(path))
    gguf_file = None
    if gguf.is_gguf(files[0]):
        # A head in a type minisgl holds is held as stored under --lm-head-quantization auto.
        held_head = lm_head_quantization == "auto" and not quantization
        # The groups of 16 of Q6_K, Q3_K and Q2_K: the CPU kernels take them (a GPU
        # dequantizes 8-bit codes)
        g16 = device.type == "cpu" and prepack and cpu_choice.takes_groups_of_16()
        gguf_file = gguf.GgufFile(files[0], hold_head=held_head, hold_groups_of_16=g16)
    if gguf_file is not None and tp_rank == 0 and gguf_file.dequantized():
        name = str(dtype).removeprefix("torch.")
        logger.info(gguf_file.dequantized_line(name, dtype.itemsize))
    headers = gguf_file.headers() if gguf_file else quant_loading.read_headers(files)
    layout = quant_loading.checkpoint_layout(headers, config, quantization, lm_head_quantization)
    check_against_config(path, files, config, layout.shapes)
    # Parameters are created on the meta device (no memory, no random init) and then
    # materialised uninitialised on the target: every one is overwritten from the checkpoint.
    with torch.device("meta"):
        model: Qwen3ForCausalLM = model_class(config.architecture)(config, tp_rank, tp_size)
    model = model.to(dtype=dtype)
    quant_loading.attach(model, layout)  # quantized layers: no float weight allocated
    model = model.to_empty(device=device)
    quant_loading.after_materialise(model)
    if config.tie_word_embeddings:
        model.lm_head.tie(model.model.embed_tokens)  # to_empty re-creates the tensors
    if progress is None:
        progress = tp_rank == 0
    with torch.no_grad():
        tensors = gguf_file.iter_tensors(progress) if gguf_file else iter_tensors(files, progress)
        loaded = model.load_weights(quant_loading.assemble(tensors, layout))
    # check_against_config found every tensor: one missing here is a loader bug, not the user's.
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FileNotFoundError(f"checkpoint {path} has no tensor {missing[0]!r}{more}")
    model.eval()
    if tp_rank == 0:
        logger.info(quant_loading.summary(model, layout.scheme, layout.head, layout.embedding))
    quant_loading.for_device(model, device, dtype)
    if device.type == "cpu":
        cpu_kernels.set_quantized_activations(cpu_quantized_activations)
        if cpu_quantized_activations == "int8" and tp_rank == 0:
            _log_int8_activations(model)
    if prepack and device.type == "cpu":
        model.prepack(cpu_kernel_tuning, int(cpu_weight_copies_max_gb * 2**30))
        line = quant_loading.prepare_cpu(model, dtype, cpu_kernel_tuning)
        if line and tp_rank == 0:
            logger.info(line)
    # The structure is final now (weights quantized, heads tied, kernels set).
    for m in model.modules():
        plain_submodules(m)
    return model
