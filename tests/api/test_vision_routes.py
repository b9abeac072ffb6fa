"""Images through the routes (issue 36): OpenAI chat `image_url` parts, Responses `input_image`,
the native schema (`messages` parts, `prompt` + `multi_modal_data`), on a tiny random Qwen2.5-VL
served by the real engine; and every bad image input a 400 naming its part, after which the
worker serves on with no KV block held.

Each route's answer is checked against the engine itself given the prompt the route should have
built (the template rendered with image parts, the images in order of appearance), greedy.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from PIL import Image

from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.errors import NativeJobError, native_error
from serverless_llm.api.limits import RequestLimits
from serverless_llm.api.media import MediaConfig
from serverless_llm.api.multimodal import ContentForm, ContentPartError, content_format
from serverless_llm.api.multimodal import message_content as normalise
from serverless_llm.api.native import NativeRequest, NativeServing
from serverless_llm.api.openai import OpenAIServing
from serverless_llm.api.openai.errors import http_status
from serverless_llm.engine import MultiModalInput, SamplingParams
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.config import EngineConfig
from tests.api.conftest import collect, parse_sse, pool_full, wait_idle
from tests.api.test_media import bomb_png, noise_png
from tests.engine.vision_qwen_vl_models import QWEN_VL_CHAT_TEMPLATE, save_tiny_qwen2_5_vl

MODEL = "tiny-vl"
MAX_TOKENS = 6
CHAT = "/v1/chat/completions"
IMAGE_TAG = "<|vision_start|><|image_pad|><|vision_end|>"


def png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


RED = png((56, 28), (220, 20, 20))
BLUE = png((28, 84), (20, 40, 230))
GREEN = png((112, 56), (10, 200, 40))


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_core(tmp_path_factory):
    path = save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("tiny-vl") / "model"))
    engine = AsyncEngine.from_config(
        EngineConfig(model=path, num_kv_blocks=64, max_model_len=512, show_progress=False)
    )
    assert engine.model_info.image_input
    return engine.core


class _Images(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        body = {"/red.png": RED, "/blue.png": BLUE}.get(self.path)
        if body is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def image_server() -> Iterator[http.server.ThreadingHTTPServer]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    srv.daemon_threads = True
    srv.paths = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def base_url(srv) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture()
def serve_vl(vl_core) -> Callable[..., Any]:
    """`serve_vl(fn, media=..., **kwargs)`: `await fn(openai_serving, native_serving, engine)`
    on a fresh AsyncEngine over the shared core; every KV block must be free after."""

    def run(fn: Callable[..., Awaitable[Any]], media: MediaConfig | None = None, **kwargs) -> Any:
        async def main() -> Any:
            engine = AsyncEngine(vl_core)
            openai = OpenAIServing(engine, served_model_name=MODEL, media=media, **kwargs)
            native = NativeServing(engine, media=media)
            try:
                return await fn(openai, native, engine)
            finally:
                await wait_idle(vl_core)
                await engine.shutdown()

        result = asyncio.run(main())
        assert pool_full(vl_core), "KV blocks leaked"
        return result

    return run


def render(messages: list[dict[str, Any]]) -> str:
    """The prompt text the routes must build: the template over part lists, an image part as
    {"type": "image"}, a generation prompt."""
    from jinja2 import Template

    return Template(QWEN_VL_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


async def reference(engine, text: str, images: list[bytes], add_special_tokens=False) -> tuple:
    """(text, prompt tokens) the engine gives for this prompt, greedy."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    prompt = MultiModalInput(text, [pil(i) for i in images], add_special_tokens)
    prepared = engine.prepare_prompt(prompt, params)
    out = ""
    async for item in engine.generate(prepared, params):
        out += item.new_text
    return out, len(prepared.token_ids)


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": list(messages),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def the_error(items: list[Any]) -> dict[str, Any]:
    assert len(items) == 1 and "error" in items[0], items
    assert http_status(items[0]) == 400
    return items[0]["error"]


# -- OpenAI chat ---------------------------------------------------------------------------------


def test_chat_with_a_data_url_image(serve_vl):
    async def go(openai, native, engine):
        body = chat({"role": "user", "content": [image_part(data_url(RED)), text_part("hi")]})
        (resp,) = await collect(openai, CHAT, body)
        expected = render([{"role": "user", "content": [{"type": "image"}, text_part("hi")]}])
        assert IMAGE_TAG in expected
        want, n = await reference(engine, expected, [RED])
        return resp, want, n

    resp, want, n = serve_vl(go)
    assert resp["choices"][0]["message"]["content"] == want
    assert resp["usage"]["prompt_tokens"] == n > 20  # the image's tokens count


