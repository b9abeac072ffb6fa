"""api.media: every way an image reference is loaded, and every way one is refused.

A local HTTP server on 127.0.0.1 (started here) serves a PNG, redirects, a body that never
comes, a response that never starts and bodies over the byte limit. The server is on a loopback
address, which the loader refuses by default: tests that fetch from it turn
ALLOW_PRIVATE_IMAGE_URLS on, or (the redirect checks) treat 127.0.0.1 alone as public.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import socket
import struct
import threading
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image

from serverless_llm.api import media
from serverless_llm.api.media import (
    ImageRef,
    MediaConfig,
    MediaError,
    check_image_count,
    load_image,
    load_images,
    parse_limit_mm_per_prompt,
)
from serverless_llm.engine import InvalidRequestError

PARAM = "messages[1].content[0].image_url"


def png_bytes(size: tuple[int, int] = (6, 4), color=(200, 30, 60), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, "PNG")
    return buf.getvalue()


def noise_png(size: tuple[int, int] = (64, 64)) -> bytes:
    """A PNG whose image data is large (random pixels do not compress)."""
    buf = io.BytesIO()
    Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)).save(buf, "PNG")
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height pixels (its data is one short row)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" + b"\x00" * 30)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = png_bytes()


# -- the local server --------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        srv = self.server
        srv.hosts.append(self.headers.get("Host"))
        path = self.path
        if path == "/img.png":
            self._send(200, PNG, "image/png")
        elif path == "/text":
            self._send(200, b"hello, not an image", "text/plain")
        elif path == "/missing":
            self._send(404, b"no", "text/plain")
        elif path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", path.split("=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/loop":
            self.send_response(301)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/big":  # a declared length over the limit
            self.send_response(200)
            self.send_header("Content-Length", str(10 << 20))
            self.end_headers()
            self.wfile.write(b"\x00" * 1024)
        elif path == "/big-undeclared":  # no length, more bytes than the limit
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\x00" * 4096)
            except OSError:
                pass
        elif path == "/no-body":  # headers, then nothing until the test ends
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.flush()
            srv.release.wait(30)
        elif path == "/no-response":  # not even a status line
            srv.release.wait(30)
        else:
            self._send(404, b"unknown", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.release = threading.Event()
        self.hosts: list[str | None] = []

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()


PRIVATE_OK = MediaConfig(allow_private_image_urls=True, media_fetch_timeout=5.0)


@pytest.fixture()
def loopback_public(monkeypatch):
    """127.0.0.1 counts as a public address (every other address keeps its rule), so a fetch
    from the local server passes the first check and a redirect's hop is checked on its own."""
    real = media._refused_address

    def refused(address):
        return None if str(address) == "127.0.0.1" else real(address)

    monkeypatch.setattr(media, "_refused_address", refused)


# -- http(s) -------------------------------------------------------------------------------------


def test_fetches_a_png(server):
    image = load_image(f"{server.base}/img.png", PARAM, PRIVATE_OK)
    assert image.mode == "RGB" and image.size == (6, 4)
    assert image.getpixel((0, 0)) == (200, 30, 60)


def test_loopback_is_refused_by_default(server):
    with pytest.raises(MediaError) as e:
        load_image(f"{server.base}/img.png", PARAM, MediaConfig())
    message = str(e.value)
    assert message.startswith(PARAM + ": ")
    assert "loopback" in message and "ALLOW_PRIVATE_IMAGE_URLS" in message
    assert e.value.param == PARAM
    assert isinstance(e.value, InvalidRequestError)


@pytest.mark.parametrize(
    "host",
    [
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # shared address space
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "[::1]",
        "[fe80::1]",
        "[fd00::1]",
        "[::ffff:127.0.0.1]",
        "[::]",
        "[ff02::1]",
    ],
)
def test_private_addresses_are_refused_before_any_connection(host, monkeypatch):
    def no_connect(*args, **kwargs):
        raise AssertionError("connected")

    monkeypatch.setattr(media.HTTPConnection, "connect", no_connect)
    with pytest.raises(MediaError, match="ALLOW_PRIVATE_IMAGE_URLS"):
        load_image(f"http://{host}/x.png", PARAM, MediaConfig())


