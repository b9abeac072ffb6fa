"""JSON's numbers as the request models take them.

JSON has one number type: `2` and `2.0` are the same value, and clients written in languages
whose numbers are all floats (JavaScript's JSON.stringify writes 2, but a Python client that
computed `n = total / 4` sends 2.0) write whole numbers either way. The request models are
strict (`"2"` is not an integer, `true` is not one either), so a field that takes an integer is
declared `WholeInt`: a float with no fractional part is that integer, and anything else, 2.5
included, is still refused with the field's name.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

__all__ = ["WholeInt", "whole_number"]


def whole_number(value: Any) -> Any:
    """A float with no fractional part as an int; any other value unchanged (for the strict
    integer check that follows)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WholeInt = Annotated[int, BeforeValidator(whole_number)]
