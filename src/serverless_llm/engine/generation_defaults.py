"""Sampling defaults from the model's generation_config.json (vLLM's `--generation-config`).

Model authors write the sampling they recommend (Qwen3: temperature 0.6, top_p 0.95, top_k 20)
into generation_config.json. As vLLM does by default (`auto`), a request that leaves one of
`temperature`, `top_p`, `top_k`, `min_p` or `repetition_penalty` unset gets the model's value;
`vllm` keeps the engine's own defaults; a directory reads its generation_config.json instead of
the model's. `override_generation_config` sets single values on top (alone with `vllm`).

Only these five are read: the file's other keys (`do_sample`, `max_new_tokens`, EOS ids, ...)
do not change sampling here (EOS ids are read where stopping is decided, tokenizer.py). The
file is read as written, not through transformers' GenerationConfig, which fills in its own
defaults (top_k 50) that the author never wrote.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError

logger = logging.getLogger(__name__)

# The sampling parameters a generation config may give defaults for (vLLM's list, less
# max_new_tokens: native jobs and OpenAI requests keep their own max_tokens defaults).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults for the parameters a request leaves unset, and where each came from."""

    values: dict[str, float | int] = field(default_factory=dict)
    # name -> "model" (generation_config.json) or "override" (override_generation_config)
    sources: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One phrase for the start-up line: which defaults came from where."""
        if not self.values:
            return "none (the engine's own)"
        parts = [f"{k}={self.values[k]:g} ({self.sources[k]})" for k in self.values]
        return ", ".join(parts)


def check_value(name: str, value: Any) -> float | int:
    """`value` as a default for `name`; ValueError saying what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if name == "top_k":
        if value != int(value) or value < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {value!r}")
        return -1 if int(value) == 0 else int(value)
    value = float(value)
    ok = {
        "temperature": value >= 0.0,
        "top_p": 0.0 < value <= 1.0,
        "min_p": 0.0 <= value <= 1.0,
        "repetition_penalty": value > 0.0,
    }[name]
    if not ok:
        allowed = {
            "temperature": ">= 0",
            "top_p": "in (0, 1]",
            "min_p": "in [0, 1]",
            "repetition_penalty": "> 0",
        }[name]
        raise ValueError(f"{name} must be {allowed}, got {value:g}")
    return value


def read_generation_config(directory: str) -> dict[str, Any] | None:
    """The JSON object in `directory`/generation_config.json, or None without one."""
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def sampling_defaults(
    model_dir: str | None, generation_config: str, override: dict[str, Any] | None
) -> SamplingDefaults:
    """The defaults `generation_config` ("auto": the model's file in `model_dir`; "vllm": none;
    else a directory holding one) and `override` give. A value the model's file gets wrong is
    skipped with a warning (the model still serves); a bad override is a ConfigError."""
    values: dict[str, float | int] = {}
    sources: dict[str, str] = {}
    if generation_config == "vllm":
        data = None
    elif generation_config == "auto":
        data = read_generation_config(model_dir) if model_dir else None
    else:
        if not os.path.isdir(generation_config):
            raise ConfigError(
                f"generation_config={generation_config!r}: not 'auto', 'vllm' or a directory"
            )
        data = read_generation_config(generation_config)
        if data is None:
            raise ConfigError(
                f"generation_config={generation_config!r}: the directory has no "
                f"{GENERATION_CONFIG_FILE}"
            )
    for name in DEFAULTABLE:
        if data is None or data.get(name) is None:
            continue
        try:
            values[name] = check_value(name, data[name])
        except ValueError as e:
            logger.warning("generation_config.json: %s; the engine's default is kept", e)
            continue
        sources[name] = "model"
    for name, value in (override or {}).items():
        if name not in DEFAULTABLE:
            raise ConfigError(
                f"override_generation_config: {name!r} cannot be set; allowed: "
                + ", ".join(DEFAULTABLE)
            )
        try:
            values[name] = check_value(name, value)
        except ValueError as e:
            raise ConfigError(f"override_generation_config: {e}") from None
        sources[name] = "override"
    return SamplingDefaults({k: values[k] for k in DEFAULTABLE if k in values}, sources)
