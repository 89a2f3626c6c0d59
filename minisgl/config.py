"""The one source of truth for configuration.

`EngineArgs` configures the engine (offline `LLM` and the scheduler worker); `ServerArgs` adds
what the HTTP service needs. The CLI (`python -m minisgl`), the Kubernetes operator and the Helm
chart all render from these dataclasses: each field's `metadata["help"]` is its flag's help,
and its name, with dashes, is its flag (`max_seq_len_override` -> `--max-seq-len-override`).
Torch-free on purpose: the operator imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
LOG_LEVELS = ("debug", "info", "warning", "error")
OUTPUT_PARSERS = ("auto", "qwen3", "none")
CPU_KERNEL_TUNING = ("cached", "full", "off")
# --cpu-quantized-activations: what integer weights' decode matmuls multiply their codes by.
CPU_QUANTIZED_ACTIVATIONS = ("int16", "int8")
CPU_INT4_ACTIVATIONS = CPU_QUANTIZED_ACTIVATIONS  # the flag's old name
# Fields' old names (a flag the CLI still takes for it, and an LLM keyword): old -> new.
RENAMED_FIELDS = {"cpu_int4_activations": "cpu_quantized_activations"}
# --quantization: how a float checkpoint is quantized at load (minisgl/quant/scheme.py).
QUANTIZATIONS = ("int8", "int4", "fp8")
# --lm-head-quantization: the LM head's (and a tied embedding's) format; auto: int8 per channel
# under --quantization, else as the checkpoint has it.
LM_HEAD_QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
# --kv-cache-dtype: what the KV cache holds (auto: the model's dtype; fp8 = fp8_e4m3).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# --speculative-algorithm (SGLang's flag names): where draft tokens come from.
SPECULATIVE_ALGORITHMS = ("ngram", "eagle3")
# Multi-node: the shared secret, when --node-secret-file is not given (never a flag: a command
# line is visible to every user of the machine).
NODE_SECRET_ENV = "MINISGL_NODE_SECRET"
MIN_NODE_SECRET_CHARS = 16


def _f(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    **kw: Any,
) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices:
        meta["choices"] = choices
    if aliases:  # old spellings of the flag the CLI still takes (RENAMED_FIELDS)
        meta["aliases"] = aliases
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class EngineArgs:
    model: str = field(
        metadata={
            "help": "Hugging Face hub id or local directory of a Qwen3 model, or a GGUF file "
            "(llama.cpp's format: a path ending in .gguf, or <owner>/<repo>:<type> on the hub)"
        }
    )
    dtype: str = _f("auto", "weight and activation dtype; auto takes the config's", DTYPES)
    quantization: str | None = _f(
        None,
        "quantize a float checkpoint's attention and MLP weights as they load: int8 (one scale "
        "per output channel), int4 (groups of 128 with zero points) or fp8 (e4m3, 128x128 "
        "block scales); FP8, AWQ, GPTQ, compressed-tensors and AutoRound checkpoints load "
        "quantized without it",
        QUANTIZATIONS,
    )
    lm_head_quantization: str = _f(
        "auto",
        "the LM head's weights (a tied embedding's too: it is looked up from them): auto "
        "quantizes it to int8 per output channel under --quantization and keeps it as the "
        "checkpoint has it otherwise; none keeps it in the float dtype; int8, int4 or fp8 (e4m3, "
        "one scale per row) quantize it at load in any checkpoint",
        LM_HEAD_QUANTIZATIONS,
    )
    kv_cache_dtype: str = _f(
        "auto",
        "what the KV cache holds: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3, "
        "each value rounded to the nearest, no scales, as vLLM's and SGLang's fp8 caches "
        "without calibration): half a bf16 cache's bytes, so twice the tokens fit and a decode "
        "step's attention reads half as much; attention computes in the model's dtype",
        KV_CACHE_DTYPES,
    )
    device: str = _f("auto", "cpu, cuda or auto (cuda when available)", DEVICES)
    num_pages: int | None = _f(None, "KV cache pages; default derived from free memory")
    page_size: int = _f(16, "tokens per KV cache page")
    max_seq_len_override: int | None = _f(
        None, "context length (prompt + output); default: the model's max_position_embeddings"
    )
    max_running_requests: int = _f(256, "most requests in one batch")
    max_prefill_tokens: int = _f(4096, "token budget of one step's prefill (chunked prefill)")
    prefill_chunk_overhead: float = _f(
        0.1,
        "a burst of waiting requests is prefilled a few requests per step, in arrival order, "
        "so that its first requests get their first tokens early: each step's prompt tokens are "
        "sized from the measured step costs so that a step's fixed cost is at most this "
        "fraction of its arithmetic (larger: smaller chunks, earlier first tokens, a longer "
        "prefill in all); 0 prefills a burst in one step, up to --max-prefill-tokens. A request "
        "alone is never chunked by it",
    )
    tp_size: int = _f(1, "tensor-parallel ranks")
    disable_prefix_cache: bool = _f(False, "turn the radix prefix cache off")
    attention_backend: str = _f("auto", "attention implementation", ATTENTION_BACKENDS)
    memory_fraction: float = _f(0.85, "fraction of free memory the KV cache may take by default")
    dist_init_addr: str = _f(
        "127.0.0.1:0",
        "host:port for the tensor-parallel rendezvous (port 0: pick a free one); with "
        "--nnodes > 1 node 0's address as the other nodes reach it and a fixed port (it and "
        "the next 3 ports are used)",
    )
    nnodes: int = _f(1, "nodes the --tp-size ranks are split over, evenly (multi-node)")
    node_rank: int = _f(
        0, "this node's index: node 0 serves the API and rank 0, the others their ranks and /health"
    )
    node_secret_file: str | None = _f(
        None,
        "file holding the secret every node of a multi-node group shares (at least "
        f"{MIN_NODE_SECRET_CHARS} characters): the ports next to --dist-init-addr admit only "
        f"peers that prove they hold it; default: the {NODE_SECRET_ENV} environment variable",
    )
    seed: int = _f(0, "seed of the unseeded random sampling stream")
    cpu_kernel_tuning: str = _f(
        "cached",
        "CPU matmul kernels timed per shape at start-up: cached (reuse earlier timings of this "
        "machine), full (time again), off (fixed defaults)",
        CPU_KERNEL_TUNING,
    )
    cpu_weight_copies_max_gb: float = _f(
        0.0,
        "GB of memory CPU matmuls may spend on second copies of weights (e.g. a oneDNN layout "
        "beside our panels for prefill), given to the layers they speed up most per byte and "
        "logged with what they buy; 0 keeps each weight once, in the layout measured best over "
        "all row counts (the KV cache is sized from what is left)",
    )
    cpu_quantized_activations: str = _f(
        "int16",
        "what integer-coded weights' CPU matmuls multiply their codes by: int16 (default) x "
        "rounded to 15 bits per row, exact to the float model's greedy tokens; int8 x rounded "
        "to 8 bits per block of at most 128 features in matmuls of up to 64 rows (decode "
        "batches; prefill stays exact), as llama.cpp's Q8 activations and vLLM's CPU W8A8 and "
        "AWQ/GPTQ do: results within about half a percent instead of exact. With AVX512-VNNI "
        "it takes 8-bit (--quantization int8, 8-bit GPTQ) and 4-bit weights (one VPDPBUSD per "
        "64 codes and row instead of two: decode batches of 8 rows 0.7x the time for 8-bit), "
        "without it 4-bit weights in groups of 64 or more, or of 32 (Q4_0/Q4_K files) in "
        "rows of a multiple of 64 inputs (0.7-0.8x the time on AVX2); fp8 "
        "stays exact. --cpu-int4-activations is its old name",
        CPU_QUANTIZED_ACTIVATIONS,
        aliases=("--cpu-int4-activations",),
    )
    scheduler_nice: int = _f(
        5,
        "niceness added to the service's scheduler worker (not to LLM): its compute threads "
        "then yield a core at once to the API server and detokenizer when those wake, instead "
        "of after a time slice (measured on 2 cores: ~4 ms off the first token); 0 keeps it",
    )
    grammar_compile_timeout: float = _f(
        30.0,
        "CPU seconds the server may spend compiling one structured-output grammar (in a "
        "worker process, off the scheduler loop); a longer compile fails the requests that "
        "wait for it with a 400",
    )

    speculative_algorithm: str | None = _f(
        None,
        "speculative decoding: ngram (drafts copied from the longest earlier match of the "
        "sequence's last tokens in its prompt and output) or eagle3 (a draft head, "
        "--speculative-draft-model-path); drafts are verified in one forward, output unchanged",
        SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = _f(
        4,
        "most draft tokens proposed per request and step (shrunk per request when few are accepted)",
    )
    disable_speculative_adaptive: bool = _f(
        False,
        "speculative decoding: every request gets --speculative-num-draft-tokens drafts each "
        "step (as SGLang and vLLM do) instead of as many as its acceptance and the measured "
        "step costs make worth it",
    )
    speculative_draft_model_path: str | None = _f(
        None, "EAGLE-3 draft head: hub id or local directory (config.json + safetensors)"
    )
    speculative_ngram_min_match_window_size: int = _f(
        1, "ngram: shortest suffix of the sequence looked up in its earlier tokens"
    )
    speculative_ngram_max_match_window_size: int = _f(
        12, "ngram: longest suffix of the sequence looked up in its earlier tokens"
    )
    disable_cuda_graph: bool = _f(
        False, "CUDA: run decode eagerly instead of replaying CUDA graphs"
    )
    cuda_graph_max_bs: int = _f(
        64, "CUDA: largest decode batch captured as a CUDA graph (buckets 1, 2, 4, 8, 16, 32, ...)"
    )

    @property
    def max_seq_len(self) -> int | None:
        return self.max_seq_len_override


@dataclass(frozen=True)
class ServerArgs(EngineArgs):
    served_model_name: str | None = _f(
        None,
        "model name(s) in the API, comma-separated; all are listed by /v1/models, replies carry "
        "the first; default: --model",
    )
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "port to listen on")
    api_key: str | None = _f(None, "require this bearer token on /v1 endpoints and /openapi.json")
    metrics_require_api_key: bool = _f(False, "require the --api-key bearer token on /metrics too")
    max_queued_requests: int = _f(
        1024,
        "waiting sequences (a request's prompts x n) beyond which a request is answered 503 "
        "(400 when it alone asks for more)",
    )
    shutdown_timeout: float = _f(30.0, "seconds in-flight requests may take to finish on SIGTERM")
    log_level: str = _f("info", "log level", LOG_LEVELS)
    max_request_body_bytes: int = _f(8 * 1024 * 1024, "largest request body accepted")
    max_n: int = _f(16, "most samples (n) one request may ask for; beyond it a 400")
    max_prompts_per_request: int = _f(
        64, "most prompts in one /v1/completions prompt list; beyond it a 400"
    )
    disable_playground: bool = _f(
        False, "do not serve the chat playground page at / and /playground"
    )
    reasoning_parser: str = _f(
        "auto",
        "split <think> blocks into reasoning_content (auto: when the chat template is Qwen3's "
        "thinking template)",
        OUTPUT_PARSERS,
    )
    tool_call_parser: str = _f(
        "auto",
        "parse <tool_call> blocks into tool_calls (auto: when the chat template renders them)",
        OUTPUT_PARSERS,
    )
    trust_request_chat_template: bool = _f(
        False,
        "render a chat template a request brings (chat_template, or chat_template_kwargs."
        "chat_template) in a sandboxed, time-bounded process; off: such a request gets a 400",
    )
    chat_template_timeout: float = _f(
        2.0,
        "seconds a request's own chat template may take to render (with "
        "--trust-request-chat-template); a longer render fails that request with a 400",
    )
    tokenizer_health_timeout: float = _f(
        10.0,
        "seconds the tokenizer worker may leave a heartbeat unanswered before /health answers 503",
    )

    @property
    def model_names(self) -> list[str]:
        names = [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]
        return names or [self.model]

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def engine_args(self) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        return EngineArgs(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _flag_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    if "bool" in text:
        return bool
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def build_parser(
    cls: type = ServerArgs, prog: str = "python -m minisgl", *, explicit_only: bool = False
) -> argparse.ArgumentParser:
    """The CLI of `cls`. No abbreviations: a typo (or `--tp` meant to slip past a check on
    `--tp-size`) is an error, never silently another flag. With `explicit_only`, nothing is
    required and nothing defaulted, so a parse holds exactly the fields the flags set."""
    parser = argparse.ArgumentParser(
        prog=prog, description="minisgl OpenAI-compatible server", allow_abbrev=False
    )
    for f in dataclasses.fields(cls):
        kind = _flag_type(f)
        # argparse expands %-formats in help texts: a literal % must not break --help
        help_text = f.metadata.get("help", "").replace("%", "%%")
        if kind is bool:
            default: Any = argparse.SUPPRESS if explicit_only else False
            parser.add_argument(
                flag_name(f.name), action="store_true", help=help_text, default=default
            )
            continue
        required = f.default is dataclasses.MISSING and not explicit_only
        kwargs: dict[str, Any] = {"type": kind, "help": help_text, "required": required}
        if explicit_only:
            kwargs["default"] = argparse.SUPPRESS
        elif not required:
            kwargs["default"] = f.default
            kwargs["help"] = f"{help_text} (default: {f.default})"
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        names = (flag_name(f.name), *f.metadata.get("aliases", ()))
        parser.add_argument(*names, dest=f.name, **kwargs)
    return parser


# Numeric flags' valid ranges: (lowest, whether the lowest itself is allowed, highest or None).
# Checked before any worker starts: a value outside them used to pass the parser and fail seconds
# later in a worker with a traceback (--page-size 0: ZeroDivisionError; --num-pages -5: a negative
# tensor dimension; --port 70000: bind's OverflowError), or to be read as "unset" (--num-pages 0,
# --max-seq-len-override 0: the defaults, silently).
FLAG_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "num_pages": (1, True, None),
    "page_size": (1, True, None),
    "max_seq_len_override": (1, True, None),
    "max_running_requests": (1, True, None),
    "max_prefill_tokens": (1, True, None),
    "prefill_chunk_overhead": (0, True, None),
    "tp_size": (1, True, None),
    "nnodes": (1, True, None),
    "node_rank": (0, True, None),
    "memory_fraction": (0, False, 1),
    "cpu_weight_copies_max_gb": (0, True, None),
    "grammar_compile_timeout": (0, False, None),
    "speculative_num_draft_tokens": (1, True, None),
    "speculative_ngram_min_match_window_size": (1, True, None),
    "speculative_ngram_max_match_window_size": (1, True, None),
    "cuda_graph_max_bs": (1, True, None),
    "port": (1, True, 65535),
    "max_queued_requests": (1, True, None),
    "shutdown_timeout": (0, True, None),
    "max_request_body_bytes": (1, True, None),
    "max_n": (1, True, None),
    "max_prompts_per_request": (1, True, None),
    "chat_template_timeout": (0, False, None),
    "tokenizer_health_timeout": (0, False, None),
}


def _range_text(low: float, inclusive: bool, high: float | None) -> str:
    if high is not None:
        return f"in {'[' if inclusive else '('}{low}, {high}]"
    return f"{'>=' if inclusive else '>'} {low}"


def check_ranges(args: EngineArgs) -> None:
    """Raise ValueError naming the flag whose value is out of its range (FLAG_RANGES); NaN is
    out of every range."""
    for f in dataclasses.fields(args):
        bounds = FLAG_RANGES.get(f.name)
        value = getattr(args, f.name)
        if bounds is None or value is None:
            continue
        low, inclusive, high = bounds
        above_low = value >= low if inclusive else value > low
        if not (above_low and (high is None or value <= high)):
            raise ValueError(
                f"{flag_name(f.name)} must be {_range_text(low, inclusive, high)}, got {value}"
            )
    lo, hi = (
        args.speculative_ngram_min_match_window_size,
        args.speculative_ngram_max_match_window_size,
    )
    if lo > hi:
        raise ValueError(
            f"--speculative-ngram-min-match-window-size ({lo}) must not exceed "
            f"--speculative-ngram-max-match-window-size ({hi})"
        )


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    args = ServerArgs(**vars(parser.parse_args(argv)))
    try:
        check_ranges(args)
    except ValueError as e:
        # One line (no usage dump to scroll past) and argparse's exit code for a bad flag.
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return args


def to_cli_args(args: EngineArgs, include_defaults: bool = False) -> list[str]:
    """Render args back into flags (the operator uses this for the pod command line)."""
    out: list[str] = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if not include_defaults and f.default is not dataclasses.MISSING and value == f.default:
            continue
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                out.append(flag_name(f.name))
            continue
        out += [flag_name(f.name), str(value)]
    return out
