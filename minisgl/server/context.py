"""Everything the HTTP handlers share within one API server process."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from minisgl.config import ServerArgs
from minisgl.server.arrivals import Arrivals
from minisgl.server.manager import RequestManager

log = logging.getLogger("minisgl.api")


@dataclass
class ServerContext:
    args: ServerArgs
    manager: RequestManager
    metrics: Any  # minisgl.metrics.ServerMetrics
    max_seq_len: int | None = None
    vocab_size: int | None = None
    worker_pids: dict[str, int] = field(default_factory=dict)
    ipc_dir: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False  # model loaded and a ping went round every worker
    draining: bool = False
    dead_worker: str | None = None
    reasoning_parser: bool = False  # chat: split <think> blocks into reasoning_content
    # By enable_thinking (unset, true, false): the template's generation prompt opens the
    # think block, so the output starts in it (chat_render.prefilled_think).
    prefilled_think: dict[str, bool] = field(default_factory=dict)
    tool_call_parser: bool = False  # chat: parse <tool_call> blocks into tool_calls
    special_tags: tuple[str, ...] = ()  # the parsers' tags the tokenizer marks special
    # Generation requests this server holds that were not handed on yet (arrivals.py).
    arrivals: Arrivals = field(default_factory=Arrivals)

    @property
    def model_name(self) -> str:
        return self.args.model_name
