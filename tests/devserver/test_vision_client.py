"""The official OpenAI client against the local endpoint on a tiny random Qwen2.5-VL (issue 36):
data-URL and http-URL images (a local test server), two images in one message and one in an
earlier turn, streaming; bad images refused with the part named, and the worker serving on.

Two workers: one whose settings allow private image URLs (the test server is on 127.0.0.1) and
three images a prompt, one with the defaults (no private URLs, one image a prompt), so the
settings reach the routes through the worker as deployed."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Iterator

import openai
import pytest
from PIL import Image

from tests.devserver.conftest import API_KEY, ServerThread, serve
from tests.engine.vision_qwen_vl_models import save_tiny_qwen2_5_vl

MODEL = "tiny-vl"


def png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


RED = png((56, 28), (220, 20, 20))
BLUE = png((28, 84), (20, 40, 230))
GREEN = png((112, 56), (10, 200, 40))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class _Images(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        body = {"/blue.png": BLUE, "/green.png": GREEN}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")


@pytest.fixture(scope="module")
def images_url() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> str:
    return save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("tiny-vl") / "model"))


def _endpoint(model: str, base: str, **env: str) -> Iterator[ServerThread]:
    from serverless_llm.devserver.app import create_app
    from serverless_llm.worker.handler import Worker
    from serverless_llm.worker.settings import Settings

    settings = Settings.from_env(
        {
            "MODEL_NAME": model,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": MODEL,
            "BASE_PATH": base,
            "DEVICE": "cpu",
            "DTYPE": "float32",
            "MAX_MODEL_LEN": "512",
            "NUM_GPU_BLOCKS_OVERRIDE": "128",
            **env,
        }
    )
    worker = Worker(settings)
    with serve(create_app(worker, api_key=API_KEY, max_concurrency=8)) as server:
        server.worker = worker  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="module")
def permissive(vl_model, tmp_path_factory) -> Iterator[openai.OpenAI]:
    base = str(tmp_path_factory.mktemp("base"))
    env = {"ALLOW_PRIVATE_IMAGE_URLS": "1", "LIMIT_MM_PER_PROMPT": '{"image": 3}'}
    for server in _endpoint(vl_model, base, **env):
        yield openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=API_KEY, timeout=60)


@pytest.fixture(scope="module")
def default(vl_model, tmp_path_factory) -> Iterator[openai.OpenAI]:
    base = str(tmp_path_factory.mktemp("base"))
    for server in _endpoint(vl_model, base):
        yield openai.OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=API_KEY, timeout=60)


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def conversation(images_url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is this?"}, image(data_url(RED))],
        },
        {"role": "assistant", "content": "a red thing"},
        {
            "role": "user",
            "content": [
                image(f"{images_url}/blue.png"),
                {"type": "text", "text": "and these two?"},
                image(data_url(GREEN)),
            ],
        },
    ]


def test_images_through_the_client_streamed_and_not(permissive, images_url):
    messages = conversation(images_url)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
    full = permissive.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    text_only = permissive.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "what is this?"}],
        max_tokens=1,
    )
    assert full.usage.prompt_tokens > text_only.usage.prompt_tokens + 3 * 4  # the images' tokens

    stream = permissive.chat.completions.create(
        **kwargs,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
    assert text == full.choices[0].message.content
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_responses_with_an_image(permissive, images_url):
    resp = permissive.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {
                        "type": "input_image",
                        "image_url": f"{images_url}/green.png",
                        "detail": "auto",
                    },
                ],
            }
        ],
        max_output_tokens=4,
        temperature=0.0,
    )
    assert resp.usage.input_tokens > 12 and resp.output_text is not None


def test_bad_images_name_their_part_and_the_worker_serves_on(permissive, images_url):
    cases = [
        ("data:image/png;base64,not*base64", "base64"),
        (data_url(b"plain text"), "not an image"),
        (f"{images_url}/missing.png", "HTTP 404"),
    ]
    for url, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            permissive.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image(url)]}],
                max_tokens=2,
            )
        assert info.value.status_code == 400
        assert info.value.param == "messages[0].content[1].image_url"
        assert words in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        permissive.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [image(data_url(RED))] * 4}],
            max_tokens=2,
        )
    assert info.value.param == "messages" and "at most 3 image(s)" in str(info.value)
    ok = permissive.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [image(data_url(RED))]}], max_tokens=2
    )
    assert ok.choices[0].message.content is not None


def test_defaults_refuse_loopback_urls_and_a_second_image(default, images_url):
    with pytest.raises(openai.BadRequestError) as info:
        default.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [image(f"{images_url}/blue.png")]}],
            max_tokens=2,
        )
    assert info.value.param == "messages[0].content[0].image_url"
    assert "loopback" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        default.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [image(data_url(RED)), image(data_url(BLUE))]}],
            max_tokens=2,
        )
    assert "at most 1 image(s)" in str(info.value)
    ok = default.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [image(data_url(RED))]}], max_tokens=2
    )
    assert ok.usage.prompt_tokens > 4
