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
        return cls

    return wrap


register("sampling_params")(SamplingParams)
register("token_logprobs")(TokenLogprobs)


def _default(obj: Any) -> Any:
    tag = _BY_CLASS.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message")
    # Shallow on purpose: nested registered dataclasses go through _default again.
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
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
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as exc:  # malformed bytes, wrong fields for a class
        raise CodecError(f"undecodable message: {exc}") from exc
