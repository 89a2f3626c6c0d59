"""A NaN or infinite sampling field is refused as not a finite number, not as out of bounds."""

from __future__ import annotations

import pydantic
import pytest

from minisgl.server.protocol import SamplingFields

FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_float_says_finite(field: str, value: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        SamplingFields.model_validate_json(f'{{"{field}": {value}}}')
    errors = err.value.errors()
    assert [e["loc"] for e in errors] == [(field,)]
    assert "must be a finite number" in errors[0]["msg"]


def test_bounds_and_types_still_checked() -> None:
    with pytest.raises(pydantic.ValidationError, match="less than or equal to 100"):
        SamplingFields.model_validate({"temperature": 101.0})
    with pytest.raises(pydantic.ValidationError, match="valid number"):
        SamplingFields.model_validate({"temperature": "hot"})
    assert SamplingFields.model_validate({"temperature": 0, "top_p": "0.5"}).top_p == 0.5
