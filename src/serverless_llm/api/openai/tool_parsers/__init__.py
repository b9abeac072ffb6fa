"""Tool calling: parsers from model text to OpenAI `tool_calls` (TOOL_CALL_PARSER), plugins
(TOOL_PARSER_PLUGIN), and `tools` / `tool_choice` handling. See base.py for the interface."""

from .base import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    ToolParserError,
    get_tool_parser,
    load_tool_parser_plugin,
    merge_deltas,
    register_tool_parser,
    tool_parser_names,
)
from .detect import detect_tool_parser
from .families import (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    GLM45ToolParser,
    GraniteToolParser,
    KimiK2ToolParser,
    Qwen3CoderToolParser,
)
from .formats import (
    HermesToolParser,
    InternLMToolParser,
    JambaToolParser,
    JSONToolParser,
    Llama3JSONToolParser,
    MistralToolParser,
)
from .pythonic import PythonicToolParser
from .tool_choice import (
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolChoice,
    ToolChoiceError,
    parser_for_tool_choice,
    required_schema,
    resolve_tool_choice,
    tool_choice_spec,
    validate_tools,
)

__all__ = [
    "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser",
    "GLM45ToolParser",
    "GraniteToolParser",
    "KimiK2ToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "detect_tool_parser",
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "InternLMToolParser",
    "JSONToolParser",
    "JambaToolParser",
    "Llama3JSONToolParser",
    "MistralToolParser",
    "NamedToolCallParser",
    "RequiredToolCallParser",
    "ToolCall",
    "ToolChoice",
    "ToolChoiceError",
    "ToolParser",
    "ToolParserError",
    "get_tool_parser",
    "load_tool_parser_plugin",
    "merge_deltas",
    "parser_for_tool_choice",
    "register_tool_parser",
    "required_schema",
    "resolve_tool_choice",
    "tool_choice_spec",
    "tool_parser_names",
    "validate_tools",
]
