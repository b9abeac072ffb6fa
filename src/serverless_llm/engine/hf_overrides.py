"""Changes to the model's transformers config before the model is built (vLLM's
`--hf-overrides`, and its older `--rope-scaling` / `--rope-theta`, which now travel in it).

A key sets the config attribute of that name; a JSON object given for an attribute that is a
sub-config or a dict is merged into it, key by key. On a vision-language checkpoint the engine
serves its text decoder's config: `{"text_config": {...}}` is applied to that config, as are
keys given at the top level.

Rope is special: transformers 5 keeps it in `rope_parameters` (older configs in `rope_theta`
and `rope_scaling`), and the engine reads both (layers/rotary.py). `rope_scaling` or
`rope_parameters` given here is merged into the rope parameters (vLLM's `type` read as
`rope_type`); `rope_theta` replaces the base. A scaling `factor` of a linear, dynamic or YaRN
rope extends the context as vLLM derives it: the model's maximum length becomes the original
one (`original_max_position_embeddings`, pinned to the config's length when not given) times
the factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import ConfigError

_ROPE_SCALING_KEYS = ("rope_scaling", "rope_parameters")
# Rope types whose factor stretches the positions the model can take (vLLM's rule; LongRoPE
# and Llama 3's rope describe their own lengths).
_EXTENDING = ("linear", "dynamic", "yarn")


def apply_hf_overrides(config: Any, overrides: Mapping[str, Any] | None) -> None:
    """Applies `overrides` to `config` in place. ConfigError names a key it cannot apply."""
    if not overrides:
        return
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"hf_overrides must be a JSON object, got {type(overrides).__name__}")
    for key, value in overrides.items():
        if key == "text_config" and getattr(config, "text_part_of", None):
            apply_hf_overrides(config, value)  # the served config is the text config
        elif key in _ROPE_SCALING_KEYS:
            _apply_rope_scaling(config, key, value)
        elif key == "rope_theta":
            _apply_rope_theta(config, value)
        else:
            _set(config, key, value)


def _set(config: Any, key: str, value: Any) -> None:
    current = getattr(config, key, None)
    if isinstance(value, Mapping) and hasattr(current, "to_dict"):  # a sub-config
        apply_hf_overrides(current, value)
    elif isinstance(value, Mapping) and isinstance(current, Mapping):
        setattr(config, key, {**current, **value})
    else:
        setattr(config, key, value)


def _rope_dict(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping):
        return dict(params)
    return dict(getattr(config, "rope_scaling", None) or {})


def _store_rope(config: Any, params: dict[str, Any]) -> None:
    # Read first by the engine (rotary.rope_parameters); transformers 5's `rope_scaling` is
    # this same dict under its old name.
    config.rope_parameters = params


def _apply_rope_scaling(config: Any, key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"hf_overrides {key}: must be a JSON object, got {value!r}")
    value = dict(value)
    if "type" in value:  # vLLM's older spelling
        value.setdefault("rope_type", value.pop("type"))
    params = _rope_dict(config)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    factor = value.get("factor")
    rope_type = value.get("rope_type", params.get("rope_type", "default"))
    length = getattr(config, "max_position_embeddings", None)
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
            raise ConfigError(f"hf_overrides {key}: factor must be a number >= 1, got {factor!r}")
        if rope_type in _EXTENDING and isinstance(length, int):
            original = value.get(
                "original_max_position_embeddings",
                params.get("original_max_position_embeddings", length),
            )
            value["original_max_position_embeddings"] = original
            config.max_position_embeddings = max(length, int(original * factor))
    params.update(value)
    params["rope_type"] = rope_type
    _store_rope(config, params)


def _apply_rope_theta(config: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"hf_overrides rope_theta: must be a number > 0, got {value!r}")
    params = _rope_dict(config)
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(value)
    _store_rope(config, params)