def test_every_resolved_address_is_checked(monkeypatch):
    """A name with one public and one private address is refused."""

    def fake_getaddrinfo(host, port, *args, **kwargs):
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
        ]

    monkeypatch.setattr(media.socket, "getaddrinfo", fake_getaddrinfo)
    with pytest.raises(MediaError, match=r"images\.example \(::1\) is a loopback address"):
        load_image("http://images.example/a.png", PARAM, MediaConfig())


def test_connects_to_the_checked_address_with_the_hosts_name(server, monkeypatch):
    """The name is resolved once and the connection goes to that address; the request still
    names the host the URL gave."""
    port = server.server_address[1]
    calls = []

    def fake_getaddrinfo(host, port_, *args, **kwargs):
        calls.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port_))]

    monkeypatch.setattr(media.socket, "getaddrinfo", fake_getaddrinfo)
    image = load_image(f"http://images.example:{port}/img.png", PARAM, PRIVATE_OK)
    assert image.size == (6, 4)
    # Looked up once; the connection's own lookup is of the address itself (numeric, no DNS).
    assert calls == ["images.example", "127.0.0.1"]
    assert server.hosts[-1] == f"images.example:{port}"


def test_localhost_falls_back_across_its_addresses(server):
    """`localhost` may resolve to ::1 first; the server listens on 127.0.0.1 only."""
    port = server.server_address[1]
    image = load_image(f"http://localhost:{port}/img.png", PARAM, PRIVATE_OK)
    assert image.size == (6, 4)


def test_redirect_to_a_private_address_is_refused(server, loopback_public):
    for target in ("http://10.1.2.3/a.png", "http://169.254.169.254/latest", "http://[::1]/a"):
        with pytest.raises(MediaError, match="ALLOW_PRIVATE_IMAGE_URLS"):
            load_image(f"{server.base}/redirect?to={target}", PARAM, MediaConfig())


def test_redirect_is_followed_and_rechecked(server, loopback_public):
    image = load_image(f"{server.base}/redirect?to=/img.png", PARAM, MediaConfig())
    assert image.size == (6, 4)


def test_redirect_to_another_scheme_is_refused(server, loopback_public):
    with pytest.raises(MediaError, match="only http"):
        load_image(f"{server.base}/redirect?to=file:///etc/passwd", PARAM, MediaConfig())


def test_redirect_loop_stops(server):
    with pytest.raises(MediaError, match="more than 5 redirects"):
        load_image(f"{server.base}/loop", PARAM, PRIVATE_OK)


def test_a_body_that_never_comes_times_out(server):
    config = MediaConfig(allow_private_image_urls=True, media_fetch_timeout=0.3)
    with pytest.raises(MediaError, match=r"longer than 0.3 s \(MEDIA_FETCH_TIMEOUT\)"):
        load_image(f"{server.base}/no-body", PARAM, config)


def test_a_response_that_never_starts_times_out(server):
    config = MediaConfig(allow_private_image_urls=True, media_fetch_timeout=0.3)
    with pytest.raises(MediaError, match="MEDIA_FETCH_TIMEOUT"):
        load_image(f"{server.base}/no-response", PARAM, config)


def test_a_declared_length_over_the_limit_is_refused(server):
    config = MediaConfig(allow_private_image_urls=True, max_image_bytes=100_000)
    with pytest.raises(
        MediaError, match=r"10485760 bytes, over .* 100000 bytes \(MAX_IMAGE_BYTES\)"
    ):
        load_image(f"{server.base}/big", PARAM, config)


def test_an_undeclared_body_over_the_limit_is_refused(server):
    config = MediaConfig(allow_private_image_urls=True, max_image_bytes=100_000)
    with pytest.raises(MediaError, match="MAX_IMAGE_BYTES"):
        load_image(f"{server.base}/big-undeclared", PARAM, config)


def test_http_errors_and_non_images(server):
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server.base}/missing", PARAM, PRIVATE_OK)
    with pytest.raises(MediaError, match="not an image"):
        load_image(f"{server.base}/text", PARAM, PRIVATE_OK)


def test_unreachable_port(server):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MediaError, match="cannot connect"):
        load_image(f"http://127.0.0.1:{port}/a.png", PARAM, PRIVATE_OK)


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://example.com/a.png", "'ftp' URLs cannot be loaded"),
        ("example.com/a.png", "a URL without a scheme"),
        ("", "non-empty"),
        ("http:///a.png", "no host"),
        ("http://user:pw@example.com/a.png", "credentials"),
        ("http://example.com:99999/a.png", "not valid"),
    ],
)
def test_bad_urls(url, message):
    with pytest.raises(MediaError, match=message):
        load_image(url, PARAM, MediaConfig())


