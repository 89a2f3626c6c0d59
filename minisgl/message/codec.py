"""msgpack codec for message dataclasses: no pickle on the wire.

Each registered dataclass travels as a msgpack extension object holding its wire tag and a map
of its fields; nested registered dataclasses (a batch of outputs, sampling params) round-trip
too. An extension type, not a reserved map key: user data (chat_template_kwargs is a free
dict) can never be mistaken for a message. Decoding only builds classes from the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from minisgl.logprobs import TokenLogprobs
from minisgl.sampling_params import SamplingParams

T = TypeVar("T")
_EXT = 1
_BY_TAG: dict[str, type] = {}
_BY_CLASS: dict[type, str] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}  # a registered class's field names, in order
# msgpack's packer starts with a 256 KB buffer: one per encode call, and a nested message is
# encoded inside its parent's, so glibc grew and trimmed the heap (brk) about three times per
# token batch, 2/3 of its encoding time (20 -> 6.6 us). It grows the buffer when it must.
_BUF_BYTES = 1024


class CodecError(ValueError):
    pass


def register(tag: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a dataclass encodable under a unique wire tag."""

    def wrap(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        if tag in _BY_TAG and _BY_TAG[tag] is not cls:
            raise ValueError(f"wire tag {tag!r} is taken by {_BY_TAG[tag].__name__}")
        _BY_TAG[tag] = cls
        _BY_CLASS[cls] = tag
        _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
        return cls

    return wrap


register("sampling_params")(SamplingParams)
register("token_logprobs")(TokenLogprobs)


def _default(obj: Any) -> Any:
    tag = _BY_CLASS.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message")
    # Shallow on purpose: nested registered dataclasses go through _default again.
    fields = {name: getattr(obj, name) for name in _FIELDS[type(obj)]}
    return msgpack.ExtType(_EXT, encode([tag, fields]))


def _ext_hook(code: int, payload: bytes) -> Any:
    if code != _EXT:
        raise CodecError(f"unknown extension type {code}")
    tag, fields = decode(payload)
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise CodecError(f"unknown message tag {tag!r}")
    return cls(**fields)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True, buf_size=_BUF_BYTES)


def decode(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as exc:  # malformed bytes, wrong fields for a class
        raise CodecError(f"undecodable message: {exc}") from exc
