"""Validation beyond one field: one-line errors, and the checks across settings.

A bad value stops start-up with one line naming the variable, the value and what is allowed
(`SettingsError`). After each field is parsed (`fields`), `check()` refuses what no single field
shows: an error-level limitation, a tool call parser that does not exist (after loading
TOOL_PARSER_PLUGIN), and a combination the engine's own configuration refuses.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ...engine.config import ConfigError
from .engine_config import engine_config
from .fields import (
    CHOICES_MSG,
    ENV_TO_FIELD,
    SettingsFields,
    allowed_values,
    field_extra,
    field_kind,
)
from .limits import limitations


class SettingsError(ValueError):
    """A setting has a value the worker cannot start with. str() is one line naming the
    variable, the value and what is allowed, printed as the worker's last words."""


def format_validation_error(error: ValidationError, environ: Any) -> str:
    """One line per ValidationError: the variable as the user spelled it, the value, what is
    allowed. Several bad variables are joined on the same line."""
    upper = {str(k).upper(): v for k, v in environ.items()}
    parts = []
    for err in error.errors():
        loc = str(err["loc"][0]) if err["loc"] else "?"
        name = ENV_TO_FIELD.get(loc.upper(), loc)
        field = SettingsFields.model_fields.get(name)
        if field is None:
            parts.append(f"{loc}: {err['msg']}")
            continue
        extra = field_extra(field)
        # Name the variable that was actually set (an alias such as MIN_BATCH_SIZE).
        env = next((n for n in (extra["env"], *extra["aliases"]) if n in upper), extra["env"])
        value = "***" if field_kind(field) == "SecretStr" else repr(err.get("input"))
        # A field's own check says what is wrong (where a JSON value breaks, say).
        reason = str(err["msg"]).removeprefix("Value error, ")
        why = f" ({reason})" if err["type"] == "value_error" and reason != CHOICES_MSG else ""
        parts.append(f"{env}={value} is not valid{why}: expected {allowed_values(field)}")
    return "; ".join(parts)


def check(settings: SettingsFields) -> None:
    """The checks across settings, in order; raises SettingsError on the first problem.
    Warning-level limitations pass (they are logged at start-up)."""
    errors = [lim for lim in limitations(settings) if lim.level == "error"]
    if errors:
        raise SettingsError(errors[0].message)
    check_tool_parser(settings)
    if settings.lora_modules and not settings.enable_lora:
        raise SettingsError("LORA_MODULES is set but ENABLE_LORA is not: set ENABLE_LORA=true")
    if settings.allow_runtime_lora_updating and not settings.enable_lora:
        raise SettingsError(
            "ALLOW_RUNTIME_LORA_UPDATING is set but ENABLE_LORA is not: set ENABLE_LORA=true"
        )
    try:
        engine_config(settings)
    except ConfigError as e:
        raise SettingsError(f"invalid settings: {e}") from None


def check_tool_parser(settings: SettingsFields) -> None:
    """Loads TOOL_PARSER_PLUGIN, then checks TOOL_CALL_PARSER names a parser."""
    s = settings
    if s.tool_parser_plugin is None and s.tool_call_parser is None:
        return  # the parser comes from the chat template, at load (see OpenAIServing)
    # Imported here: the api.openai package (~0.1 s) is needed only when tool calling is set.
    from ...api.openai.tool_parsers import (
        ToolParserError,
        load_tool_parser_plugin,
        tool_parser_names,
    )

    if s.tool_parser_plugin is not None:
        try:
            load_tool_parser_plugin(s.tool_parser_plugin)
        except ToolParserError as e:
            raise SettingsError(str(e)) from None
        except Exception as e:
            raise SettingsError(
                f"TOOL_PARSER_PLUGIN: loading {s.tool_parser_plugin} failed: "
                f"{type(e).__name__}: {e}"
            ) from None
    if s.tool_call_parser is not None and s.tool_call_parser not in tool_parser_names():
        raise SettingsError(
            f"TOOL_CALL_PARSER={s.tool_call_parser!r} is not a tool call parser; "
            f"available: {', '.join(tool_parser_names())}"
        )
