"""One image a request refers to, loaded into an RGB PIL image, with every cost bounded.

A reference is a data URL (`data:image/png;base64,...`), an http(s) URL, or a file URL under
ALLOWED_LOCAL_MEDIA_PATH (refused when that is unset). Whatever the source, the bytes are capped
(MAX_IMAGE_BYTES) and the image's size is read from its header and refused above
`MAX_IMAGE_PIXELS` before a pixel is decoded, so a 50,000 x 50,000 PNG of a few hundred bytes
costs nothing. Truncated files and bytes that are no image of a format Pillow reads safely are
refused too; only the formats in `IMAGE_FORMATS` are tried (Pillow also opens EPS, whose loader
runs Ghostscript, and many formats no client sends).

Fetching an http(s) URL (urllib3; no proxies from the environment):
- the host's addresses are resolved once, every one of them checked (IPv4 and IPv6), and the
  connection goes to a checked address, so a DNS answer cannot change between the check and
  the fetch; loopback, link-local, private, shared, reserved, multicast and unspecified
  addresses are refused unless ALLOW_PRIVATE_IMAGE_URLS is on (an IPv4 address written as
  IPv6, `::ffff:127.0.0.1`, is checked as the IPv4 address);
- redirects are followed here, at most `max_redirects`, each hop checked like the first;
- one deadline (MEDIA_FETCH_TIMEOUT) covers the whole fetch, redirects and DNS included: a
  watchdog shuts the socket at the deadline, so a server that trickles its headers or its
  body one byte at a time cannot hold a thread longer;
- the body is counted as it arrives (decompressed, when a server compresses anyway) and the
  fetch stops past MAX_IMAGE_BYTES; a Content-Length above it is refused before reading.

Loading blocks (network, disk, decoding): the routes call `load_images`, which loads a
prompt's images concurrently in threads, off the event loop. Every failure is a `MediaError`
naming the request part (`messages[1].content[0].image_url: ...`): a 400 on every route.
"""

from __future__ import annotations

import asyncio
import binascii
import errno
import ipaddress
import json
import os
import re
import socket
import ssl
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from io import BytesIO
from types import MappingProxyType
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

import urllib3
from PIL import Image, UnidentifiedImageError
from urllib3.connection import HTTPConnection, HTTPSConnection

from ..engine import InvalidRequestError

__all__ = [
    "DEFAULT_LIMIT_MM_PER_PROMPT",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MEDIA_FETCH_TIMEOUT",
    "IMAGE_FORMATS",
    "MAX_IMAGE_PIXELS",
    "ImageRef",
    "MediaConfig",
    "MediaError",
    "check_image_count",
    "decode_image",
    "load_image",
    "load_images",
    "parse_limit_mm_per_prompt",
]

# The defaults of the settings of the same names (worker/settings).
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MEDIA_FETCH_TIMEOUT = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
# vLLM's default (its docs of --limit-mm-per-prompt): one item of each modality per prompt.
DEFAULT_LIMIT_MM_PER_PROMPT: Mapping[str, int] = MappingProxyType({"image": 1})
MODALITIES = ("image", "video", "audio")

# 8192 x 8192: above any photo a phone takes, below Pillow's own bomb warning (~89.5 M pixels),
# and ~200 MB as RGB, decoded at most LIMIT_MM_PER_PROMPT at a time per request.
MAX_IMAGE_PIXELS = 8192 * 8192

# The formats tried, in Pillow's names: what browsers and cameras produce (MPO: a phone's JPEG),
# those this Pillow build reads (AVIF needs its plugin).
Image.init()
IMAGE_FORMATS = tuple(
    f for f in ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "AVIF") if f in Image.OPEN
)

MAX_REDIRECTS = 5
MAX_URL_CHARS = 64 << 10  # an http(s) or file URL; a data URL is bounded by MAX_IMAGE_BYTES
_READ_CHUNK = 64 << 10
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_USER_AGENT = "serverless-llm-image-fetch"


