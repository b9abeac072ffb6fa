"""/v1/chat/completions: messages -> prompt tokens, and engine outputs -> OpenAI's chat shapes.

Messages are rendered with the chat template (the request's, else the server's
CUSTOM_CHAT_TEMPLATE, else the model's). Content given as a list of parts is flattened to its
text parts joined by newlines, which is what templates written for string content expect; other
part types (images, audio, files) are refused, since the engine takes text only.
"""

from __future__ import annotations

from typing import Any

from serverless_llm.engine.tokenizer import ChatTemplateError, apply_chat_template

from .errors import INVALID_REQUEST, OpenAIServingError, openai_error
from .protocol import ChatCompletionRequest, ChatMessage

# Roles whose messages must carry content (an assistant turn may carry only tool calls).
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})


def _flatten_content(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part["type"]
        param = f"messages[{index}].content[{j}]"
        if kind != "text":
            raise OpenAIServingError(
                openai_error(
                    f"content parts of type '{kind}' are not supported: this server takes text "
                    "only (use parts of type 'text')",
                    INVALID_REQUEST,
                    param,
                    "unsupported_parameter",
                )
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise OpenAIServingError.bad_request(
                f"Invalid value for '{param}.text': a text part needs a string 'text'.",
                f"{param}.text",
                "invalid_type",
            )
        texts.append(text)
    return "\n".join(texts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as plain dicts for the template, content flattened to a string."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        if message.content is None:
            if message.role in _CONTENT_REQUIRED or not message.tool_calls:
                raise OpenAIServingError.bad_request(
                    f"Missing required parameter: 'messages[{i}].content' (a message with role "
                    f"'{message.role}' needs content).",
                    f"messages[{i}].content",
                    "missing_required_parameter",
                )
            # Templates concatenate content; None would render as "None".
            item["content"] = ""
        else:
            item["content"] = _flatten_content(i, message.content)
        out.append(item)
    return out


def render_chat_prompt(
    request: ChatCompletionRequest, tokenizer: Any, default_template: str | None
) -> list[int]:
    """Renders the conversation and tokenizes it; every template problem becomes a 400."""
    messages = template_messages(request.messages)
    try:
        text = apply_chat_template(
            tokenizer,
            messages,
            chat_template=request.chat_template or default_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            documents=request.documents,
            chat_template_kwargs=request.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise OpenAIServingError.bad_request(str(e), None, "invalid_chat_template") from e
    return list(tokenizer.encode(text, add_special_tokens=request.add_special_tokens))


def echo_text(request: ChatCompletionRequest, role: str) -> str | None:
    """vLLM's chat `echo`: the last message's text, when it has the response's role, starts the
    reply (useful with continue_final_message)."""
    if not request.echo:
        return None
    last = request.messages[-1]
    if last.role != role or last.content is None:
        return None
    return _flatten_content(len(request.messages) - 1, last.content)


class ChatFormatter:
    """Builds chat.completion responses and chat.completion.chunk dicts for one request.

    Chunks are plain dicts because they are built once per token; their fields are those of
    `protocol.ChatCompletionStreamResponse`.
    """

    object_name = "chat.completion.chunk"

    def __init__(
        self, response_id: str, created: int, model: str, role: str, echo: str | None
    ) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.role = role
        self.echo = echo

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def head_chunks(self, index: int) -> list[dict[str, Any]]:
        """Each choice's stream opens with its role (and the echoed text, if any)."""
        delta = {"role": self.role, "content": self.echo or ""}
        return [
            self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
        ]

    def delta_chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        usage: dict[str, int] | None,
    ) -> dict[str, Any] | None:
        if not text and finish_reason is None and usage is None:
            return None  # a token whose text is still held back (part of a character)
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk = self._chunk([choice])
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk

    def response(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        stop_reasons: list[int | str | None],
        usage: dict[str, int],
    ) -> dict[str, Any]:
        prefix = self.echo or ""
        choices = [
            {
                "index": k,
                "message": {
                    "role": self.role,
                    "content": prefix + text,
                    "refusal": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": finish_reasons[k],
                "stop_reason": stop_reasons[k],
            }
            for k, text in enumerate(texts)
        ]
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }
