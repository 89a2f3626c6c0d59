"""The loader reads a sharded checkpoint one file at a time: a shard it has finished is no
longer mapped, so while a big model loads the process holds the weights it built plus one
shard, not the whole checkpoint's pages as well (a 16 GB checkpoint on a 24 GB machine)."""

from __future__ import annotations

from pathlib import Path

from minisgl.models.loader import checkpoint_files, iter_tensors
from minisgl.testing.fixture import write_fixture_model


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_finished_shard_is_unmapped_before_the_next_is_read(tmp_path: Path) -> None:
    model = write_fixture_model(tmp_path / "m", "tiny", num_shards=3)
    files = checkpoint_files(model)
    assert len(files) == 3
    seen: list[Path] = []
    shard_of = {}
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            shard_of |= dict.fromkeys(h.keys(), f)  # noqa: SIM118 - safe_open is not a mapping
    for name, _ in iter_tensors(files, progress=False):
        f = shard_of[name]
        if not seen or seen[-1] != f:
            assert not any(_mapped(done) for done in seen), f"{seen} still mapped at {f}"
            seen.append(f)
    assert seen == files
