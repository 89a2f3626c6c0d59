"""Memory acceptance for a big quantized mixture: a Qwen3-30B-A3B-shaped checkpoint (all 48
layers, 128 experts, hidden 2048, moe_intermediate 768, 32 q / 4 kv heads of 128, vocab
151,936, untied head) in GPTQ-Int4 (Qwen's own release format: 4 bits, group 128, symmetric)
starts on a machine with 24 GB and decodes a few tokens; the scheduler's resident memory is
compared with what it must hold, the weights (as the start-up log counts them) and the KV cache:
the target is RSS <= weights + KV + 0.6 GB.

    python benchmarks/big_moe_memory.py                      # write, start, decode, measure, delete
    python benchmarks/big_moe_memory.py --dir D --keep       # keep the ~16 GB checkpoint for reruns
    python benchmarks/big_moe_memory.py --num-layers 4       # a quick look at a shallower shape

The checkpoint is written layer by layer (minisgl/testing/quant_model_writer.py, one shard per
layer; ~16 GB on disk). By default its codes are random in the GPTQ layout (`--source codes`):
quantizing 29 billion random floats takes hours on a small shared machine, and memory depends on
the layout only; `--source quantized` quantizes the fixture's random floats instead.

The server is started only when the machine has `--min-available-gb` available (MemAvailable),
with a tiny KV cache (`--num-pages`), and stopped right after the measurement; while it starts,
the script watches the machine and stops it if available memory falls under
`--stop-below-gb` (other jobs on a shared machine come first).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from minisgl.testing.live_server import free_port, stop_process, wait_http_ok

GIB, MIB = 1 << 30, 1 << 20
WEIGHTS_LINE = re.compile(r"([\d.]+) MiB quantized in (\d+) weights \+ ([\d.]+) MiB float")
KV_LINE = re.compile(r"KV cache: (\d+) pages x (\d+) tokens \(([\d.]+) MiB\)")
TARGET_OVERHEAD_GB = 0.6


def log(msg: str) -> None:
    print(msg, flush=True)


def available_gb() -> float:
    return psutil.virtual_memory().available / GIB


def rss_parts(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon and RssFile of a process, in bytes (/proc/PID/status)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def write_checkpoint(args: argparse.Namespace) -> Path:
    from minisgl.testing.quant_model_writer import FORMATS, write_quantized_model

    out = Path(args.dir)
    if (out / "config.json").exists() and (out / "model.safetensors.index.json").exists():
        log(f"using the checkpoint already in {out}")
        return out
    log(
        f"writing a {args.preset} checkpoint ({args.format}, {args.source}) layer by layer to {out}"
    )
    t0 = time.monotonic()
    write_quantized_model(
        out, args.preset, FORMATS[args.format], source=args.source,
        num_hidden_layers=args.num_layers, progress=True,
    )  # fmt: skip
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    log(f"wrote {size / GIB:.2f} GiB in {time.monotonic() - t0:.0f} s")
    return out


def stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc, timeout_s=60, group=True)  # the server and the workers it spawned


def scheduler_pid(base: str) -> int | None:
    try:
        stats = httpx.get(f"{base}/internal/stats", timeout=5).json()
    except httpx.HTTPError:
        return None
    return next((pid for name, pid in stats["workers"].items() if "scheduler" in name), None)


def largest_child(proc: subprocess.Popen[bytes]) -> psutil.Process | None:
    """While it loads: the server's child with the most resident memory (the scheduler)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
        return max(kids, key=lambda p: p.memory_info().rss, default=None)
    except psutil.Error:
        return None


def wait_ready(proc: subprocess.Popen[bytes], base: str, args: argparse.Namespace) -> float:
    """Waits for /health; returns the largest child RSS seen meanwhile (bytes). Stops the server
    (SystemExit) if it dies, takes too long, or the machine runs short of memory."""
    peak = 0.0

    def watch() -> None:
        nonlocal peak
        if available_gb() < args.stop_below_gb:
            stop(proc)
            raise SystemExit(
                f"stopped the server: the machine's available memory fell under "
                f"{args.stop_below_gb} GB while it loaded"
            )
        child = largest_child(proc)
        if child is not None:
            with contextlib.suppress(psutil.Error):  # it may have just exited
                peak = max(peak, child.memory_info().rss)

    ok = wait_http_ok(
        proc, f"{base}/health", args.startup_timeout,
        interval_s=1.0, probe_timeout_s=2.0, each_poll=watch,
    )  # fmt: skip
    if ok:
        return peak
    if proc.poll() is not None:
        raise SystemExit(f"the server exited ({proc.returncode}) while starting")
    stop(proc)
    raise SystemExit(f"the server was not ready in {args.startup_timeout:.0f} s")