def test_two_images_in_one_message_and_one_in_an_earlier_turn(serve_vl):
    """Images go to the engine in order of appearance across the conversation; plain string
    content becomes a text part for this template (it reads part lists)."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [text_part("first"), image_part(data_url(GREEN))]},
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [image_part(data_url(RED)), text_part("and"), image_part(data_url(BLUE))],
        },
    ]

    async def go(openai, native, engine):
        (resp,) = await collect(openai, CHAT, chat(*messages))
        shaped = [
            {"role": "system", "content": [text_part("be brief")]},
            {"role": "user", "content": [text_part("first"), {"type": "image"}]},
            {"role": "assistant", "content": [text_part("ok")]},
            {"role": "user", "content": [{"type": "image"}, text_part("and"), {"type": "image"}]},
        ]
        return resp, await reference(engine, render(shaped), [GREEN, RED, BLUE])

    resp, (want, n) = serve_vl(go, media=MediaConfig(limit_mm_per_prompt={"image": 3}))
    assert resp["choices"][0]["message"]["content"] == want
    assert resp["usage"]["prompt_tokens"] == n


def test_chat_streamed_with_an_http_image(serve_vl, image_server):
    url = f"{base_url(image_server)}/red.png"

    async def go(openai, native, engine):
        body = chat(
            {"role": "user", "content": [image_part(url), text_part("hi")]},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = parse_sse(await collect(openai, CHAT, body, BatchSizes()))
        expected = render([{"role": "user", "content": [{"type": "image"}, text_part("hi")]}])
        return chunks, await reference(engine, expected, [RED])

    chunks, (want, n) = serve_vl(go, media=MediaConfig(allow_private_image_urls=True))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == want
    assert chunks[-1]["usage"]["prompt_tokens"] == n


def test_loopback_url_refused_by_default_and_the_worker_serves_on(serve_vl, image_server):
    url = f"{base_url(image_server)}/red.png"
    seen = len(image_server.paths)

    async def go(openai, native, engine):
        bad = await collect(
            openai, CHAT, chat({"role": "user", "content": [text_part("x"), image_part(url)]})
        )
        good = await collect(
            openai, CHAT, chat({"role": "user", "content": [image_part(data_url(BLUE))]})
        )
        return bad, good

    bad, good = serve_vl(go)
    error = the_error(bad)
    assert error["param"] == "messages[0].content[1].image_url"
    assert error["type"] == "invalid_request_error"
    assert "loopback" in error["message"] and "ALLOW_PRIVATE_IMAGE_URLS" in error["message"]
    assert len(image_server.paths) == seen  # nothing was fetched
    assert good[0]["choices"][0]["finish_reason"] == "length"


def test_limit_per_prompt_before_any_fetch(serve_vl, image_server):
    url = f"{base_url(image_server)}/red.png"
    seen = len(image_server.paths)
    two = {"role": "user", "content": [image_part(url), image_part(url)]}

    async def go(openai, native, engine):
        return await collect(openai, CHAT, chat(two))

    error = the_error(serve_vl(go, media=MediaConfig(allow_private_image_urls=True)))
    assert error["param"] == "messages"
    assert "at most 1 image(s)" in error["message"] and "LIMIT_MM_PER_PROMPT" in error["message"]
    assert len(image_server.paths) == seen

    # Spread over two messages, it is still one prompt.
    split = [{"role": "user", "content": [image_part(url)]}] * 2

    async def go2(openai, native, engine):
        return await collect(openai, CHAT, chat(*split))

    assert "at most 1" in the_error(serve_vl(go2))["message"]


def _bad_image_cases(tmp_path) -> list[tuple[str, str]]:
    truncated = noise_png()
    return [
        ("data:image/png;base64,iVBOR*w0KGgo!!", "base64 is invalid"),
        (data_url(b"not an image at all"), "not an image"),
        (data_url(truncated[: len(truncated) // 2]), "truncated or corrupt"),
        (data_url(bomb_png(50_000, 50_000)), "pixels"),
        ("ftp://example.com/a.png", "'ftp' URLs"),
        (f"file://{tmp_path}/a.png", "ALLOWED_LOCAL_MEDIA_PATH is unset"),
        ("http://127.0.0.1:9/a.png", "ALLOW_PRIVATE_IMAGE_URLS"),
    ]


def test_every_bad_image_is_a_400_naming_its_part(serve_vl, tmp_path):
    cases = _bad_image_cases(tmp_path)

    async def go(openai, native, engine):
        out = []
        for url, _ in cases:
            body = chat(
                {"role": "user", "content": "look"},
                {"role": "user", "content": [text_part("this:"), image_part(url)]},
            )
            out.append(await collect(openai, CHAT, body))
        good = await collect(openai, CHAT, chat({"role": "user", "content": "still there?"}))
        return out, good

    results, good = serve_vl(go)
    for (url, words), items in zip(cases, results, strict=True):
        error = the_error(items)
        assert error["param"] == "messages[1].content[1].image_url", url
        assert error["message"].startswith("messages[1].content[1].image_url: "), error
        assert words in error["message"], (words, error["message"])
    assert good[0]["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(
    "part, param, words",
    [
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "", "audio"),
        ({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}, "", "video"),
        ({"type": "file", "file": {"file_id": "f"}}, "", "files"),
        ({"type": "image_url"}, ".image_url", "Missing required parameter"),
        ({"type": "image_url", "image_url": {"url": 5}}, ".image_url.url", "Invalid value"),
        (
            {"type": "image_url", "image_url": {"url": "x", "detail": "max"}},
            ".image_url.detail",
            "auto, low, high",
        ),
        ({"type": "hologram"}, "", "'hologram'"),
    ],
)
def test_other_parts_are_refused_by_name(serve_vl, part, param, words):
    async def go(openai, native, engine):
        return await collect(openai, CHAT, chat({"role": "user", "content": [part]}))

    error = the_error(serve_vl(go))
    assert error["param"] == "messages[0].content[0]" + param
    assert words in error["message"]


def test_images_count_towards_the_context(serve_vl):
    """max_tokens that a text-only prompt of the same words leaves room for, but not once the
    image's tokens are in: a 400 before any work."""

    async def go(openai, native, engine):
        expected = render([{"role": "user", "content": [{"type": "image"}]}])
        _, n = await reference(engine, expected, [GREEN])
        body = chat({"role": "user", "content": [image_part(data_url(GREEN))]}, max_tokens=513 - n)
        return n, await collect(openai, CHAT, body)

    n, items = serve_vl(go)
    error = the_error(items)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"({n} in the messages" in error["message"], error["message"]
    assert n > 8  # the image's tokens (more than the words' alone)


