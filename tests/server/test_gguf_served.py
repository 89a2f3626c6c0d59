"""`python -m minisgl --model model.gguf`: a GGUF file as llama.cpp's converter writes it, served
as a user runs it. Every process reads the file through the directory prepared for it: the
tokenizer workers tokenize and apply the chat template from the file (as the source checkpoint's
own tokenizer does), the scheduler runs its Q8_0 projections as they are, /metrics says so."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

from minisgl.testing.fixture import write_fixture_model
from minisgl.testing.live_server import free_port
from minisgl.testing.llama_cpp_converter import convert
from minisgl.testing.scratch_cache import scratch_cache

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture_model(tmp_path_factory.mktemp("src"), "quant")


def _hub_cache(root: Path, repo: str, files: dict[str, Path]) -> Path:
    """A Hugging Face cache (HF_HOME) holding `repo`'s main revision with `files`, as
    huggingface_hub lays one out (a snapshot's files link to blobs named by their digest), for
    a run with HF_HUB_OFFLINE=1."""
    entry = root / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (entry / "blobs").mkdir()
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(snapshot.name)
    for name, src in files.items():
        blob = entry / "blobs" / hashlib.sha256(name.encode()).hexdigest()
        shutil.copyfile(src, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return root


@pytest.fixture(scope="module")
def server(source_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Served as `--model acme/Tiny-GGUF:q8_0` (vLLM's and llama.cpp's repo:type), the file
    found in the Hugging Face cache offline."""
    work = tmp_path_factory.mktemp("gguf-served")
    path = convert(source_dir, work / "model-q8_0.gguf", "q8_0")
    hub = _hub_cache(work / "hf", "acme/Tiny-GGUF", {"Tiny-Q8_0.gguf": path})
    with scratch_cache(work / "cache"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(hub))
        mp.setenv("HF_HUB_OFFLINE", "1")
        srv = ServerProcess(
            "acme/Tiny-GGUF:q8_0", work / "server.log",
            "--num-pages", "128", "--cpu-kernel-tuning", "off", "--log-level", "info",
        )  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_chat_uses_the_files_tokenizer_and_template(server: ServerProcess, source_dir: Path):
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    messages = [{"role": "user", "content": "Say hello in French, then in 中文."}]
    reply = client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    source = AutoTokenizer.from_pretrained(str(source_dir))
    prompt = source.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(source(prompt).input_ids)
    done = client.completions.create(model="m", prompt="Bonjour, 世界", max_tokens=5)
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(source("Bonjour, 世界").input_ids)
    assert done.choices[0].text


def test_metrics_and_log_say_gguf(server: ServerProcess) -> None:
    assert "weights: gguf Q8_0 (8-bit, a scale per 32)" in server.logs()
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    labels = samples["minisgl_model_info"].labels
    assert (labels["quantization"], labels["lm_head"]) == ("gguf", "gguf")


def test_a_file_that_is_not_gguf_stops_the_start_with_its_reason(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "model.gguf"
    bad.write_text("not a GGUF file")
    with scratch_cache(tmp_path / "cache"):
        done = subprocess.run(
            [sys.executable, "-m", "minisgl", "--model", str(bad), "--port", str(free_port())],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot open GGUF file {bad}: {bad} is not a GGUF file (no GGUF magic)" in done.stderr
    assert "Traceback" not in done.stderr


def test_hub_names_resolve_to_one_file_or_say_why(tmp_path: Path, source_dir: Path) -> None:
    import subprocess
    import sys

    src = tmp_path / "f.gguf"
    src.write_bytes(b"GGUF")
    hub = _hub_cache(tmp_path / "hf", "acme/Two-GGUF",
                     {"Two-Q4_K_M.gguf": src, "Two-UD-Q4_K_M.gguf": src, "Two-Q8_0.gguf": src})  # fmt: skip
    code = (
        "import sys\n"
        "from minisgl.models.gguf import local_file\n"
        "for spec in sys.argv[1:]:\n"
        "    try:\n"
        "        print(local_file(spec).name)\n"
        "    except FileNotFoundError as e:\n"
        "        print(e)\n"
    )
    env = {**os.environ, "HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"}
    specs = ["acme/Two-GGUF:Q8_0", "acme/Two-GGUF:ud-q4_k_m", "acme/Two-GGUF:Q4_K_M",
             "acme/Two-GGUF:Q5_0", "acme/Gone-GGUF:Q8_0"]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *specs], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()  # fmt: skip
    assert out[0] == "Two-Q8_0.gguf"
    assert out[1] == "Two-UD-Q4_K_M.gguf"
    assert out[2].endswith("has 2 files whose name ends in Q4_K_M.gguf (Two-Q4_K_M.gguf, "
                           "Two-UD-Q4_K_M.gguf); name one file: acme/Two-GGUF:<its type>, or a "
                           "local path")  # fmt: skip
    assert "has 0 files whose name ends in Q5_0.gguf (none)" in out[3]
    assert out[4].startswith("GGUF 'acme/Gone-GGUF:Q8_0': cannot fetch 'acme/Gone-GGUF'")
