"""Message content for the chat template, images included: what the OpenAI chat route, the
Responses route and the native route share.

A message's content reaches the template in one of two forms, chosen by reading the template
(as vLLM's "content format" auto-detection does): a template that loops over
`message['content']` takes a list of parts (`{"type": "text", "text": ...}` and, for each image,
`{"type": "image"}`), which is what most vision-language templates read; any other template
takes a string, the text parts joined by newlines. With part lists, a plain string content
becomes one text part, since such templates may read only lists. A string template given images
gets the model's image placeholder before the text (vLLM's placeholders-first), when the engine
names one, else a 400 (the template could not place the image).

Text models keep the string form always: content flattened to its text parts, and any image
part refused with a 400 saying the model takes no images.

`image_url` parts (`{"url": ..., "detail": ...}` or a bare string) become `ImageRef`s in order of
appearance across the whole conversation, each naming its part
(`messages[1].content[0].image_url`); audio, video and file parts are refused by name. Nothing
is fetched here: the routes count the images against LIMIT_MM_PER_PROMPT first, then load them
(api.media).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2 import nodes

from ..engine import InvalidRequestError
from .media import ImageRef

__all__ = [
    "IMAGE_PART_TYPES",
    "ContentForm",
    "ContentPartError",
    "content_format",
    "count_image_parts",
    "message_content",
    "rename_message",
    "rename_param",
]

logger = logging.getLogger(__name__)

IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
# Part types that carry media this server does not take, by the name a client knows them by.
_REFUSED_PARTS = {
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "video": "video",
    "file": "files",
    "input_file": "files",
    "image_embeds": "image embeddings",
}
_DETAILS = ("auto", "low", "high")


class ContentPartError(InvalidRequestError):
    """A content part the route cannot take: `param` names it, `code` is OpenAI's code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message, param)
        self.code = code


@dataclass(frozen=True)
class ContentForm:
    """How one request's message content is shaped for its template.
    `images`: the model takes images. `part_lists`: the template reads content as a list of
    parts. `placeholder`: the text standing for one image in a string template (None: unknown,
    so a string template cannot take images)."""

    images: bool = False
    part_lists: bool = False
    placeholder: str | None = None


