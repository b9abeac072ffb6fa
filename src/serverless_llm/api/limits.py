"""What one request may ask for, checked before any tokenizing, template rendering or compiling.

A public endpoint meets requests built to tie it up: a prompt of tens of MB (the tokenizer's work
grows with it), tens of thousands of messages, stop strings, logit-bias entries or tools (each
costs something every step or in the template). Each limit is a worker setting (see
docs/settings.md); 0 turns one off. A request over a limit gets a 400 naming the field and the
limit, in its route's shape: `RequestLimitError` carries the field, the message and the
OpenAI-style code.

The limits on `top_logprobs` (20) and on a prompt longer than the model are the engine's own
(SamplingParams, prepare_prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine import InvalidRequestError
from .json_types import whole_number

__all__ = ["RequestLimitError", "RequestLimits", "string_chars"]


class RequestLimitError(InvalidRequestError):
    """A request is over one of the limits; str() is the message, `param` the field, `code`
    OpenAI's error code for it."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message, param)
        self.code = code


# Content parts that carry an image, not prompt text: a data URL's characters are bounded by
# MAX_IMAGE_BYTES (api.media), not by MAX_PROMPT_CHARS.
_IMAGE_PARTS = frozenset({"image_url", "input_image"})


def string_chars(value: Any) -> int:
    """The characters of every string value inside a JSON value (not its keys, not its image
    parts), counted without recursion so a deeply nested value cannot overflow the stack."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            if item.get("type") in _IMAGE_PARTS:
                continue
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


@dataclass(frozen=True)
class RequestLimits:
    """One request's limits (the worker's settings of the same names, upper-cased)."""

    max_prompt_chars: int = 1_000_000  # characters of prompt text (all prompts, all messages)
    max_messages: int = 2048  # chat messages
    max_stop_strings: int = 64  # stop strings
    max_logit_bias: int = 1024  # logit_bias entries
    max_tools: int = 128  # tool definitions
    max_n: int = 128  # n and best_of (each is a sequence of its own)
    max_prompts: int = 256  # prompts in one completions request (each times n sequences)

    # -- the checks -----------------------------------------------------------------------------

    def check_prompt_chars(self, chars: int, param: str) -> None:
        if self.max_prompt_chars and chars > self.max_prompt_chars:
            raise RequestLimitError(
                f"'{param}' holds {chars} characters of prompt text, over this endpoint's limit "
                f"of {self.max_prompt_chars} (MAX_PROMPT_CHARS)",
                param,
                "string_above_max_length",
            )

    def check_messages(self, messages: Any, param: str = "messages") -> None:
        """The number of messages, then the characters in them (text, tool calls, names)."""
        if isinstance(messages, list):
            self._count(messages, self.max_messages, param, "MAX_MESSAGES")
            self.check_prompt_chars(string_chars(messages), param)

    def check_prompts(self, prompt: Any) -> None:
        """A completions `prompt`: a string, a list of token ids (one prompt), or a list of
        either (several). Each prompt runs n (or best_of) sequences of its own."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            self._count(prompt, self.max_prompts, "prompt", "MAX_PROMPTS")

    def check_tools(self, tools: Any) -> None:
        self._count(tools, self.max_tools, "tools", "MAX_TOOLS")

    def check_sampling(
        self, *, n: Any = None, best_of: Any = None, stop: Any = None, logit_bias: Any = None
    ) -> None:
        """`n`, `best_of`, `stop` and `logit_bias` as the request gave them (before any other
        check, so a wrong type here is left for that check to name; a whole-number float is the
        integer the schema will take it as, api.json_types)."""
        for name, value in (("n", n), ("best_of", best_of)):
            value = whole_number(value)
            if (
                self.max_n
                and isinstance(value, int)
                and not isinstance(value, bool)
                and value > self.max_n
            ):
                raise RequestLimitError(
                    f"'{name}' is {value}, over this endpoint's limit of {self.max_n} (MAX_N)",
                    name,
                    "integer_above_max_value",
                )
        self._count(stop, self.max_stop_strings, "stop", "MAX_STOP_STRINGS")
        self._count(logit_bias, self.max_logit_bias, "logit_bias", "MAX_LOGIT_BIAS")

    @staticmethod
    def _count(items: Any, limit: int, param: str, setting: str) -> None:
        """A list or object over `limit` entries; anything else is left to the type checks."""
        if limit and isinstance(items, (list, dict)) and len(items) > limit:
            raise RequestLimitError(
                f"'{param}' has {len(items)} entries, over this endpoint's limit of {limit} "
                f"({setting})",
                param,
                "array_above_max_length",
            )