class MediaError(InvalidRequestError):
    """An image reference that cannot be loaded: `message` says why, `param` names the request
    part; str() is `<param>: <message>`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message, param)
        self.reason = message


def _failed(param: str, reason: str) -> MediaError:
    return MediaError(reason, param)


@dataclass(frozen=True)
class MediaConfig:
    """How images are loaded: the worker's settings of the same names (upper-cased)."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    media_fetch_timeout: float = DEFAULT_MEDIA_FETCH_TIMEOUT
    allow_private_image_urls: bool = False
    allowed_local_media_path: str | None = None
    limit_mm_per_prompt: Mapping[str, int] = field(
        default_factory=lambda: dict(DEFAULT_LIMIT_MM_PER_PROMPT)
    )
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_redirects: int = MAX_REDIRECTS

    def limit(self, modality: str) -> int:
        """Most items of `modality` in one prompt (vLLM: 1 for a modality not named)."""
        return self.limit_mm_per_prompt.get(modality, 1)


@dataclass(frozen=True)
class ImageRef:
    """An image reference as the request gave it, with the request part it came from."""

    url: str
    param: str


# -- LIMIT_MM_PER_PROMPT ---------------------------------------------------------------------


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """LIMIT_MM_PER_PROMPT as {modality: count}: vLLM's JSON (`{"image": 4}`, a count or
    `{"count": 4}` per modality) or its older `image=4,video=1`. ValueError saying what is
    wrong."""
    text = text.strip()
    if not text:
        return dict(DEFAULT_LIMIT_MM_PER_PROMPT)
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError("must be a JSON object")
        items = list(data.items())
    else:
        items = []
        for pair in re.split(r"[\s,]+", text):
            name, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"{pair!r} is not modality=count")
            try:
                items.append((name, int(value)))
            except ValueError:
                raise ValueError(f"{pair!r}: the count must be an integer") from None
    out: dict[str, int] = {}
    for name, value in items:
        if name not in MODALITIES:
            raise ValueError(f"unknown modality {name!r} (one of {', '.join(MODALITIES)})")
        if isinstance(value, dict):
            if set(value) != {"count"}:
                raise ValueError(f"{name}: an object takes only 'count'")
            value = value["count"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: the count must be an integer >= 0")
        out[name] = value
    return out


def check_image_count(count: int, config: MediaConfig, param: str) -> None:
    """A prompt's number of images against LIMIT_MM_PER_PROMPT, before anything is fetched."""
    limit = config.limit("image")
    if count <= limit:
        return
    if limit == 0:
        message = "this endpoint takes no images (LIMIT_MM_PER_PROMPT sets image to 0)"
    else:
        message = (
            f"at most {limit} image(s) may be provided in one prompt (LIMIT_MM_PER_PROMPT); "
            f"this one has {count}"
        )
    raise InvalidRequestError(message, param)


# -- loading ---------------------------------------------------------------------------------


async def load_images(refs: Sequence[ImageRef], config: MediaConfig) -> list[Image.Image]:
    """The images of `refs`, in order, loaded concurrently off the event loop; the first
    failure (in request order) is raised once every load has ended."""
    if not refs:
        return []
    results = await asyncio.gather(
        *(asyncio.to_thread(load_image, r.url, r.param, config) for r in refs),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)  # type: ignore[arg-type]


def load_image(url: str, param: str, config: MediaConfig) -> Image.Image:
    """One reference as an RGB image (blocking); MediaError naming `param` when it cannot be."""
    if not isinstance(url, str) or not url.strip():
        raise _failed(param, "the image URL must be a non-empty string")
    url = url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, param, config)
    elif scheme in ("http", "https"):
        data = _fetch_http(url, param, config)
    elif scheme == "file":
        data = _read_file_url(url, param, config)
    else:
        shown = f"'{scheme}' URLs" if scheme else "a URL without a scheme"
        raise _failed(
            param,
            f"{shown} cannot be loaded: give an http(s) URL or a data URL "
            "(data:image/png;base64,...)",
        )
    return decode_image(data, param, config)


