"""Give the model's quantized layers QuantWeight buffers in place of their float weights, before
the model is materialised (so no float copy of a quantized layer is ever allocated), and say
what the model holds in one line."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torch import nn

from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import LinearBase, RowParallelLinear
from minisgl.layers.moe import FusedMoE
from minisgl.quant.layout import CheckpointLayout
from minisgl.quant.scheme import QuantScheme
from minisgl.quant.weight import QuantWeight, multiplied_weights

logger = logging.getLogger(__name__)

# minisgl's fused projections -> the checkpoint's modules they hold, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _hf_modules(name: str) -> list[str]:
    parent, _, last = name.rpartition(".")
    return [f"{parent}.{p}" for p in FUSED[last]] if last in FUSED else [name]


# The smallest group the kernels take: the CPU C kernels read groups of a multiple of 32
# features (cpu_gemv.usable), torch's CUDA int4 matmul groups of 32, 64, 128 or 256.
KERNEL_GROUP = 32
LARGEST_TP = 64  # the tensor-parallel sizes an error names go up to this


@dataclass(frozen=True)
class Regrouped:
    """A row-parallel weight whose rank's input features cut a quantization group: held in
    groups of `group`, each with the scale and zero point of the `source_group` it is in."""

    what: str  # "o_proj", "down_proj", "experts' down_proj"
    in_features: int  # the whole weight's
    per_rank: int
    source_group: int
    group: int


def rank_group(g: int, k: int, k_full: int) -> int:
    """The group size a rank holding k of a row's k_full input features keeps: the source's g
    where its share is whole groups, else gcd(g, k), which also divides every rank's first
    feature (a multiple of k), so the source's groups are whole numbers of these
    (qtensor.QTensor.narrow cuts the same)."""
    if not g or k == k_full or k % g == 0:
        return g
    return math.gcd(g, k)


def _tp_sizes_that_work(g: int, k_full: int) -> list[int]:
    sizes = range(1, min(k_full, LARGEST_TP) + 1)
    return [t for t in sizes if k_full % t == 0 and _kernels_take(g, k_full // t, k_full)]


def _kernels_take(g: int, k: int, k_full: int) -> bool:
    g2 = rank_group(g, k, k_full)
    return g2 == g or g2 % KERNEL_GROUP == 0


def _holder(
    scheme: QuantScheme, n: int, k: int, k_full: int, split_k: bool, experts: int = 0
) -> QuantWeight:
    g = scheme.group_size
    if split_k and k != k_full:
        if g and not scheme.desc_act and not _kernels_take(g, k, k_full):
            whose = (
                f"--quantization {scheme.method}'s"
                if scheme.source == "load"
                else "the checkpoint's quantization"
            )
            sizes = ", ".join(map(str, _tp_sizes_that_work(g, k_full)))
            raise ValueError(
                f"tensor parallelism splits {k_full} input features into {k}, inside "
                f"{whose} groups of {g}: a rank would hold groups of {rank_group(g, k, k_full)}, "
                f"and the quantized kernels take groups of a multiple of {KERNEL_GROUP}; "
                f"tensor-parallel sizes that split this weight into such groups: {sizes}"
            )
        if scheme.bits == 4 and k % 2:
            raise ValueError("tensor parallelism would split a 4-bit weight inside a byte")
    if scheme.desc_act:
        groups = -(-k_full // g)
    else:
        g = rank_group(g, k, k_full)
        groups = -(-k // g) if g else 1
    # compact mins where the rank holds whole super-blocks (a cut inside one: float32 mins,
    # as QTensor.narrow gives them)
    per = scheme.mins_per
    mins_per = per if per and g == scheme.group_size and groups % per == 0 else 0
    return QuantWeight(
        n,
        k,
        bits=scheme.bits,
        fp8=scheme.method == "fp8",
        group_size=g,
        groups=groups,
        scattered_groups=scheme.desc_act,
        experts=experts,
        mins=scheme.mins,
        mins_per=mins_per,
    )


def _all_or_none(name: str, modules: list[str], layout: CheckpointLayout) -> bool:
    """Whether a mixture's experts (`modules`, held as one weight) are quantized: all or none."""
    quantized = [m in layout.quantized for m in modules]
    if any(quantized) and not all(quantized):
        plain = next(m for m, q in zip(modules, quantized, strict=True) if not q)
        raise ValueError(
            f"{plain} is unquantized in the checkpoint but the other experts' projections "
            f"minisgl holds with it in {name} are quantized; minisgl needs them alike"
        )
    return all(quantized)


def _one_scheme(name: str, modules: list[str], scheme: QuantScheme) -> QuantScheme:
    """The format of a mixture's experts minisgl holds as one weight: a mixed-precision
    checkpoint must store them alike."""
    found = {m: scheme.for_module(m) for m in modules}
    kinds = set(found.values())
    if len(kinds) > 1:
        a = modules[0]
        b = next(m for m in modules if found[m] != found[a])
        raise ValueError(
            f"{a} and {b} are stored in different formats, but minisgl holds {name} as one "
            "weight: a mixed-precision checkpoint must keep a layer's experts alike"
        )
    one = kinds.pop()
    assert one is not None  # _all_or_none() passed only quantized modules
    return one


