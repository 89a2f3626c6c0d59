"""ipc endpoints of one launch, in a private directory (two servers never collide)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Endpoints:
    root: str
    tokenizer: str  # PULL bound by the tokenizer worker
    scheduler: str  # PULL bound by scheduler rank 0
    detokenizer: str  # PULL bound by the detokenizer worker
    api: str  # PULL bound by the API server

    @classmethod
    def create(cls) -> Endpoints:
        # mkdtemp: mode 0700 and a unique name, so the sockets are private to this user/launch.
        root = tempfile.mkdtemp(prefix="minisgl-")

        def ep(name: str) -> str:
            return f"ipc://{Path(root) / name}"

        return cls(root, ep("tokenizer"), ep("scheduler"), ep("detokenizer"), ep("api"))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