def message_content(
    content: str | list[Any],
    param: str,
    form: ContentForm,
    images: list[ImageRef],
) -> str | list[dict[str, Any]]:
    """One message's content as its template takes it; its images appended to `images`.
    `param` names the content (`messages[1].content`)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if form.part_lists else content
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    placeholders: list[str] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ContentPartError(
                    f"Invalid value for '{where}.text': a text part needs a string 'text'.",
                    f"{where}.text",
                    "invalid_type",
                )
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            if not form.images:
                raise ContentPartError(
                    f"This model does not take images: '{where}' is an image_url part. Send "
                    "text parts only, or serve a vision-language model.",
                    where,
                    "unsupported_parameter",
                )
            images.append(ImageRef(_image_url(part, where), f"{where}.image_url"))
            parts.append({"type": "image"})
            if not form.part_lists:
                if form.placeholder is None:
                    raise ContentPartError(
                        f"'{where}': this model's chat template reads message content as a "
                        "string and cannot place an image; pass a chat_template that renders "
                        "image parts (or set CUSTOM_CHAT_TEMPLATE).",
                        where,
                        "unsupported_parameter",
                    )
                placeholders.append(form.placeholder)
        elif kind in _REFUSED_PARTS:
            what = _REFUSED_PARTS[kind]
            takes = "text and images" if form.images else "text only"
            raise ContentPartError(
                f"Content parts of type '{kind}' are not supported: this server takes no "
                f"{what} ({takes}).",
                where,
                "unsupported_parameter",
            )
        else:
            takes = "'text' and 'image_url'" if form.images else "'text'"
            raise ContentPartError(
                f"Content parts of type '{kind}' are not supported: use parts of type {takes}.",
                where,
                "unsupported_parameter",
            )
    if form.part_lists:
        return parts
    return "\n".join([*placeholders, *texts]) if placeholders else "\n".join(texts)


def count_image_parts(messages: Any) -> int:
    """The image parts of a conversation (chat messages, as models or dicts), counted before
    anything else is done with them."""
    count = 0
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else message.content
        if isinstance(content, list):
            count += sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image_url")
    return count


def _image_url(part: dict[str, Any], where: str) -> str:
    """An image_url part's URL: `{"url": ..., "detail": ...}` (OpenAI's) or a bare string
    (vLLM takes that too). `detail` is checked and changes nothing: the model's own processor
    decides the resolution."""
    value = part.get("image_url")
    if isinstance(value, str):
        url = value
    elif isinstance(value, dict):
        url = value.get("url")
        detail = value.get("detail")
        if detail is not None and detail not in _DETAILS:
            raise ContentPartError(
                f"Invalid value for '{where}.image_url.detail': one of auto, low, high.",
                f"{where}.image_url.detail",
            )
        unknown = sorted(set(value) - {"url", "detail"})
        if unknown:
            raise ContentPartError(
                f"Unrecognized argument in '{where}.image_url': '{unknown[0]}'.",
                f"{where}.image_url.{unknown[0]}",
                "unknown_parameter",
            )
    else:
        raise ContentPartError(
            f"Missing required parameter: '{where}.image_url' (an object with 'url', or the "
            "URL as a string).",
            f"{where}.image_url",
            "missing_required_parameter",
        )
    if not isinstance(url, str) or not url:
        raise ContentPartError(
            f"Invalid value for '{where}.image_url.url': an http(s) URL or a data URL "
            "(data:image/png;base64,...).",
            f"{where}.image_url.url",
            "invalid_type" if not isinstance(url, str) else "invalid_value",
        )
    return url


def rename_param(param: str, renames: Mapping[str, str]) -> str:
    """`param` with its longest renamed prefix replaced (the Responses route names the chat
    body's fields as its own input items: `messages[1].content` -> `input[0].content`)."""
    return rename_message(param, param, renames)[1]


def rename_message(message: str, param: str, renames: Mapping[str, str]) -> tuple[str, str]:
    """(`message`, `param`) with the prefix of `param` that `renames` renames replaced in both."""
    for old in sorted(renames, key=len, reverse=True):
        if param == old or param.startswith((old + ".", old + "[")):
            new = renames[old]
            return message.replace(old, new), new + param[len(old) :]
    return message, param


# -- content format detection ------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}` block (assistant-token masks): parsed as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


_ENV = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])


@functools.lru_cache(maxsize=32)
def content_format(template: str) -> Literal["string", "openai"]:
    """ "openai" when the template loops over a message's content (so it takes part lists),
    else "string". A template that does not parse is read as "string" (the safe choice: the
    render itself reports the error)."""
    try:
        tree = _ENV.parse(template)
    except jinja2.TemplateError:
        return "string"
    messages = _aliases(tree, {"messages"})
    message_vars = {
        loop.target.name
        for loop in tree.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and _reads(loop.iter, messages)
    }
    if not message_vars:
        return "string"
    # `message['content']` itself, and names set from it (`{% set content = message.content %}`).
    contents = _aliases(tree, set(), lambda node: _reads(node, message_vars, "content"))
    for loop in tree.find_all(nodes.For):
        if _reads(loop.iter, message_vars, "content") or _reads(loop.iter, contents):
            return "openai"
    return "string"


def _aliases(tree: nodes.Template, names: set[str], seed: Any = None) -> set[str]:
    """`names` and every variable `{% set %}` from one of them (or, with `seed`, from a
    node `seed` accepts), followed through chains of assignments."""
    names = set(names)
    assigns = [a for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    changed = True
    while changed:
        changed = False
        for a in assigns:
            if a.target.name in names:
                continue
            if _reads(a.node, names) or (seed is not None and seed(a.node)):
                names.add(a.target.name)
                changed = True
    return names


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (or, with `key`, its item `key`), possibly through
    filters, tests or a slice: `messages`, `messages[1:]`, `message['content'] | list`."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, nodes.Name) and node.name in names
    if isinstance(node, nodes.Getitem):
        return (
            isinstance(node.arg, nodes.Const) and node.arg.value == key and _reads(node.node, names)
        )
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _reads(node.node, names)
    return False
