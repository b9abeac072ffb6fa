"""/v1/chat/completions: messages -> prompt tokens, and engine outputs -> OpenAI's chat shapes.

Messages are rendered with the chat template (the request's, else the server's
CUSTOM_CHAT_TEMPLATE, else the model's). For a text model, content given as a list of parts is
flattened to its text parts joined by newlines, which is what templates written for string
content expect, and image parts are refused. For a vision-language model, content takes the form
its template reads (a list of text and image parts, or a string) and `image_url` parts become
the prompt's images (api.multimodal). Audio, video and file parts are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from serverless_llm.engine import (
    EngineOutput,
    TokenLogprob,
    apply_chat_template,
    chat_template_source,
)

from ..logprobs import TokenDecoder, chat_logprobs, prompt_logprobs_vllm
from ..media import ImageRef
from ..multimodal import (
    ContentForm,
    ContentPartError,
    message_content,
    rename_message,
    rename_param,
)
from ..results import SequenceResult
from .errors import INVALID_REQUEST, OpenAIServingError, openai_error
from .harmony import HarmonyParser
from .protocol import ChatCompletionRequest, ChatMessage, ResponseFormatter
from .reasoning import ReasoningParser
from .tool_parsers import ToolParser, merge_deltas
from .tool_parsers.default_prompt import with_tool_prompt

# Roles whose messages must carry content (an assistant turn may carry only tool calls).
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})


def template_messages(
    messages: list[ChatMessage],
    form: ContentForm | None = None,
    images: list[ImageRef] | None = None,
    renames: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The messages as plain dicts for the template, content in the `form` the template reads
    (a text model's: flattened to a string); image parts' references appended to `images`.
    `renames`: how the route names the messages' fields (the Responses route's input items)."""
    form = form or ContentForm()
    images = [] if images is None else images
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
            param = f"messages[{i}].content"
            try:
                item["content"] = message_content(message.content, param, form, images)
            except ContentPartError as e:
                raise _part_error(e, renames) from None
        if item.get("tool_calls"):
            item["tool_calls"] = [_template_tool_call(c) for c in item["tool_calls"]]
        out.append(item)
    if renames:
        images[:] = [ImageRef(r.url, rename_param(r.param, renames)) for r in images]
    return out


def _part_error(e: ContentPartError, renames: Mapping[str, str] | None) -> OpenAIServingError:
    message, param = str(e), e.param
    if renames and param:
        message, param = rename_message(message, param, renames)
    return OpenAIServingError(openai_error(message, INVALID_REQUEST, param, e.code))


