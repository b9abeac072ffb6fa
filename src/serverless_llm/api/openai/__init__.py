"""OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/models) over the engine.

The worker's handler calls `OpenAIServing.handle` for jobs with `openai_route`; the devserver
sends error dicts with the status `http_status` gives.
"""

from .errors import http_status, is_error, openai_error
from .serving import ROUTES, UTILITY_ROUTES, OpenAIServing, parse_route
from .sse import SSE_DONE, sse_event, sse_events

__all__ = [
    "ROUTES",
    "SSE_DONE",
    "UTILITY_ROUTES",
    "OpenAIServing",
    "http_status",
    "is_error",
    "openai_error",
    "parse_route",
    "sse_event",
    "sse_events",
]