# -- data URLs -----------------------------------------------------------------------------------


def test_data_url():
    image = load_image(data_url(PNG), PARAM, MediaConfig())
    assert image.size == (6, 4) and image.mode == "RGB"


def test_data_url_variants():
    # Line breaks (MIME), no padding, the URL-safe alphabet, no media type.
    b64 = base64.b64encode(PNG).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert load_image(f"data:image/png;base64,{wrapped}", PARAM, MediaConfig()).size == (6, 4)
    assert load_image(f"data:;base64,{b64.rstrip('=')}", PARAM, MediaConfig()).size == (6, 4)
    safe = base64.urlsafe_b64encode(PNG).decode()
    assert load_image(f"data:image/png;base64,{safe}", PARAM, MediaConfig()).size == (6, 4)


def test_data_url_bad_base64():
    with pytest.raises(MediaError, match="base64 is invalid") as e:
        load_image("data:image/png;base64,iVBOR*w0KGgo!!", PARAM, MediaConfig())
    assert str(e.value).startswith(PARAM + ": ")


def test_data_url_without_comma_or_with_another_type():
    with pytest.raises(MediaError, match="needs a ','"):
        load_image("data:image/png;base64", PARAM, MediaConfig())
    with pytest.raises(MediaError, match="'text/plain' is not an image"):
        load_image(data_url(b"hello", "text/plain"), PARAM, MediaConfig())


def test_data_url_not_an_image():
    with pytest.raises(MediaError, match="not an image in a supported format"):
        load_image(data_url(b"this is text, not pixels"), PARAM, MediaConfig())