def measure(model: Path, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    have, until = available_gb(), time.monotonic() + args.wait_for_memory
    while have < args.min_available_gb and time.monotonic() < until:
        time.sleep(10)
        have = available_gb()
    if have < args.min_available_gb:
        raise SystemExit(
            f"only {have:.1f} GB available (want {args.min_available_gb}): not starting the "
            "server; rerun when the machine is quieter (--keep keeps the checkpoint meanwhile)"
        )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = workdir / "server.log"
    cmd = [
        sys.executable, "-m", "minisgl", "--model", str(model), "--device", "cpu",
        "--num-pages", str(args.num_pages), "--page-size", "16",
        "--max-seq-len-override", str(args.num_pages * 16), "--max-running-requests", "1",
        "--cpu-kernel-tuning", args.cpu_kernel_tuning, "--port", str(port),
        "--log-level", "info",
    ]  # fmt: skip
    log(f"{have:.1f} GB available; starting: {' '.join(cmd)} (log: {server_log})")
    t0 = time.monotonic()
    with open(server_log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        peak_seen = wait_ready(proc, base, args)
        ready_s = time.monotonic() - t0
        pid = scheduler_pid(base)
        if pid is None:
            raise SystemExit("no scheduler pid in /internal/stats")
        t1 = time.monotonic()
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": "m", "prompt": "The capital of France is", "max_tokens": args.tokens,
                  "temperature": 0, "ignore_eos": True},
            timeout=args.startup_timeout,
        )  # fmt: skip
        r.raise_for_status()
        decode_s = time.monotonic() - t1
        tokens = r.json()["usage"]["completion_tokens"]
        mem = rss_parts(pid)
    finally:
        stop(proc)
    text = server_log.read_text(errors="replace")
    w, kv = WEIGHTS_LINE.search(text), KV_LINE.search(text)
    if not w or not kv:
        raise SystemExit(f"no weights/KV cache line in the server log {server_log}")
    weights = (float(w.group(1)) + float(w.group(3))) * MIB
    kv_bytes = float(kv.group(3)) * MIB
    return {
        "quantized_weights": float(w.group(1)) * MIB,
        "float_weights": float(w.group(3)) * MIB,
        "weights": weights,
        "kv": kv_bytes,
        "rss": mem["VmRSS"],
        "rss_anon": mem.get("RssAnon", 0),
        "rss_file": mem.get("RssFile", 0),
        "peak": max(mem["VmHWM"], peak_seen),
        "over": mem["VmRSS"] - weights - kv_bytes,
        "ready_s": ready_s,
        "decode_s": decode_s,
        "tokens": tokens,
    }


def report(m: dict[str, float]) -> None:
    gb = 1e9
    log(f"weights: {m['weights'] / gb:.2f} GB ({m['quantized_weights'] / gb:.2f} GB quantized "
        f"+ {m['float_weights'] / gb:.2f} GB float); KV cache {m['kv'] / MIB:.1f} MiB")  # fmt: skip
    log(f"scheduler RSS after {m['tokens']:.0f} tokens: {m['rss'] / gb:.2f} GB "
        f"(anonymous {m['rss_anon'] / gb:.2f}, file-backed {m['rss_file'] / gb:.2f}); "
        f"peak {m['peak'] / gb:.2f} GB")  # fmt: skip
    verdict = "within" if m["over"] <= TARGET_OVERHEAD_GB * gb else "OVER"
    log(f"RSS - weights - KV = {m['over'] / gb:.2f} GB: {verdict} the {TARGET_OVERHEAD_GB} GB "
        f"target")  # fmt: skip
    log(f"ready in {m['ready_s']:.0f} s; {m['tokens']:.0f} tokens in {m['decode_s']:.1f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/minisgl-a3b-gptq4", help="the checkpoint's directory")
    p.add_argument("--preset", default="30b-a3b")
    p.add_argument("--num-layers", type=int, default=None, help="the preset's (48)")
    p.add_argument("--format", default="gptq", choices=("gptq", "gptq8", "awq"))
    p.add_argument("--source", default="codes", choices=("codes", "quantized"))
    p.add_argument("--num-pages", type=int, default=16, help="KV cache pages of 16 tokens")
    p.add_argument("--tokens", type=int, default=4, help="tokens to decode")
    p.add_argument("--cpu-kernel-tuning", default="off", choices=("off", "cached", "full"))
    p.add_argument("--min-available-gb", type=float, default=19.0)
    p.add_argument("--wait-for-memory", type=float, default=0.0,
                   help="seconds to wait for --min-available-gb before giving up")  # fmt: skip
    p.add_argument("--stop-below-gb", type=float, default=1.5)
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    p.add_argument("--write-only", action="store_true", help="write the checkpoint, no server")
    args = p.parse_args()
    model = write_checkpoint(args)
    try:
        if args.write_only:
            return 0
        workdir = Path(args.dir).with_name(Path(args.dir).name + "-logs")
        workdir.mkdir(exist_ok=True)
        report(measure(model, args, workdir))
    finally:
        if not args.keep and not args.write_only:
            shutil.rmtree(model, ignore_errors=True)
            log(f"deleted {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