def test_data_urls_are_not_prompt_text(serve_vl):
    """MAX_PROMPT_CHARS counts text, not an image's data URL (bounded by MAX_IMAGE_BYTES)."""
    big = data_url(noise_png((64, 64)))
    assert len(big) > 10_000

    async def go(openai, native, engine):
        body = chat({"role": "user", "content": [image_part(big), text_part("hi")]})
        return await collect(openai, CHAT, body)

    items = serve_vl(go, limits=RequestLimits(max_prompt_chars=1000))
    assert items[0]["choices"][0]["finish_reason"] == "length"


# -- Responses -----------------------------------------------------------------------------------


def test_responses_input_image(serve_vl):
    content = [
        {"type": "input_image", "image_url": data_url(RED), "detail": "auto"},
        {"type": "input_text", "text": "hi"},
    ]

    async def go(openai, native, engine):
        body = {"model": MODEL, "input": [{"role": "user", "content": content}]}
        body |= {"max_output_tokens": MAX_TOKENS, "temperature": 0}
        (resp,) = await collect(openai, "/v1/responses", body)
        expected = render([{"role": "user", "content": [{"type": "image"}, text_part("hi")]}])
        return resp, await reference(engine, expected, [RED])

    resp, (want, n) = serve_vl(go)
    assert resp["output"][-1]["content"][0]["text"] == want
    assert resp["usage"]["input_tokens"] == n