def decode_image(data: bytes, param: str, config: MediaConfig) -> Image.Image:
    """Bytes to an RGB image: the size read from the header and checked before decoding;
    transparency composited on white (as vLLM does); the first frame of an animation."""
    if not data:
        raise _failed(param, "the image is empty (0 bytes)")
    try:
        image = Image.open(BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise _failed(param, _too_many_pixels(None, config)) from None
    except UnidentifiedImageError:
        raise _failed(
            param,
            "the data is not an image in a supported format "
            f"({', '.join(f for f in IMAGE_FORMATS if f != 'MPO')})",
        ) from None
    except Exception as e:  # noqa: BLE001 - a malformed header can raise anything
        raise _failed(param, f"the image cannot be read: {_describe(e)}") from None
    try:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise _failed(param, f"the image has no pixels ({width}x{height})")
        if width * height > config.max_image_pixels:
            raise _failed(param, _too_many_pixels((width, height), config))
        try:
            image.load()
        except Image.DecompressionBombError:
            raise _failed(param, _too_many_pixels(image.size, config)) from None
        except Exception as e:  # noqa: BLE001 - truncated or corrupt data
            raise _failed(
                param, f"the image data is truncated or corrupt: {_describe(e)}"
            ) from None
        return _to_rgb(image)
    finally:
        image.close()


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image.copy()
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode == "P" and "transparency" in image.info
    )
    if has_alpha:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def _too_many_pixels(size: tuple[int, int] | None, config: MediaConfig) -> str:
    limit = config.max_image_pixels
    what = f"the image is {size[0]}x{size[1]} pixels" if size else "the image has too many pixels"
    return f"{what}, more than this endpoint decodes ({limit:,} pixels)"


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _over_size(size: int | str, config: MediaConfig) -> str:
    return f"the image is {size} bytes, over this endpoint's limit of {config.max_image_bytes} bytes (MAX_IMAGE_BYTES)"


# -- data URLs -------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"\s+")


def _data_url_bytes(url: str, param: str, config: MediaConfig) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise _failed(param, "a data URL needs a ',' before its data (data:image/png;base64,...)")
    fields = [f.strip().lower() for f in header.split(";")]
    media_type, is_base64 = fields[0], "base64" in fields[1:]
    if media_type and not (
        media_type.startswith("image/") or media_type == "application/octet-stream"
    ):
        raise _failed(param, f"the data URL's media type {media_type!r} is not an image type")
    if not is_base64:
        data = unquote_to_bytes(payload)
        if len(data) > config.max_image_bytes:
            raise _failed(param, _over_size(len(data), config))
        return data
    # Checked before decoding: 4 characters of base64 hold 3 bytes (line breaks, as MIME
    # writes them, add 2 in 78, so twice the size is a safe first cut before stripping them).
    most = (config.max_image_bytes + 2) // 3 * 4
    if len(payload) > 2 * most + 1024:
        raise _failed(param, _over_size(f"about {len(payload) // 4 * 3}", config))
    text = _WHITESPACE.sub("", payload)
    if len(text) > most + 4:
        raise _failed(param, _over_size(f"about {len(text) // 4 * 3}", config))
    if "-" in text or "_" in text:  # the URL-safe alphabet
        text = text.translate(str.maketrans("-_", "+/"))
    text += "=" * (-len(text) % 4)
    try:
        data = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise _failed(param, f"the data URL's base64 is invalid ({e})") from None
    if len(data) > config.max_image_bytes:
        raise _failed(param, _over_size(len(data), config))
    return data


# -- file URLs -------------------------------------------------------------------------------


