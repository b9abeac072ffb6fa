"""What a request asks for: `StructuredOutputSpec`, one validated, hashable constraint (the
compile cache's key), built from vLLM's request fields (`guided_*`, `structured_outputs`,
`guided_decoding`) and OpenAI's `response_format` by `StructuredOutputSpec.from_request`;
`resolve_backend` reads `guided_decoding_backend`. Errors are `StructuredOutputError` (defined
in engine/errors.py with the engine's other request errors), naming the request field at fault."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...errors import StructuredOutputError

__all__ = [
    "BACKEND_NAMES",
    "StructuredOutputError",
    "StructuredOutputSpec",
    "resolve_backend",
]

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------

# vLLM's backend names -> the one this engine has. xgrammar covers every constraint kind the
# others do (JSON schema, regex, choice, EBNF and Lark grammars), so asking for outlines,
# lm-format-enforcer or guidance still gets the same guarantee: output in the language asked.
BACKEND_NAMES: dict[str, str] = {
    "auto": "xgrammar",
    "xgrammar": "xgrammar",
    "outlines": "xgrammar",
    "lm-format-enforcer": "xgrammar",
    "lm_format_enforcer": "xgrammar",
    "guidance": "xgrammar",
    "llguidance": "xgrammar",
}
# vLLM's backend options (`"xgrammar:disable-any-whitespace,no-fallback"`), and ours:
# `any-whitespace` asks for free whitespace between JSON tokens (vLLM's default; see
# `any_whitespace` below).
BACKEND_OPTIONS = frozenset(
    {
        "disable-any-whitespace",
        "any-whitespace",
        "no-fallback",
        "no-additional-properties",
        "disable-fallback",
    }
)


def any_whitespace_of(options: frozenset[str]) -> bool:
    """Whether backend options ask for free whitespace between JSON tokens (only when asked,
    and never with `disable-any-whitespace`)."""
    return "any-whitespace" in options and "disable-any-whitespace" not in options


def resolve_backend(name: str | None) -> tuple[str, frozenset[str]]:
    """`guided_decoding_backend` -> (backend, options). None or "" means the default. Options
    follow a colon, comma-separated, as vLLM takes them. An unknown name or option is an error
    naming the parameter (never silently another backend's behaviour)."""
    if name is None or not name.strip():
        return "xgrammar", frozenset()
    if not isinstance(name, str):
        raise StructuredOutputError("must be a string", "guided_decoding_backend")
    base, _, opts = name.strip().partition(":")
    backend = BACKEND_NAMES.get(base.strip().lower())
    if backend is None:
        raise StructuredOutputError(
            f"unknown guided decoding backend {base.strip()!r}; accepted: "
            + ", ".join(sorted(BACKEND_NAMES)),
            "guided_decoding_backend",
        )
    options = frozenset(o.strip().lower() for o in opts.split(",") if o.strip())
    unknown = sorted(options - BACKEND_OPTIONS)
    if unknown:
        raise StructuredOutputError(
            f"unknown guided decoding backend option {unknown[0]!r}; accepted: "
            + ", ".join(sorted(BACKEND_OPTIONS)),
            "guided_decoding_backend",
        )
    return backend, options


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------


# A schema nested so deep that Python's recursion limit stops reading or writing it.
_TOO_DEEP = "the JSON schema is nested too deeply"


def _canonical_schema(schema: Any, param: str) -> str:
    """A JSON schema (dict, JSON text, bool or pydantic model class) as compact JSON text: the
    cache key and what xgrammar reads. Key order is kept, since it is the output's order."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}", param) from exc
        except RecursionError:
            raise StructuredOutputError(_TOO_DEEP, param) from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(
            f"the JSON schema must be an object, got {type(schema).__name__}", param
        )
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}", param) from exc
    except RecursionError:
        raise StructuredOutputError(_TOO_DEEP, param) from None


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One request's constraint: exactly one of json, json_object, regex, choice, grammar.

    `json` is the schema as compact JSON text (see `_canonical_schema`); `choice` a tuple.
    Frozen and hashable: it is the compile cache's key. `param` is the request field it came
    from, for error messages only (two requests asking the same thing through different fields
    share one compiled grammar)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None
    # Free whitespace between JSON tokens. Off by default, unlike vLLM: a weak or small model
    # given free whitespace can spend all of max_tokens on newlines and return truncated JSON
    # (10 of 10 guided_json requests on a tiny random model). Without it, JSON comes out as
    # Python's json.dumps writes it: ", " and ": " between tokens, nothing else. A request gets
    # free whitespace with the backend option `any-whitespace`, or whitespace of its own with
    # `guided_whitespace_pattern`.
    any_whitespace: bool = False
    backend: str = "xgrammar"
    param: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        kinds = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        param = self.param or _PARAM_OF.get(kinds[0] if kinds else "", "guided_json")
        if len(kinds) != 1:
            raise StructuredOutputError(
                "exactly one structured output kind must be given (guided_json, guided_regex, "
                f"guided_choice, guided_grammar or response_format), got {len(kinds)}",
                param,
            )
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json, param))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise StructuredOutputError("the regex must be a non-empty string", param)
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            raise StructuredOutputError("the grammar must be a non-empty string", param)
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
                raise StructuredOutputError("the choices must be a list of strings", param)
            if not choice:
                raise StructuredOutputError("the list of choices is empty", param)
            for i, c in enumerate(choice):
                if not isinstance(c, str) or not c:
                    raise StructuredOutputError(f"choice {i} must be a non-empty string", param)
            object.__setattr__(self, "choice", tuple(choice))
        if self.whitespace_pattern is not None and (
            not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern
        ):
            raise StructuredOutputError(
                "the whitespace pattern must be a non-empty regex", "guided_whitespace_pattern"
            )
        if self.backend not in set(BACKEND_NAMES.values()):
            raise StructuredOutputError(
                f"unknown guided decoding backend {self.backend!r}", "guided_decoding_backend"
            )
        if not self.param:
            object.__setattr__(self, "param", param)

    @property
    def kind(self) -> Kind:
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.grammar is not None:
            return "grammar"
        return "json_object"

    @classmethod
    def from_request(
        cls,
        *,
        guided_json: Any = None,
        guided_regex: str | None = None,
        guided_choice: Sequence[str] | None = None,
        guided_grammar: str | None = None,
        guided_whitespace_pattern: str | None = None,
        guided_decoding_backend: str | None = None,
        response_format: Mapping[str, Any] | None = None,
        structured_outputs: Mapping[str, Any] | None = None,
        guided_decoding: Mapping[str, Any] | None = None,
    ) -> StructuredOutputSpec | None:
        """The spec a request asks for, or None when it asks for free text.

        Takes the request's fields as they arrive (the OpenAI routes and the native
        `sampling_params` use the same names). `response_format` is OpenAI's: `text`,
        `json_object`, or `json_schema` with `json_schema.schema`. At most one source may
        constrain the output; errors name the field at fault."""
        backend, options = resolve_backend(guided_decoding_backend)
        found: list[tuple[str, dict[str, Any]]] = []
        for param, value, key in (
            ("guided_json", guided_json, "json"),
            ("guided_regex", guided_regex, "regex"),
            ("guided_choice", guided_choice, "choice"),
            ("guided_grammar", guided_grammar, "grammar"),
        ):
            if value is not None:
                found.append((param, {key: value}))
        if response_format is not None:
            fmt = _from_response_format(response_format)
            if fmt is not None:
                found.append(("response_format", fmt))
        for param, blob in (
            ("structured_outputs", structured_outputs),
            ("guided_decoding", guided_decoding),
        ):
            if blob is not None:
                fmt, blob_backend, blob_options = _from_vllm_dict(param, blob)
                if blob_backend is not None:
                    backend = blob_backend
                options |= blob_options
                if fmt is not None:
                    found.append((param, fmt))
        if not found:
            return None
        if len(found) > 1:
            raise StructuredOutputError(
                f"only one structured output constraint may be given, got {found[0][0]} and "
                f"{found[1][0]}",
                found[1][0],
            )
        param, fields = found[0]
        ws = fields.pop("whitespace_pattern", None) or guided_whitespace_pattern
        if ws is not None and not isinstance(ws, str):
            raise StructuredOutputError("must be a string", "guided_whitespace_pattern")
        disabled = not fields.pop("any_whitespace", True)  # disable_any_whitespace in a dict
        any_ws = any_whitespace_of(options) and not disabled
        return cls(
            **fields,
            whitespace_pattern=ws or None,
            any_whitespace=any_ws,
            backend=backend,
            param=param,
        )


_PARAM_OF = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "json_object": "response_format",
}


def _from_response_format(fmt: Mapping[str, Any]) -> dict[str, Any] | None:
    if not isinstance(fmt, Mapping):
        raise StructuredOutputError("must be an object with a 'type'", "response_format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, Mapping):
            raise StructuredOutputError(
                "type 'json_schema' needs a 'json_schema' object", "response_format"
            )
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            # OpenAI allows a schema-less json_schema: any JSON object.
            return {"json_object": True}
        return {"json": _canonical_schema(schema, "response_format")}
    raise StructuredOutputError(
        f"unknown response_format type {kind!r}; accepted: text, json_object, json_schema",
        "response_format",
    )


def _from_vllm_dict(
    param: str, blob: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, str | None, frozenset[str]]:
    """vLLM's `structured_outputs` (>= 0.10) and `guided_decoding` (GuidedDecodingParams)."""
    if not isinstance(blob, Mapping):
        raise StructuredOutputError("must be an object", param)
    known = {
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "backend",
        "whitespace_pattern",
        "disable_any_whitespace",
        "disable_additional_properties",
        "disable_fallback",
        "backend_was_auto",
    }
    unknown = sorted(set(blob) - known)
    if unknown:
        raise StructuredOutputError(f"unsupported key {unknown[0]!r} in {param}", param)
    backend, options = (None, frozenset())
    if blob.get("backend") is not None:
        backend, options = resolve_backend(blob["backend"])
    fields: dict[str, Any] = {}
    for key in ("json", "regex", "choice", "grammar"):
        if blob.get(key) is not None:
            fields[key] = blob[key]
    if blob.get("json_object"):
        fields["json_object"] = True
    if not fields:
        return None, backend, options
    if blob.get("whitespace_pattern"):
        fields["whitespace_pattern"] = blob["whitespace_pattern"]
    if blob.get("disable_any_whitespace"):
        fields["any_whitespace"] = False
    if len(fields.keys() & {"json", "regex", "choice", "grammar", "json_object"}) > 1:
        raise StructuredOutputError(f"only one kind of constraint may be set in {param}", param)
    return fields, backend, options
