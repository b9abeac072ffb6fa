"""The settings the engine cannot honour yet, in one table.

A setting the engine cannot honour is never dropped silently: `limitations()` lists it, as a
warning when the worker still serves the same outputs without it (a performance or memory knob)
and as an error when it would change what is served (start-up stops; see `validation`).
docs/settings.md lists the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ...engine.loader.quantization import SERVED_METHODS
from .fields import SettingsFields, shown_value


@dataclass(frozen=True)
class Limitation:
    env: str
    level: Literal["warning", "error"]
    message: str


@dataclass(frozen=True)
class Limit:
    """A setting the engine cannot honour yet. `error` when serving without it would change
    what the user gets (the weights could not be read as meant); `warning` when only speed,
    memory or device placement differ, so the worker still serves the same outputs."""

    env: str
    level: Literal["warning", "error"]
    applies: Callable[[SettingsFields], bool]
    message: str


LIMITS: tuple[Limit, ...] = (
    Limit(
        "QUANTIZATION",
        "error",
        lambda s: s.quantization not in (None, *SERVED_METHODS),
        "of the quantized formats only GPTQ, AWQ, FP8, compressed-tensors (FP8 or pack-quantized "
        "integers) and MXFP4 (gpt-oss) checkpoints are supported yet (QUANTIZATION awq, gptq, "
        "fp8, compressed-tensors, mxfp4, or the marlin names; unset, it follows the checkpoint); "
        "serve one of those, an unquantized model, or a .gguf file (dequantized at load)",
    ),
    Limit(
        "ENABLE_CHUNKED_PREFILL",
        "error",
        lambda s: not s.enable_chunked_prefill,
        "chunked prefill cannot be turned off: the engine gives each step one token budget "
        "that decodes and prompt chunks share, and has no separate whole-prompt prefill to "
        "fall back to; remove the setting (it is always on) or set it to true",
    ),
    Limit(
        "SWAP_SPACE",
        "warning",
        lambda s: s.swap_space > 0,
        "swapping to CPU memory is not supported yet; preempted requests are recomputed",
    ),
)


def limitations(settings: SettingsFields) -> list[Limitation]:
    """Settings whose values the engine cannot honour yet, with what happens instead."""
    return [
        Limitation(lim.env, lim.level, f"{lim.env}={shown_value(settings, lim.env)}: {lim.message}")
        for lim in LIMITS
        if lim.applies(settings)
    ]
