"""Server-sent events as OpenAI streams them, framed here and nowhere else.

Each chunk is one `data: <json>\\n\\n` event (compact JSON, non-ASCII kept); a Responses event
or an Anthropic Messages event (it has a `type` and no `object`) is preceded by its
`event: <type>` line, which the Anthropic client dispatches on; chat and completions streams end
with `data: [DONE]\\n\\n`. The serving layer frames its own output with
these when RAW_OPENAI_OUTPUT is on; when it is off the handler yields chunk objects, and the
devserver frames them with the same functions (through the worker), so both give the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["SSE_DONE", "sse_event", "sse_events"]

SSE_DONE = "data: [DONE]\n\n"


def sse_event(chunk: Any) -> str:
    """One chunk as one event."""
    data = f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
    if isinstance(chunk, dict) and isinstance(chunk.get("type"), str) and "object" not in chunk:
        return f"event: {chunk['type']}\n{data}"
    return data


def sse_events(chunks: Iterable[Any]) -> str:
    """Chunks as consecutive events, in one string."""
    return "".join(sse_event(c) for c in chunks)
