"""Where Triton keeps compiled kernels, chosen before anything imports Triton.

- TRITON_CACHE_DIR set by the deployment: kept as it is.
- A cache baked into the image (builder/compile_kernels.py writes it, the Dockerfile names it in
  BAKED_TRITON_CACHE_DIR): used when it exists; it already holds the build's architectures.
- A network volume at BASE_PATH (the rule models download by, settings/engine_config.py):
  `<BASE_PATH>/triton-cache/<triton version>/sm<arch>`, so every worker of the endpoint finds
  what the first one compiled. The version and architecture in the path keep workers of other
  images and GPUs apart (their entries would never match, only accumulate).
- Otherwise Triton's default, in the container (~/.triton/cache), lost with the container.

Several workers may share one directory: Triton writes each file under a temporary name in a
private directory and renames it into place (an atomic replace on POSIX filesystems), and a
kernel's group index is written last, so a reader sees a whole entry or none.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

from . import native_cache
from .settings.engine_config import download_dir

logger = logging.getLogger(__name__)

BAKED_ENV = "BAKED_TRITON_CACHE_DIR"


def triton_cache_dir(base_path: str, arch: str | None) -> tuple[str | None, str]:
    """(the directory to use, or None for Triton's default, and why)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"], "TRITON_CACHE_DIR"
    baked = os.environ.get(BAKED_ENV)
    if baked and os.path.isdir(baked) and any(os.scandir(baked)):
        return baked, "baked into the image"
    if arch is not None and download_dir(base_path) is not None:
        try:
            version = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            return None, "triton is not installed"
        path = os.path.join(os.path.expanduser(base_path), "triton-cache", version, arch)
        return path, "the network volume"
    return None, "the container's (Triton's default)"


def configure(base_path: str) -> str | None:
    """Sets TRITON_CACHE_DIR for this process (on CUDA only) and logs where it points; on a
    machine without CUDA, places the native CPU kernels' cache instead (native_cache.py: the
    same rules for its compiled libraries and measured row choices)."""
    import torch

    if not torch.cuda.is_available():
        native_cache.configure(base_path)
        return None
    major, minor = torch.cuda.get_device_capability()
    path, why = triton_cache_dir(base_path, f"sm{major}{minor}")
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            logger.warning("Triton cache %s is not writable (%s): using the default", path, e)
            return None
        os.environ["TRITON_CACHE_DIR"] = path
    logger.info("Triton kernel cache: %s (%s)", path or "~/.triton/cache", why)
    return path