def _template_tool_call(call: Any) -> Any:
    """An assistant message's tool call for the template: JSON-text arguments become an object
    (what templates iterate over, as vLLM passes them); anything else is left as it is."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to read
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def render_chat_prompt(
    request: ChatCompletionRequest,
    tokenizer: Any,
    default_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    describe_tools: bool = False,
    *,
    renames: Mapping[str, str] | None = None,
) -> list[int]:
    """Renders the conversation (a text model's) and tokenizes it; every template problem is
    a ChatTemplateError (a 400, api.errors).
    `describe_tools`: the template ignores tools, so a system message of ours describes them
    (tool_parsers.default_prompt)."""
    text = render_chat_text(
        request, tokenizer, default_template, tools, describe_tools, renames=renames
    )
    return list(tokenizer.encode(text, add_special_tokens=request.add_special_tokens))


def render_chat_text(
    request: ChatCompletionRequest,
    tokenizer: Any,
    default_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    describe_tools: bool = False,
    *,
    form: ContentForm | None = None,
    images: list[ImageRef] | None = None,
    renames: Mapping[str, str] | None = None,
) -> str:
    """The rendered conversation, its content in `form` and its image references appended to
    `images` in order of appearance (see `template_messages`)."""
    messages = template_messages(request.messages, form, images, renames)
    template = request.chat_template or default_template
    if describe_tools and tools:
        messages, tools = with_tool_prompt(messages, tools), None
    return apply_chat_template(
        tokenizer,
        messages,
        chat_template=template,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=tools or None,
        documents=request.documents,
        chat_template_kwargs=_with_reasoning_effort(request, tokenizer, template),
    )


# OpenAI's efforts above "high", as a chat template or harmony takes them.
TEMPLATE_EFFORTS = {"xhigh": "high", "max": "high"}


def _with_reasoning_effort(
    request: ChatCompletionRequest, tokenizer: Any, template: str | None
) -> dict[str, Any] | None:
    """`reasoning_effort` as the template sees it: the variable itself (gpt-oss style templates
    read it), and, for a template with an `enable_thinking` switch (Qwen 3, SmolLM3), thinking
    off for "none" and "minimal" unless chat_template_kwargs sets the switch itself. OpenAI's
    "xhigh" and "max" reach the template as "high", the highest effort open models take."""
    kwargs = request.chat_template_kwargs
    effort = request.reasoning_effort
    if effort is None:
        return kwargs
    effort = TEMPLATE_EFFORTS.get(effort, effort)
    kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    if "enable_thinking" not in kwargs and "enable_thinking" in chat_template_source(
        tokenizer, template
    ):
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
    return kwargs


def echo_text(request: ChatCompletionRequest, role: str) -> str | None:
    """vLLM's chat `echo`: the last message's text, when it has the response's role, starts the
    reply (useful with continue_final_message)."""
    if not request.echo:
        return None
    last = request.messages[-1]
    if last.role != role or last.content is None:
        return None
    if isinstance(last.content, str):
        return last.content
    # The text parts' (images echo as nothing).
    return "\n".join(
        p["text"]
        for p in last.content
        if p.get("type") == "text" and isinstance(p.get("text"), str)
    )


class ChatFormatter(ResponseFormatter):
    """Builds chat.completion responses and chat.completion.chunk dicts for one request.

    Chunks are plain dicts because they are built once per token; their fields are those of
    `protocol.ChatCompletionStreamResponse`. With logprobs asked for, each choice (and each
    chunk) carries `logprobs.content`; prompt_logprobs (vLLM's) go at the top of the response.
    """

    object_name = "chat.completion.chunk"

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        role: str,
        echo: str | None,
        *,
        top_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        decoder: TokenDecoder | None = None,
        tool_parser: Callable[[], ToolParser | None] | None = None,
        tool_mode: str = "none",
        parallel_tool_calls: bool = True,
        reasoning_parser: Callable[[], ReasoningParser] | None = None,
        harmony: Callable[[], HarmonyParser] | None = None,
    ) -> None:
        """`top_logprobs`: None when the request did not ask for logprobs, else how many top
        tokens each position lists. `tool_parser`: makes a fresh parser for each choice (tools
        with a tool_choice other than "none"); `tool_mode` is the choice's mode. `harmony`: a
        gpt-oss model's output parser (one per choice), which reads the output tokens and
        replaces the tool and reasoning parsers."""
        super().__init__(response_id, created, model)
        self.harmony = harmony
        self._harmony: dict[int, HarmonyParser] = {}
        self.tool_parser = tool_parser
        self.tool_mode = tool_mode
        self.parallel_tool_calls = parallel_tool_calls
        self._parsers: dict[int, ToolParser | None] = {}
        self.reasoning_parser = reasoning_parser
        self._reasoners: dict[int, ReasoningParser] = {}
        self.role = role
        self.echo = echo
        self.top_logprobs = top_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.decoder = decoder

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        # OpenAI's choice logprobs carry `refusal` (the refusal's tokens) beside `content`;
        # no model here writes a separate refusal, so it is always null.
        content = chat_logprobs(entries or [], self.top_logprobs, self.decoder)
        return {"content": content, "refusal": None}

    def head_chunks(self, index: int) -> list[dict[str, Any]]:
        """Each choice's stream opens with its role (and the echoed text, if any)."""
        delta = {"role": self.role, "content": self.echo or ""}
        return [
            self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
        ]

    def _parser(self, index: int) -> ToolParser | None:
        if self.tool_parser is None:
            return None
        if index not in self._parsers:
            self._parsers[index] = self.tool_parser()
        return self._parsers[index]

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        # OpenAI: "tool_calls" for auto / required calls; a named choice ends with "stop".
        if reason == "stop" and called and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def _keep_calls(self, delta: dict[str, Any] | None) -> dict[str, Any] | None:
        if delta is None or self.parallel_tool_calls or "tool_calls" not in delta:
            return delta
        calls = [c for c in delta["tool_calls"] if c.get("index", 0) == 0]
        delta = {k: v for k, v in delta.items() if k != "tool_calls"}
        if calls:
            delta["tool_calls"] = calls
        return delta or None

    def delta_chunk(
        self, index: int, out: EngineOutput, usage: dict[str, int] | None
    ) -> dict[str, Any] | None:
        text, finish_reason = out.new_text, out.finish_reason
        logprobs = self._logprobs(out.logprobs) if out.logprobs else None
        if self.harmony is not None:
            reader = self._harmony.get(index)
            if reader is None:
                reader = self._harmony[index] = self.harmony()
            delta = self._keep_calls(reader.feed(out.new_token_ids)) or {}
            finish_reason = self._finish_reason(finish_reason, reader.tools_called)
            return self._delta_chunk(
                index, "delta", delta, logprobs, finish_reason, out.stop_reason, usage
            )
        reasoning = ""
        if self.reasoning_parser is not None:
            reasoner = self._reasoners.get(index)
            if reasoner is None:
                reasoner = self._reasoners[index] = self.reasoning_parser()
            reasoning, text = reasoner.feed(text, final=finish_reason is not None)
        parser = self._parser(index)
        if parser is not None:
            deltas = parser.feed(text) if text else []
            if finish_reason is not None:
                deltas = deltas + parser.finish()
            delta = self._keep_calls(merge_deltas(deltas)) or {}
            finish_reason = self._finish_reason(finish_reason, parser.tools_called)
        else:
            delta = {"content": text} if text else {}
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        return self._delta_chunk(
            index, "delta", delta, logprobs, finish_reason, out.stop_reason, usage
        )

    def _harmony_choice(self, k: int, r: SequenceResult, prefix: str) -> dict[str, Any]:
        assert self.harmony is not None
        parsed = self.harmony().parse(r.token_ids)
        calls = parsed.tool_calls if self.parallel_tool_calls else parsed.tool_calls[:1]
        content = parsed.content
        if prefix:
            content = prefix + (content or "")
        message: dict[str, Any] = {
            "role": self.role,
            "content": content,
            "refusal": None,
            "tool_calls": calls,
        }
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        return {
            "index": k,
            "message": message,
            "logprobs": self._logprobs(r.logprobs),
            "finish_reason": self._finish_reason(r.finish_reason, bool(calls)),
            "stop_reason": r.stop_reason,
        }

    def response(
        self,
        results: list[SequenceResult],
        prompt_logprobs: list[list[TokenLogprob | None] | None],
        usage: dict[str, int],
    ) -> dict[str, Any]:
        prefix = self.echo or ""
        choices = []
        for k, r in enumerate(results):
            answer, reasoning = r.text, None
            if self.harmony is not None:
                choices.append(self._harmony_choice(k, r, prefix))
                continue
            if self.reasoning_parser is not None:
                reasoning, answer = self.reasoning_parser().extract(r.text)
            content: str | None = prefix + answer
            tool_calls: list[dict[str, Any]] = []
            finish_reason = r.finish_reason
            parser = self.tool_parser() if self.tool_parser is not None else None
            if parser is not None:
                extracted = parser.extract(answer)
                calls = extracted.tool_calls
                if not self.parallel_tool_calls:
                    calls = calls[:1]
                tool_calls = [c.to_openai() for c in calls]
                content = extracted.content
                if prefix:
                    content = prefix + (content or "")
                finish_reason = self._finish_reason(finish_reason, bool(calls))
            choices.append(
                {
                    "index": k,
                    "message": {
                        "role": self.role,
                        "content": content,
                        "refusal": None,
                        "tool_calls": tool_calls,
                        **({"reasoning_content": reasoning} if reasoning is not None else {}),
                    },
                    "logprobs": self._logprobs(r.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": r.stop_reason,
                }
            )
        response = self._chunk(choices, usage, object_name="chat.completion")
        if self.prompt_logprobs is not None and prompt_logprobs and prompt_logprobs[0]:
            response["prompt_logprobs"] = prompt_logprobs_vllm(
                prompt_logprobs[0], self.prompt_logprobs, self.decoder
            )
        return response
