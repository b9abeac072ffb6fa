"""`/tokenize` and `/detokenize`, in vLLM's request and response shapes.

Tokenize takes either a chat (`messages`, rendered by the chat template exactly as the chat
route renders it, so `count` is the prompt tokens a chat request with the same fields would
use) or a plain `prompt`:

    {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
     "add_special_tokens": false, "return_token_strs": false, "chat_template": null,
     "chat_template_kwargs": null, "tools": null, "model": null}
    {"prompt": "...", "add_special_tokens": true, "return_token_strs": false, "model": null}
    -> {"count": 7, "max_model_len": 4096, "tokens": [...], "token_strs": null}

Detokenize: `{"tokens": [...], "model": null}` -> `{"prompt": "..."}` (special tokens kept, as
vLLM decodes). Bad input is a 400 in OpenAI's error shape; an unknown `model` a 404.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from serverless_llm.engine import InvalidRequestError

from .chat import render_chat_prompt
from .errors import OpenAIServingError
from .protocol import ChatCompletionRequest, ChatMessage, TokenId, _Strict
from .tool_parsers import validate_tools

if TYPE_CHECKING:
    from .serving import OpenAIServing


class TokenizePromptRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # raw text: BOS and friends belong in it
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes them
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


def tokenize(serving: OpenAIServing, body: Any) -> dict[str, Any]:
    """The tokenize response; blocking (template and tokenizer): call it off the event loop."""
    chat = isinstance(body, dict) and "messages" in body
    if isinstance(body, dict):
        limits = serving.limits
        if chat:
            limits.check_messages(body.get("messages"))
            limits.check_tools(body.get("tools"))
        elif isinstance(body.get("prompt"), str):
            limits.check_prompt_chars(len(body["prompt"]), "prompt")
    tokenizer = serving.tokenizer
    if chat:
        request: Any = serving._parse(TokenizeChatRequest, body)
        serving._check_model(request.model)
        tools = validate_tools(request.tools)
        as_chat = ChatCompletionRequest.model_validate(
            request.model_dump(exclude={"model", "return_token_strs", "tools"}, exclude_unset=True)
        )
        # The tools reach the template as the chat route hands them (described in a system
        # message where the template ignores them), so the count matches the chat's prompt.
        ids = render_chat_prompt(
            as_chat, tokenizer, serving.chat_template, tools, serving.describe_tools and bool(tools)
        )
    else:
        request = serving._parse(TokenizePromptRequest, body)
        serving._check_model(request.model)
        ids = list(tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
    return {
        "count": len(ids),
        "max_model_len": serving.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None,
    }


def detokenize(serving: OpenAIServing, body: Any) -> dict[str, Any]:
    """The detokenize response; blocking (the tokenizer): call it off the event loop."""
    request: DetokenizeRequest = serving._parse(DetokenizeRequest, body)
    serving._check_model(request.model)
    try:
        serving.engine.check_token_ids(request.tokens, "tokens")
    except InvalidRequestError as e:
        raise OpenAIServingError.bad_request(str(e), "tokens", "invalid_value") from None
    return {"prompt": serving.tokenizer.decode(request.tokens, skip_special_tokens=False)}