def _runs(
    modules: list[str], rows: list[int], layout: CheckpointLayout, scheme: QuantScheme
) -> list[tuple[QuantScheme | None, int]]:
    """A fused layer's projections (q/k/v, gate/up) as runs of one format each: (the scheme,
    None for float; their rows)."""
    out: list[tuple[QuantScheme | None, int]] = []
    for module, n in zip(modules, rows, strict=True):
        own = scheme.for_module(module) if module in layout.quantized else None
        if out and out[-1][0] == own:
            out[-1] = (own, out[-1][1] + n)
        else:
            out.append((own, n))
    return out


def attach_head(model: nn.Module, scheme: QuantScheme | None) -> int:
    """The LM head holds a QuantWeight of `scheme` (None: it stays float); a tied embedding
    holds the same one and looks its rows up in it. Returns 1 if the head is quantized."""
    if scheme is None:
        return 0
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert len(heads) == 1, "a model with one LM head"
    head = heads[0]
    tied = next(
        (
            m
            for m in model.modules()
            if isinstance(m, VocabParallelEmbedding)
            and not isinstance(m, ParallelLMHead)
            and m.weight is head.weight
        ),
        None,
    )
    n, k = head.weight.shape
    head.quantize_as(_holder(scheme, n, k, k, False), tied)
    return 1


def attach_embedding(model: nn.Module, scheme: QuantScheme | None) -> None:
    """An untied embedding table stored quantized (a GGUF file's token_embd in a type the
    kernels hold) holds a QuantWeight of `scheme`, whose rows its lookups dequantize, in
    place of a float copy of the table (Qwen3-8B's: 1.2 GB in bf16)."""
    if scheme is None:
        return
    embed = next(
        m
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    )
    n, k = embed.weight.shape
    table = _holder(scheme, n, k, k, False)
    table.multiplied = False
    embed.use_quantized(table)


def attach(model: nn.Module, layout: CheckpointLayout) -> int:
    """Swap in QuantWeight buffers for every linear the layout has quantized, and the LM head
    where it is quantized at load; returns how many layers (a mixture's experts count as two:
    w13 and w2, each quantized or not) now hold quantized weights. Rank 0 logs, in one line,
    the weights tensor parallelism cut inside their quantization groups (held in smaller
    ones)."""
    count = attach_head(model, layout.head)
    attach_embedding(model, layout.embedding)
    scheme = layout.scheme
    if scheme is None or not layout.quantized:
        return count
    regrouped: list[Regrouped] = []
    rank = 0
    for name, m in list(model.named_modules()):
        if isinstance(m, LinearBase):
            runs = _runs(_hf_modules(name), m.projection_rows(), layout, scheme)
            # Projections in different formats (a GGUF Q4_K_M file's Q6_K v beside Q4_K q/k):
            # held as parts, each in its own.
            parts = [m] if len(runs) == 1 else m.split([n for _, n in runs])
            for part, (own, _) in zip(parts, runs, strict=True):
                if own is None:
                    continue
                n, k = part.weight.shape
                split_k = isinstance(m, RowParallelLinear)
                k_full = k * m.tp_size if split_k else k
                del part.weight
                held = _holder(own, n, k, k_full, split_k)
                part.weight = held  # type: ignore[assignment]
                _note(regrouped, name.rpartition(".")[2], held, k_full, own.group_size)
                count += 1
            rank = m.tp_rank
        elif isinstance(m, FusedMoE):  # w13 and w2 each quantized or float (fused_moe)
            experts = range(m.num_experts)
            up = [f"{name}.{e}.{p}" for e in experts for p in ("gate_proj", "up_proj")]
            down = [f"{name}.{e}.down_proj" for e in experts]
            e, n13, h = m.w13.shape
            _, _, i = m.w2.shape
            if _all_or_none(f"{name}'s gate/up", up, layout):
                own13 = _one_scheme(f"{name}'s gate/up", up, scheme)
                del m.w13
                m.w13 = _holder(own13, n13, h, h, False, e)  # type: ignore[assignment]
                count += 1
            if _all_or_none(f"{name}'s down_proj", down, layout):
                own2 = _one_scheme(f"{name}'s down_proj", down, scheme)
                del m.w2
                w2 = _holder(own2, h, i, i * m.tp_size, True, e)
                m.w2 = w2  # type: ignore[assignment]
                _note(regrouped, "experts' down_proj", w2, i * m.tp_size, own2.group_size)
                count += 1
            rank = m.tp_rank
    if regrouped and rank == 0:
        logger.info(regrouped_line(regrouped, scheme))
    return count


def _note(out: list[Regrouped], what: str, w: QuantWeight, k_full: int, group: int) -> None:
    if w.group_size != group:
        out.append(Regrouped(what, k_full, w.in_features, group, w.group_size))


def regrouped_line(weights: list[Regrouped], scheme: QuantScheme) -> str:
    """'quantization groups cut by tensor parallelism: experts' down_proj (48 layers): 192 of
    768 input features a rank, inside the checkpoint's groups of 128: held in groups of 64
    (...)' for the start-up log."""
    counts: dict[Regrouped, int] = {}
    for r in weights:
        counts[r] = counts.get(r, 0) + 1
    whose = "--quantization's" if scheme.source == "load" else "the checkpoint's"
    parts = [
        f"{r.what} ({n} layer{'s' * (n > 1)}): {r.per_rank} of {r.in_features} input features "
        f"a rank, inside {whose} groups of {r.source_group}: held in groups of {r.group}"
        for r, n in counts.items()
    ]
    line = "quantization groups cut by tensor parallelism: " + "; ".join(parts)
    line += " (each with the scale and zero point of the group it is part of: the same weights)"
    exact = [r for r in counts if not x8_takes_4_bit(r.per_rank, r.group)]
    if scheme.bits == 4 and exact:
        line += (
            "; --cpu-quantized-activations int8 takes 4-bit groups of 64 or more, or of 32 in "
            "rows of a multiple of 64 inputs: it leaves "
            + ", ".join(f"{r.what} ({r.per_rank} inputs in groups of {r.group})" for r in exact)
            + " exact"
        )
    return line


def x8_takes_4_bit(k: int, group: int) -> bool:
    """Whether --cpu-quantized-activations int8 rounds x for 4-bit codes in groups of `group`
    features, k of them a row: groups of 64 or more, or of 32 two to a block of 64 features
    (qgemv.c's qgemv_x8_takes, the same in either build; an AVX-512 build without VNNI rounds
    none, which the loader says)."""
    if group <= 0 or k % group or group % 32:
        return False
    return group % 64 == 0 or (group == 32 and k % 64 == 0)


def after_materialise(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, QuantWeight):
            m.reset()


def weight_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(bytes of quantized weights, how many quantized weights, bytes of everything else the
    model holds: embeddings, norms, a float LM head, routers), each tensor counted once (a
    tied quantized head and embedding are one QuantWeight). A weight the
    CPU kernels moved into a layout of their own (cpu_linear.py: left on the meta device) is
    counted at its size: the copy holds as many bytes."""
    quant = [m for m in model.modules() if isinstance(m, QuantWeight)]
    qbytes = sum(m.nbytes() for m in quant)
    seen: set[int] = set()
    fbytes = 0
    for m in model.modules():
        if isinstance(m, QuantWeight):
            continue
        for t in m.parameters(recurse=False):
            if id(t) not in seen:
                seen.add(id(t))
                fbytes += t.numel() * t.element_size()
    return qbytes, len(quant), fbytes


def _head(model: nn.Module) -> QuantWeight | None:
    head = next((m for m in model.modules() if isinstance(m, ParallelLMHead)), None)
    return head.weight if head is not None and isinstance(head.weight, QuantWeight) else None


def format_name(model: nn.Module, scheme: QuantScheme | None) -> str:
    """The weights' format for /metrics: the scheme's method (fp8, awq, gptq, compressed-tensors,
    int8, int4), or "none" for a model whose layers are unquantized (its LM head may be: the log
    says)."""
    head = _head(model)
    quantized = any(m is not head for m in multiplied_weights(model))
    return scheme.method if scheme is not None and quantized else "none"


def summary(
    model: nn.Module,
    scheme: QuantScheme | None,
    head: QuantScheme | None = None,
    embedding: QuantScheme | None = None,
) -> str:
    """'weights: <format>; LM head: <format>[; embedding: <format>]; T MiB: X MiB quantized in
    N weights + Y MiB float' for the log (`embedding`: an untied table held quantized)."""
    qbytes, count, fbytes = weight_bytes(model)
    mib = 1 << 20
    quantized_head = _head(model)
    table = any(isinstance(m, QuantWeight) and not m.multiplied for m in model.modules())
    layers = count - (quantized_head is not None) - table
    what = scheme.describe() if scheme is not None and layers else "unquantized"
    if quantized_head is None:
        head_what, floats = "float", "embeddings, norms, LM head, routers"
    else:
        head_what = head.describe() if head is not None else "quantized"
        tied = quantized_head.looked_up
        head_what += " (the tied embedding looks its rows up in it)" if tied else ""
        floats = "norms, routers" if tied else "embeddings, norms, routers"
    if table:
        kind = embedding.describe() if embedding is not None else "quantized"
        head_what += f"; embedding: {kind} (its rows dequantized as they are looked up)"
        floats = floats.replace("embeddings, ", "")
    return (
        f"weights: {what}; LM head: {head_what}; {(qbytes + fbytes) / mib:.1f} MiB: "
        f"{qbytes / mib:.1f} MiB quantized in {count} weights + {fbytes / mib:.1f} MiB float "
        f"({floats})"
    )
