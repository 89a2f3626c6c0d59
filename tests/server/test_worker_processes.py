"""What the worker processes hold: the tokenizer and detokenizer need only the tokenizer, so
torch (hundreds of MB resident per process) must never be loaded there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import ServerProcess


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_tokenizer_and_detokenizer_processes_never_load_torch(server: ServerProcess) -> None:
    pids = server.stats()["workers"]
    assert "libtorch" in _maps(pids["scheduler"])  # the check can see torch where it is
    for name in ("tokenizer", "detokenizer"):
        maps = _maps(pids[name])
        assert "libtorch" not in maps and "/torch/" not in maps, name
        print(f"{name} worker: {_rss_mb(pids[name]):.0f} MB resident")


def test_worker_modules_import_without_torch(tiny_model_dir: Path) -> None:
    # A fresh interpreter: importing the workers, and loading and using the tokenizer the way
    # they do, leaves torch out of sys.modules.
    code = f"""
import sys
import minisgl.tokenizer.detokenizer_worker as dw
import minisgl.tokenizer.tokenizer_worker as tw
from minisgl.message.api_to_tokenizer import TokenizeRequest
from minisgl.message.scheduler_to_detokenizer import RequestRegistered, TokenBatch, TokenOutput
from minisgl.sampling_params import SamplingParams
from minisgl.tokenizer.without_torch import keep_torch_out

assert "torch" not in sys.modules, "importing the worker modules loaded torch"
keep_torch_out()  # what both workers do first
tok = tw.load_tokenizer({str(tiny_model_dir)!r})
msgs = [{{"role": "user", "content": "hi"}}]
ids = tw.tokenize(tok, TokenizeRequest("r", 0.0, SamplingParams(), 4, messages=msgs))
detok = dw.Detokenizer(tok)
detok.handle(RequestRegistered("r", [], [], True, len(ids)))
(batch,), _ = detok.handle(TokenBatch([TokenOutput("r", ids[-3:], True, "length", 1, 0, 3)]))
assert batch.outputs[0].text
print(sys.modules.get("torch", "absent"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None", out.stdout  # blocked, never loaded


def _nice(pid: int, tid: int) -> int:
    """A thread's nice value (field 19 of its stat line, after the parenthesised name)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_scheduler_threads_yield_to_the_api_server(server: ServerProcess) -> None:
    """The scheduler worker and every compute thread it started run at --scheduler-nice (5 by
    default), so the API server, tokenizer and detokenizer (nice 0) get a core at once when a
    reply or a request wakes them; libzmq's threads (ZMQbg/...), which carry a step's tokens
    out, keep the launcher's priority."""
    pids = server.stats()["workers"]
    tasks = Path(f"/proc/{pids['scheduler']}/task")
    names = {int(t.name): (t / "comm").read_text().strip() for t in tasks.iterdir()}
    compute = [t for t, name in names.items() if not name.startswith("ZMQbg")]
    messaging = [t for t, name in names.items() if name.startswith("ZMQbg")]
    assert len(compute) > 1 and messaging  # torch's compute threads are there too
    assert {_nice(pids["scheduler"], t) for t in compute} == {5}
    assert {_nice(pids["scheduler"], t) for t in messaging} == {0}
    for name in ("tokenizer", "detokenizer"):
        assert _nice(pids[name], pids[name]) == 0, name