@pytest.mark.parametrize(
    "content, param, words",
    [
        ([{"type": "input_image", "file_id": "file-1"}], "input[0].content[0].file_id", "file_id"),
        (
            [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": "ftp://a"}],
            "input[0].content[1].image_url",
            "'ftp' URLs",
        ),
        ([{"type": "input_file", "file_id": "f"}], "input[0].content[0]", "input_file"),
        ([{"type": "input_image", "image_url": 3}], "input[0].content[0].image_url", "data URL"),
    ],
)
def test_responses_refusals_name_the_input_item(serve_vl, content, param, words):
    async def go(openai, native, engine):
        body = {"model": MODEL, "input": [{"role": "user", "content": content}]}
        return await collect(openai, "/v1/responses", body)

    error = the_error(serve_vl(go))
    assert error["param"] == param and words in error["message"], error


def test_responses_limit_names_input(serve_vl):
    content = [{"type": "input_image", "image_url": data_url(RED)}] * 2

    async def go(openai, native, engine):
        body = {"model": MODEL, "input": [{"role": "user", "content": content}]}
        return await collect(openai, "/v1/responses", body)

    error = the_error(serve_vl(go))
    assert error["param"] == "input" and "at most 1" in error["message"]


# -- native --------------------------------------------------------------------------------------


async def native_job(native: NativeServing, data: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        request = NativeRequest.parse(data)
    except NativeJobError as e:  # as the worker answers a job that does not parse
        return [native_error(str(e))]
    return [item async for item in native.handle(request, BatchSizes(), "job")]


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0}


def test_native_messages_with_images(serve_vl):
    messages = [{"role": "user", "content": [image_part(data_url(BLUE)), text_part("hi")]}]

    async def go(openai, native, engine):
        (item,) = await native_job(native, {"messages": messages, "sampling_params": GREEDY})
        expected = render([{"role": "user", "content": [{"type": "image"}, text_part("hi")]}])
        return item, await reference(engine, expected, [BLUE])

    item, (want, n) = serve_vl(go)
    assert item["choices"][0]["tokens"] == [want] and item["usage"]["input"] == n


def test_native_prompt_with_multi_modal_data(serve_vl, image_server):
    """vLLM's offline form: the prompt carries the placeholders, the images come in order."""
    prompt = f"a {IMAGE_TAG} and {IMAGE_TAG}?"
    url = f"{base_url(image_server)}/blue.png"

    async def go(openai, native, engine):
        data = {"prompt": prompt, "sampling_params": GREEDY}
        data["multi_modal_data"] = {"image": [data_url(RED), url]}
        (item,) = await native_job(native, data)
        one = await native_job(
            native,
            {
                "prompt": f"{IMAGE_TAG} hi",
                "multi_modal_data": {"image": data_url(GREEN)},
                "sampling_params": GREEDY,
            },
        )
        want = await reference(engine, prompt, [RED, BLUE], add_special_tokens=True)
        want_one = await reference(engine, f"{IMAGE_TAG} hi", [GREEN], add_special_tokens=True)
        return item, one[0], want, want_one

    media = MediaConfig(allow_private_image_urls=True, limit_mm_per_prompt={"image": 2})
    item, one, (want, n), (want_one, _) = serve_vl(go, media=media)
    assert item["choices"][0]["tokens"] == [want] and item["usage"]["input"] == n
    assert one["choices"][0]["tokens"] == [want_one]


def test_native_prompt_with_images_and_the_chat_template(serve_vl):
    async def go(openai, native, engine):
        data = {
            "prompt": "hi",
            "apply_chat_template": True,
            "multi_modal_data": {"image": data_url(RED)},
            "sampling_params": GREEDY,
        }
        (item,) = await native_job(native, data)
        expected = render([{"role": "user", "content": [{"type": "image"}, text_part("hi")]}])
        return item, await reference(engine, expected, [RED])

    item, (want, _) = serve_vl(go)
    assert item["choices"][0]["tokens"] == [want]


@pytest.mark.parametrize(
    "data, words",
    [
        (
            {"prompt": "x", "multi_modal_data": {"video": ["http://x/v.mp4"]}},
            "multi_modal_data.video: video inputs are not supported",
        ),
        (
            {"prompt": "x", "multi_modal_data": {"image": [data_url(RED), data_url(RED)]}},
            "at most 1 image(s)",
        ),
        (
            {"prompt": "x", "multi_modal_data": {"image": [1]}},
            "multi_modal_data.image must be an image URL",
        ),
        (
            {"prompt": f"{IMAGE_TAG}", "multi_modal_data": {"image": "data:image/png;base64,@"}},
            "multi_modal_data.image: the data URL's base64 is invalid",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "multi_modal_data": {"image": "u"}},
            "multi_modal_data goes with 'prompt'",
        ),
        (
            {"messages": [{"role": "user", "content": [image_part("ftp://a")]}]},
            "messages[0].content[0].image_url: 'ftp' URLs",
        ),
        (  # two placeholders, one image: the engine's processor refuses
            {"prompt": f"{IMAGE_TAG}{IMAGE_TAG}", "multi_modal_data": {"image": data_url(RED)}},
            "images",
        ),
    ],
)
def test_native_refusals(serve_vl, data, words):
    async def go(openai, native, engine):
        bad = await native_job(native, data)
        good = await native_job(native, {"prompt": "hello", "sampling_params": GREEDY})
        return bad, good

    bad, good = serve_vl(go)
    assert len(bad) == 1 and words in bad[0].get("error", ""), bad
    assert len(good[0]["choices"][0]["tokens"]) == 1


