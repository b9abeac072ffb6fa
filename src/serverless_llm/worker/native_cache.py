"""Where the native CPU kernels keep what they build and measure, chosen before the engine loads.

The native kernels' cache (NATIVE_KERNEL_CACHE, engine/kernels/cpu_native.py) holds the compiled
libraries (~1 s to build) and the linears' measured row choice (`linear-rows-*.json`,
engine/layers/linear.py: ~0.6 s to measure for SmolLM2, longer for larger models). Its default is
the container's home, lost with the container, so every fresh worker built and measured again.
As for Triton's cache (triton_cache.py):

- NATIVE_KERNEL_CACHE set by the deployment: kept as it is.
- A network volume at BASE_PATH (the rule models download by): `<BASE_PATH>/cpu-native-cache`,
  so the endpoint's next worker finds what the first one built and measured. Entries baked into
  the image and absent there are copied in first.
- A cache baked into the image (builder/bake_cpu_kernels.py writes it for the build machine's
  CPU; the Dockerfile names it in BAKED_NATIVE_KERNEL_CACHE): used when it is not empty.
- Otherwise the default, in the container.

Sharing one directory between machines is safe: a library's file name is a key of its source,
the compiler, the CPU's flags and the build flags, and a row choice's is a key of the CPU (model
name, flags, core counts, threads: `linear.cpu_identity`), the library and the model's shapes, so
a worker on another CPU never reads an entry measured elsewhere: it builds and measures its own
beside it. Both are written under a temporary name and renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from .settings.engine_config import download_dir

logger = logging.getLogger(__name__)

ENV = "NATIVE_KERNEL_CACHE"
BAKED_ENV = "BAKED_NATIVE_KERNEL_CACHE"
VOLUME_DIR = "cpu-native-cache"


def _entries(path: str | None) -> list[str]:
    if not path or not os.path.isdir(path):
        return []
    try:
        return [e.name for e in os.scandir(path) if e.is_file() and not e.name.startswith(".")]
    except OSError:
        return []


def native_cache_dir(base_path: str) -> tuple[str | None, str]:
    """(the directory to use, or None for the default, and why)."""
    if os.environ.get(ENV, "").strip():
        return os.environ[ENV].strip(), ENV
    if download_dir(base_path) is not None:
        return os.path.join(os.path.expanduser(base_path), VOLUME_DIR), "the network volume"
    baked = os.environ.get(BAKED_ENV, "").strip()
    if _entries(baked):
        return baked, "baked into the image"
    return None, "the container's (the default)"


def seed_from_baked(path: str) -> int:
    """Copies the baked cache's entries that `path` lacks into it (each written under a
    temporary name and renamed: a worker starting beside it sees whole files or none). Returns
    how many were copied."""
    baked = os.environ.get(BAKED_ENV, "").strip()
    if not baked or os.path.abspath(baked) == os.path.abspath(path):
        return 0
    have = set(_entries(path))
    copied = 0
    for name in _entries(baked):
        if name in have:
            continue
        fd, tmp = tempfile.mkstemp(prefix=".seed-", dir=path)
        os.close(fd)
        try:
            shutil.copyfile(os.path.join(baked, name), tmp)
            os.replace(tmp, os.path.join(path, name))
            copied += 1
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return copied


def configure(base_path: str) -> str | None:
    """Sets NATIVE_KERNEL_CACHE for this process (before the engine builds or loads its native
    libraries) and logs where it points; None: the default."""
    path, why = native_cache_dir(base_path)
    if path is not None and why != ENV:
        try:
            os.makedirs(path, exist_ok=True)
            if why == "the network volume":
                copied = seed_from_baked(path)
                if copied:
                    why += f", {copied} entries copied from the image's"
        except OSError as e:
            logger.warning(
                "native kernel cache %s is not writable (%s): using the default", path, e
            )
            return None
        os.environ[ENV] = path
    logger.info(
        "native CPU kernel cache: %s (%s)", path or "~/.cache/serverless_llm/cpu_native", why
    )
    return path
