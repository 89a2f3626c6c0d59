"""Exploratory findings in the engine and scheduler."""

from __future__ import annotations

import pytest

from minisgl.config import EngineArgs
from minisgl.engine.factory import create_engine


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_pages": 0}, "--num-pages must be >= 1"),  # used to mean "derive from memory"
        ({"max_seq_len_override": 0}, "--max-seq-len-override must be >= 1"),  # the model's
        ({"page_size": 0}, "--page-size must be >= 1"),  # ZeroDivisionError after loading
        ({"tp_size": 0}, "--tp-size must be >= 1"),
    ],
)
def test_engine_refuses_out_of_range_args_before_loading(
    kwargs: dict[str, int], message: str
) -> None:
    # The model path does not exist: the refusal comes before anything is read.
    with pytest.raises(ValueError, match=message):
        create_engine(EngineArgs(model="/nonexistent", **kwargs))  # type: ignore[arg-type]