# -- a text model --------------------------------------------------------------------------------


def test_text_model_refuses_images_and_serves_on(serve):
    async def go(openai):
        body = chat({"role": "user", "content": [text_part("x"), image_part(data_url(RED))]})
        body["model"] = "tiny-llama"
        bad = await collect(openai, CHAT, body)
        native = NativeServing(openai.engine)
        native_bad = await native_job(
            native, {"prompt": "x", "multi_modal_data": {"image": data_url(RED)}}
        )
        native_parts = await native_job(
            native, {"messages": [{"role": "user", "content": [image_part(data_url(RED))]}]}
        )
        good = await collect(openai, CHAT, chat({"role": "user", "content": "hi"}, model=None))
        return bad, native_bad, native_parts, good

    bad, native_bad, native_parts, good = serve(go)
    error = the_error(bad)
    assert error["param"] == "messages[0].content[1]" and error["code"] == "unsupported_parameter"
    assert "does not take images" in error["message"]
    assert "does not take images" in native_bad[0]["error"]
    assert "does not take images" in native_parts[0]["error"]
    assert good[0]["choices"][0]["message"]["content"] is not None


# -- the pieces ----------------------------------------------------------------------------------

LLAMA_STRING_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
)
GEMMA_LIKE_TEMPLATE = (
    "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<img>{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% generation %}x{% endgeneration %}{% endfor %}"
)
ALIASED_CONTENT_TEMPLATE = (
    "{% for m in messages %}{% set content = m.content %}"
    "{% for c in content | selectattr('type', 'equalto', 'text') %}{{ c.text }}{% endfor %}"
    "{% endfor %}"
)


def test_content_format_detection():
    assert content_format(QWEN_VL_CHAT_TEMPLATE) == "openai"
    assert content_format(GEMMA_LIKE_TEMPLATE) == "openai"
    assert content_format(ALIASED_CONTENT_TEMPLATE) == "openai"
    assert content_format(LLAMA_STRING_TEMPLATE) == "string"
    # A loop over messages alone, or over something else's content, is not a content loop.
    assert content_format(
        "{% for m in messages %}{% for x in tools %}{% endfor %}{% endfor %}"
    ) == ("string")
    assert content_format("{% for %}") == "string"  # does not parse: the safe choice


def test_message_content_forms():
    parts = [text_part("a"), image_part("u1"), text_part("b")]
    refs: list = []
    lists = normalise(parts, "messages[2].content", ContentForm(True, True), refs)
    assert lists == [text_part("a"), {"type": "image"}, text_part("b")]
    assert [(r.url, r.param) for r in refs] == [("u1", "messages[2].content[1].image_url")]
    # A string template with the engine's placeholder: placeholders first, as vLLM.
    refs = []
    flat = normalise(parts, "messages[0].content", ContentForm(True, False, "<image>"), refs)
    assert flat == "<image>\na\nb" and len(refs) == 1
    # Without a placeholder a string template cannot place the image.
    with pytest.raises(ContentPartError, match="reads message content as a string"):
        normalise(parts, "messages[0].content", ContentForm(True, False, None), [])
    # A text model: strings stay strings, parts are flattened, images refused.
    assert normalise("hi", "p", ContentForm(), []) == "hi"
    assert normalise([text_part("a"), text_part("b")], "p", ContentForm(), []) == "a\nb"
    with pytest.raises(ContentPartError, match="does not take images"):
        normalise(parts, "p", ContentForm(), [])
