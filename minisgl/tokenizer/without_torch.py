"""Keep torch out of the tokenizer and detokenizer processes.

They need only the tokenizer, but transformers imports torch whenever it is installed (its
configuration module pulls in the RoPE helpers): ~470 MB of resident memory per process for
nothing. An entry of None in sys.modules is Python's own way to mark a module unavailable:
`importlib.util.find_spec` then reports it missing (so transformers takes its tokenizer-only
path) and `import torch` fails fast instead of loading it.
"""

from __future__ import annotations

import os
import sys


def keep_torch_out() -> None:
    """Call first thing in a worker process that must never load torch (never in a process
    that might want torch later: the block lasts for the life of the process)."""
    if "torch" in sys.modules:
        return  # already loaded (not a worker process): blocking it now would break its users
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers says once, as advice, that only tokenizers will work: that is the point.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