def test_truncated_png():
    data = noise_png()
    with pytest.raises(MediaError, match="truncated or corrupt"):
        load_image(data_url(data[: len(data) // 2]), PARAM, MediaConfig())


def test_png_bomb_header_is_refused_before_decoding():
    bomb = bomb_png(50_000, 50_000)
    assert len(bomb) < 200
    with pytest.raises(MediaError, match="too many pixels|50000x50000"):
        load_image(data_url(bomb), PARAM, MediaConfig())


def test_pixel_limit_below_pillows_own():
    """9000 x 9000 is under Pillow's bomb error, over this endpoint's limit: refused from the
    header (decoding it would need 243 MB)."""
    with pytest.raises(MediaError, match="9000x9000 pixels, more than this endpoint decodes"):
        load_image(data_url(bomb_png(9000, 9000)), PARAM, MediaConfig())
    small = MediaConfig(max_image_pixels=20)
    with pytest.raises(MediaError, match="6x4 pixels"):
        load_image(data_url(PNG), PARAM, small)


def test_data_url_over_the_byte_limit():
    data = noise_png((64, 64))
    config = MediaConfig(max_image_bytes=len(data) - 1)
    with pytest.raises(MediaError, match="MAX_IMAGE_BYTES"):
        load_image(data_url(data), PARAM, config)
    assert load_image(data_url(data), PARAM, MediaConfig(max_image_bytes=len(data))).size == (
        64,
        64,
    )


def test_eps_is_not_opened():
    """Pillow's EPS loader would run Ghostscript: not among the formats tried."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(MediaError, match="not an image"):
        load_image(data_url(eps, "image/eps"), PARAM, MediaConfig())


def test_transparency_is_composited_on_white():
    rgba = png_bytes((2, 2), (10, 20, 30, 0), mode="RGBA")
    image = load_image(data_url(rgba), PARAM, MediaConfig())
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)
    gray = png_bytes((2, 2), 128, mode="L")
    assert load_image(data_url(gray), PARAM, MediaConfig()).getpixel((1, 1)) == (128, 128, 128)


def test_other_formats():
    for fmt in ("JPEG", "WEBP", "GIF", "BMP"):
        buf = io.BytesIO()
        Image.new("RGB", (5, 3), (0, 128, 255)).save(buf, fmt)
        image = load_image(data_url(buf.getvalue(), f"image/{fmt.lower()}"), PARAM, MediaConfig())
        assert image.size == (5, 3) and image.mode == "RGB", fmt


# -- file URLs -----------------------------------------------------------------------------------


def test_file_urls(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a b.png").write_bytes(PNG)
    outside = tmp_path / "secret.png"
    outside.write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside)
    config = MediaConfig(allowed_local_media_path=str(allowed))

    assert load_image(f"file://{allowed}/a%20b.png", PARAM, config).size == (6, 4)
    for url in (
        f"file://{outside}",
        f"file://{allowed}/../secret.png",
        f"file://{allowed}/link.png",  # a symlink leading out
        "file:///etc/passwd",
    ):
        with pytest.raises(MediaError, match="outside the directory"):
            load_image(url, PARAM, config)
    with pytest.raises(MediaError, match="no such file"):
        load_image(f"file://{allowed}/nope.png", PARAM, config)
    with pytest.raises(MediaError, match="not a regular file"):
        load_image(f"file://{allowed}", PARAM, config)
    with pytest.raises(MediaError, match="names no host"):
        load_image(f"file://otherhost{allowed}/a%20b.png", PARAM, config)


def test_file_urls_are_off_without_a_directory(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    with pytest.raises(MediaError, match="ALLOWED_LOCAL_MEDIA_PATH is unset"):
        load_image(f"file://{tmp_path}/a.png", PARAM, MediaConfig())


def test_file_over_the_byte_limit(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    config = MediaConfig(allowed_local_media_path=str(tmp_path), max_image_bytes=len(PNG) - 1)
    with pytest.raises(MediaError, match="MAX_IMAGE_BYTES"):
        load_image(f"file://{tmp_path}/a.png", PARAM, config)


def test_a_fifo_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    config = MediaConfig(allowed_local_media_path=str(tmp_path))
    with pytest.raises(MediaError, match="not a regular file"):
        load_image(f"file://{tmp_path}/pipe.png", PARAM, config)


# -- several images, the limit per prompt --------------------------------------------------------


def test_load_images_in_order_and_first_error(server):
    refs = [
        ImageRef(data_url(png_bytes((3, 3))), "p[0]"),
        ImageRef(f"{server.base}/img.png", "p[1]"),
        ImageRef(data_url(png_bytes((7, 2))), "p[2]"),
    ]
    images = asyncio.run(load_images(refs, PRIVATE_OK))
    assert [im.size for im in images] == [(3, 3), (6, 4), (7, 2)]
    bad = [refs[0], ImageRef("data:image/png;base64,@@", "p[1]"), ImageRef("ftp://x", "p[2]")]
    with pytest.raises(MediaError) as e:
        asyncio.run(load_images(bad, PRIVATE_OK))
    assert e.value.param == "p[1]"


def test_limit_mm_per_prompt_forms():
    assert parse_limit_mm_per_prompt('{"image": 4}') == {"image": 4}
    assert parse_limit_mm_per_prompt('{"image": {"count": 2}, "video": 0}') == {
        "image": 2,
        "video": 0,
    }
    assert parse_limit_mm_per_prompt("image=16,video=2") == {"image": 16, "video": 2}
    for bad in ('{"image": -1}', '{"image": "3"}', '{"imag": 1}', "image", "[1]", "{", "image=x"):
        with pytest.raises(ValueError):
            parse_limit_mm_per_prompt(bad)


def test_check_image_count():
    config = MediaConfig(limit_mm_per_prompt={"image": 2})
    check_image_count(2, config, "messages")
    with pytest.raises(InvalidRequestError, match=r"at most 2 image\(s\).*has 3") as e:
        check_image_count(3, config, "messages")
    assert e.value.param == "messages" and "LIMIT_MM_PER_PROMPT" in str(e.value)
    check_image_count(1, MediaConfig(), "messages")  # vLLM's default: one
    with pytest.raises(InvalidRequestError, match="at most 1"):
        check_image_count(2, MediaConfig(), "messages")
    with pytest.raises(InvalidRequestError, match="takes no images"):
        check_image_count(1, MediaConfig(limit_mm_per_prompt={"image": 0}), "messages")


def test_https_to_a_plain_http_server_fails_cleanly(server):
    port = server.server_address[1]
    with pytest.raises(MediaError, match="TLS|fetching the image failed"):
        load_image(f"https://127.0.0.1:{port}/img.png", PARAM, PRIVATE_OK)