def _read_file_url(url: str, param: str, config: MediaConfig) -> bytes:
    root = config.allowed_local_media_path
    if not root:
        raise _failed(
            param, "file URLs are off on this endpoint (ALLOWED_LOCAL_MEDIA_PATH is unset)"
        )
    if len(url) > MAX_URL_CHARS:
        raise _failed(param, f"the URL is longer than {MAX_URL_CHARS} characters")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _failed(param, f"a file URL names no host, got {parts.netloc!r}")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise _failed(param, "a file URL needs an absolute path (file:///dir/image.png)")
    allowed = os.path.realpath(root)
    real = os.path.realpath(path)  # symlinks resolved, so none leads out of the directory
    if os.path.commonpath([real, allowed]) != allowed:
        raise _failed(
            param,
            "the file is outside the directory local images may come from "
            "(ALLOWED_LOCAL_MEDIA_PATH)",
        )
    try:
        # Non-blocking, so a FIFO cannot hang the open; only regular files are read.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        why = "no such file" if e.errno == errno.ENOENT else (e.strerror or str(e))
        raise _failed(param, f"the file cannot be opened: {why}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _failed(param, "the path is not a regular file")
        if info.st_size > config.max_image_bytes:
            raise _failed(param, _over_size(info.st_size, config))
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(config.max_image_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > config.max_image_bytes:
        raise _failed(param, _over_size(f"more than {config.max_image_bytes}", config))
    return data


# -- http(s) ---------------------------------------------------------------------------------

# Name lookups run here so they fit in the fetch's deadline (getaddrinfo takes no timeout).
_dns_pool: ThreadPoolExecutor | None = None
_dns_lock = threading.Lock()
_ssl_context: ssl.SSLContext | None = None


def _dns() -> ThreadPoolExecutor:
    global _dns_pool
    with _dns_lock:
        if _dns_pool is None:
            _dns_pool = ThreadPoolExecutor(8, thread_name_prefix="media-dns")
        return _dns_pool


def _tls() -> ssl.SSLContext:
    """Certificates verified against the system's trust store (the image installs
    ca-certificates); made once."""
    global _ssl_context
    with _dns_lock:
        if _ssl_context is None:
            _ssl_context = ssl.create_default_context()
        return _ssl_context


class _Deadline:
    """The fetch's one deadline: a watchdog shuts the connection's socket when it passes, so
    a blocked connect, handshake or read returns at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.expired = False
        self._conn: HTTPConnection | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.end - time.monotonic()

    def timed_out(self, error: BaseException) -> bool:
        """Whether `error` is the deadline's doing: the watchdog shut the socket, or the
        socket's own timeout (the time left, set on it) fired a moment before the watchdog."""
        if self.expired:
            return True
        # urllib3's NewConnectionError (refused, unreachable) subclasses its timeout error.
        if isinstance(error, urllib3.exceptions.NewConnectionError):
            return False
        return isinstance(error, (TimeoutError, urllib3.exceptions.TimeoutError))

    def watch(self, conn: HTTPConnection | None) -> None:
        with self._lock:
            self._conn = conn
        if conn is not None and self.expired:
            self._shut(conn)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            conn = self._conn
        if conn is not None:
            self._shut(conn)

    @staticmethod
    def _shut(conn: HTTPConnection) -> None:
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()


def _fetch_http(url: str, param: str, config: MediaConfig) -> bytes:
    deadline = _Deadline(config.media_fetch_timeout)
    try:
        for _ in range(config.max_redirects + 1):
            status, location, body = _fetch_once(url, param, config, deadline)
            if body is not None:
                return body
            if location is None:
                raise _failed(param, f"the server answered HTTP {status} with no Location")
            url = urljoin(url, location)
        raise _failed(param, f"more than {config.max_redirects} redirects fetching the image")
    finally:
        deadline.cancel()


def _timed_out(param: str, deadline: _Deadline) -> MediaError:
    return _failed(
        param,
        f"fetching the image took longer than {deadline.seconds:g} s (MEDIA_FETCH_TIMEOUT)",
    )


def _fetch_once(
    url: str, param: str, config: MediaConfig, deadline: _Deadline
) -> tuple[int, str | None, bytes | None]:
    """One hop: (status, Location, None) for a redirect, else (200, None, body)."""
    if len(url) > MAX_URL_CHARS:
        raise _failed(param, f"the URL is longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise _failed(param, f"the URL is not valid ({e})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise _failed(param, f"a redirect led to a '{scheme}' URL; only http(s) is fetched")
    host = parts.hostname
    if not host:
        raise _failed(param, "the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise _failed(param, "credentials in an image URL are not supported")
    port = port or (443 if scheme == "https" else 80)
    addresses = _resolve(host, port, param, config, deadline)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    headers = {
        "Host": parts.netloc.rpartition("@")[2],
        "User-Agent": _USER_AGENT,
        "Accept": "image/*,*/*;q=0.5",
        "Accept-Encoding": "identity",
        "Connection": "close",
    }
    last_error: BaseException | None = None
    for address in addresses:
        if deadline.left() <= 0 or deadline.expired:
            raise _timed_out(param, deadline)
        if scheme == "https":
            conn: HTTPConnection = HTTPSConnection(
                address,
                port,
                timeout=deadline.left(),
                server_hostname=host,
                assert_hostname=host,
                ssl_context=_tls(),
            )
        else:
            conn = HTTPConnection(address, port, timeout=deadline.left())
        deadline.watch(conn)
        try:
            try:
                conn.connect()
            except (OSError, urllib3.exceptions.HTTPError) as e:
                if deadline.timed_out(e):
                    raise _timed_out(param, deadline) from None
                if isinstance(e, ssl.SSLError) or "certificate" in str(e).lower():
                    raise _failed(param, f"TLS failed: {_describe(e)}") from None
                last_error = e
                continue  # the next address, if any
            return _exchange(conn, target, headers, param, config, deadline)
        finally:
            deadline.watch(None)
            conn.close()
    raise _failed(
        param, f"cannot connect to {host} port {port}: {_describe(last_error or OSError())}"
    )


def _exchange(
    conn: HTTPConnection,
    target: str,
    headers: dict[str, str],
    param: str,
    config: MediaConfig,
    deadline: _Deadline,
) -> tuple[int, str | None, bytes | None]:
    try:
        conn.request("GET", target, headers=headers, preload_content=False)
        response = conn.getresponse()
        status = response.status
        if status in _REDIRECTS:
            return status, response.headers.get("location"), None
        if not 200 <= status < 300:
            raise _failed(param, f"fetching the image failed: HTTP {status} {response.reason}")
        length = response.headers.get("content-length")
        if length is not None and length.strip().isdigit():
            if int(length) > config.max_image_bytes:
                raise _failed(param, _over_size(int(length), config))
        body = bytearray()
        while True:
            chunk = response.read1(_READ_CHUNK)
            if not chunk:
                break
            body += chunk
            if len(body) > config.max_image_bytes:
                raise _failed(param, _over_size(f"more than {config.max_image_bytes}", config))
        if deadline.expired:  # the watchdog's shutdown can look like the end of the body
            raise _timed_out(param, deadline)
        return status, None, bytes(body)
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001 - socket, TLS and protocol errors alike
        if deadline.timed_out(e):
            raise _timed_out(param, deadline) from None
        raise _failed(param, f"fetching the image failed: {_describe(e)}") from None


def _resolve(
    host: str, port: int, param: str, config: MediaConfig, deadline: _Deadline
) -> list[str]:
    """The host's addresses, every one checked; the connection goes to one of these."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        infos = [str(literal)]
    else:
        future = _dns().submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        try:
            results = future.result(timeout=max(deadline.left(), 0.0))
        except FutureTimeout:
            raise _timed_out(param, deadline) from None
        except (OSError, UnicodeError) as e:
            raise _failed(param, f"cannot resolve the host {host!r}: {_describe(e)}") from None
        infos = list(
            dict.fromkeys(
                str(r[4][0]) for r in results if r[0] in (socket.AF_INET, socket.AF_INET6)
            )
        )
        if not infos:
            raise _failed(param, f"the host {host!r} has no address")
    if not config.allow_private_image_urls:
        for text in infos:
            why = _refused_address(ipaddress.ip_address(text.split("%", 1)[0]))
            if why:
                shown = host if host == text else f"{host} ({text})"
                raise _failed(
                    param,
                    f"{shown} is {why}; this endpoint does not fetch images from private "
                    "networks (ALLOW_PRIVATE_IMAGE_URLS)",
                )
    return infos


def _refused_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an address may not be fetched from, or None when it is a public one."""
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped or address.sixtofour
        if mapped is not None:
            return _refused_address(mapped)
    for attr, what in (
        ("is_unspecified", "an unspecified address"),
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address"),
        ("is_multicast", "a multicast address"),
        ("is_private", "a private address"),
        ("is_reserved", "a reserved address"),
    ):
        if getattr(address, attr):
            return what
    if not address.is_global:
        return "not a public address"
    return None
