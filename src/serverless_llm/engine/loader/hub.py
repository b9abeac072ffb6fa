"""Hub repos: the local HF cache first, the network only on a miss.

A worker that restarts must not depend on the hub being up when its model is already on disk,
so the cache is read with no network call at all. On a miss the repo's file list is fetched
(with a timeout) and only what the engine reads is downloaded: config, tokenizer, chat template,
a vision-language model's processor settings and one weight format (safetensors preferred, .bin
only when the repo has no safetensors). A cached snapshot that lacks a wanted file its repo's
cached listing names (processor files, in one cached before the engine read them) is not
complete to huggingface_hub: it is completed from the hub.
"""

from __future__ import annotations

import logging
import os
import re
import uuid

from huggingface_hub import (
    HfApi,
    constants,
    get_cached_repo_tree,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name

from .base import ModelLoadError, scrub
from .weights import select_weight_files

logger = logging.getLogger(__name__)

# Files a tokenizer or config may need; fnmatch patterns, as snapshot_download takes them.
TOKENIZER_PATTERNS = [
    "config.json",  # AutoTokenizer reads model_type from it when tokenizer_config lacks a class
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.tiktoken",
]
# A vision-language model's processor settings: the engine builds its processor from the
# model's directory at start (transformers 5 writes them all in processor_config.json, earlier
# versions the image processor's in preprocessor_config.json; the chat templates are above).
# The video processor's are read only where AutoProcessor builds one, and are small.
PROCESSOR_PATTERNS = [
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
]
# With the quantizers' own settings files: older AutoGPTQ and AutoAWQ repos keep them there
# rather than in config.json (loader/quantization.py reads them).
MODEL_PATTERNS = [
    *TOKENIZER_PATTERNS,
    *PROCESSOR_PATTERNS,
    "generation_config.json",
    "quantize_config.json",
    "quant_config.json",
]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def looks_like_hub_id(name: str) -> bool:
    """True for "org/name" or a legacy "name"; never for a path-like string."""
    return bool(_HUB_ID.match(name)) and not name.endswith((".gguf", ".safetensors", ".bin"))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _metadata_timeout() -> float:
    # huggingface_hub's HTTP client has no timeout of its own; every call we make gets one.
    value = os.environ.get("HF_HUB_ETAG_TIMEOUT")
    try:
        return float(value) if value else float(constants.HF_HUB_ETAG_TIMEOUT)
    except ValueError:
        return float(constants.DEFAULT_ETAG_TIMEOUT)


def storage_folder(repo_id: str, cache_dir: str | None) -> str:
    root = os.path.expanduser(cache_dir or constants.HF_HUB_CACHE)
    return os.path.join(root, repo_folder_name(repo_id=repo_id, repo_type="model"))


def _write_ref(repo_id: str, cache_dir: str | None, revision: str, commit: str) -> None:
    """Records revision -> commit, so the next start finds the snapshot without the hub.

    snapshot_download writes no ref when it is given a commit hash, which we give it so that the
    file list we chose and the files it downloads come from the same commit.
    """
    if revision == commit:
        return
    ref = os.path.join(storage_folder(repo_id, cache_dir), "refs", revision)
    try:
        if os.path.isfile(ref):
            with open(ref, encoding="utf-8") as f:
                if f.read().strip() == commit:
                    return
        os.makedirs(os.path.dirname(ref), exist_ok=True)
        tmp = f"{ref}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(commit)
        os.replace(tmp, ref)
    except OSError as e:
        logger.warning("could not record revision %s of %s in the cache: %s", revision, repo_id, e)


def _check_snapshot(
    repo_id: str,
    revision: str,
    cache_dir: str | None,
    folder: str,
    weights_format: str | None,
    tokenizer_only: bool,
) -> tuple[str, str | None]:
    """(format, problem) for a cached snapshot; problem None means complete.

    Weights are checked here rather than by snapshot_download: which files to expect depends on
    the weight format chosen, which depends on the repo's file list. That list comes from the
    hub's cached tree listing when there is one, else from the folder itself.
    """
    if tokenizer_only:
        if any(os.path.exists(os.path.join(folder, n)) for n in _TOKENIZER_FILES):
            return "tokenizer", None
        return "tokenizer", "no tokenizer files"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return "", "no config.json"
    if weights_format is None:
        return "dummy", None
    try:
        tree = get_cached_tree(repo_id, revision, cache_dir)
    except CachedRepoTreeNotFoundError:
        tree = None
    names = tree if tree is not None else os.listdir(folder)

    def read_index(name: str) -> str:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read()

    try:
        found = select_weight_files(names, weights_format, read_index)
    except OSError:
        return "", "its weight index is missing"
    if found is None:
        kind = "safetensors or .bin" if weights_format == "auto" else weights_format
        return "", f"no {kind} weights"
    fmt, files = found
    missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
    if missing:
        return fmt, f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")
    return fmt, None


def get_cached_tree(repo_id: str, revision: str, cache_dir: str | None) -> list[str]:
    """The repo's file list as the last download saw it; no network."""
    return [f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)]


def _hub_error(e: Exception, repo_id: str, revision: str, token: str | None) -> ModelLoadError:
    if isinstance(e, OfflineModeIsEnabled):
        msg = f"model {repo_id} is not in the cache and the hub is offline (HF_HUB_OFFLINE=1)"
    elif isinstance(e, GatedRepoError):
        msg = (
            f"model {repo_id} is gated on the hub: accept its terms there and set HF_TOKEN "
            "to a token with access"
        )
    elif isinstance(e, RepositoryNotFoundError):
        msg = (
            f"model {repo_id} not found on the hub (or it is private and HF_TOKEN is missing "
            "or has no access)"
        )
    elif isinstance(e, RevisionNotFoundError):
        msg = f"revision {revision!r} of model {repo_id} not found on the hub"
    elif isinstance(e, HFValidationError):
        msg = f"{repo_id!r} is not a valid hub model id: {e}"
    elif isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        msg = f"the hub answered HTTP {status} for model {repo_id}: {str(e).splitlines()[0]}"
    else:
        msg = (
            f"cannot download model {repo_id} from {constants.ENDPOINT}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        )
    return ModelLoadError(scrub(msg, token))


def _download(
    repo_id: str,
    revision: str,
    cache_dir: str | None,
    token: str | None,
    weights_format: str | None,
    patterns: list[str],
    tokenizer_only: bool,
) -> str:
    """Fetches what the engine needs of `repo_id` at `revision`; returns the snapshot folder."""
    timeout = _metadata_timeout()
    api = HfApi(token=token)
    info = api.model_info(repo_id, revision=revision, timeout=timeout)
    commit = info.sha
    names = [s.rfilename for s in info.siblings or []]
    allow = list(patterns)
    if not tokenizer_only and "config.json" not in names:
        ggufs = [n for n in names if n.endswith(".gguf")]
        hint = " (a GGUF repo: download the .gguf file and pass its path)" if ggufs else ""
        raise ModelLoadError(f"model {repo_id} has no config.json on the hub{hint}")
    if weights_format is not None:

        def read_index(name: str) -> str:
            path = hf_hub_download(
                repo_id,
                name,
                revision=commit,
                cache_dir=cache_dir,
                token=token,
                etag_timeout=timeout,
            )
            with open(path, encoding="utf-8") as f:
                return f.read()

        found = select_weight_files(names, weights_format, read_index)
        if found is None:
            kind = "safetensors or .bin" if weights_format == "auto" else weights_format
            raise ModelLoadError(f"model {repo_id} has no {kind} weights on the hub")
        allow += found[1]
    logger.info("downloading %s (revision %s) from the hub", repo_id, revision)
    folder = snapshot_download(
        repo_id,
        revision=commit,
        cache_dir=cache_dir,
        token=token,
        allow_patterns=allow,
        etag_timeout=timeout,
    )
    _write_ref(repo_id, cache_dir, revision, commit)
    return folder


def hub_snapshot(
    repo_id: str,
    *,
    revision: str | None,
    cache_dir: str | None,
    token: str | None,
    weights_format: str | None,
    tokenizer_only: bool = False,
    trust_remote_code: bool = False,
) -> tuple[str, str]:
    """(snapshot folder, format) of `repo_id`, from the cache when complete there.

    weights_format: "auto" | "safetensors" | "pt", or None for config and tokenizer only. The
    format returned is the weight format found, "dummy" without weights, "tokenizer" for
    tokenizer_only.
    """
    revision = revision or "main"
    base = TOKENIZER_PATTERNS if tokenizer_only else MODEL_PATTERNS
    # Remote code lives in the repo's .py files.
    patterns = [*base, "*.py"] if trust_remote_code else list(base)
    label = repo_id if revision == "main" else f"{repo_id}@{revision}"
    try:
        folder: str | None = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=True,
            allow_patterns=patterns,
        )
    except LocalEntryNotFoundError:  # includes IncompleteSnapshotError
        folder = None
    except HFValidationError as e:
        raise _hub_error(e, repo_id, revision, token) from e
    problem = "not in the cache"
    if folder is not None:
        fmt, problem = _check_snapshot(
            repo_id, revision, cache_dir, folder, weights_format, tokenizer_only
        )
        if problem is None:
            logger.debug("%s found in the cache at %s", label, folder)
            return folder, fmt
        logger.info("cached snapshot of %s at %s is incomplete: %s", label, folder, problem)
    if hub_offline():
        where = folder or storage_folder(repo_id, cache_dir)
        state = (
            "is not in the cache" if folder is None else f"is incomplete in the cache ({problem})"
        )
        raise ModelLoadError(
            f"model {label} {state} at {where} and the hub is offline (HF_HUB_OFFLINE=1)"
        )
    try:
        folder = _download(
            repo_id, revision, cache_dir, token, weights_format, patterns, tokenizer_only
        )
    except ModelLoadError:
        raise
    except Exception as e:  # network, HTTP, disk: one clear message, never the token
        raise _hub_error(e, repo_id, revision, token) from e
    fmt, problem = _check_snapshot(
        repo_id, revision, cache_dir, folder, weights_format, tokenizer_only
    )
    if problem is not None:
        raise ModelLoadError(f"downloaded {label} to {folder} but it is incomplete: {problem}")
    return folder, fmt


# What a PEFT LoRA adapter repo holds that the engine reads.
ADAPTER_PATTERNS = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]


def adapter_snapshot(repo_id: str, *, cache_dir: str | None, token: str | None) -> str:
    """The snapshot folder of LoRA adapter repo `repo_id` (main), from the cache when it holds
    adapter_config.json and weights, else downloaded unless the hub is offline."""

    def complete(folder: str | None) -> bool:
        if folder is None or not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            return False
        return any(os.path.isfile(os.path.join(folder, f)) for f in ADAPTER_PATTERNS[1:])

    try:
        folder: str | None = snapshot_download(
            repo_id, cache_dir=cache_dir, local_files_only=True, allow_patterns=ADAPTER_PATTERNS
        )
    except LocalEntryNotFoundError:
        folder = None
    except HFValidationError as e:
        raise _hub_error(e, repo_id, "main", token) from e
    if complete(folder):
        return folder
    if hub_offline():
        where = folder or storage_folder(repo_id, cache_dir)
        raise ModelLoadError(
            f"adapter repo {repo_id} is not in the cache at {where} and the hub is offline "
            "(HF_HUB_OFFLINE=1)"
        )
    try:
        logger.info("downloading adapter %s from the hub", repo_id)
        folder = snapshot_download(
            repo_id,
            cache_dir=cache_dir,
            token=token,
            allow_patterns=ADAPTER_PATTERNS,
            etag_timeout=_metadata_timeout(),
        )
    except Exception as e:  # noqa: BLE001 - every hub failure becomes a load error naming it
        raise _hub_error(e, repo_id, "main", token) from e
    if not complete(folder):
        raise ModelLoadError(f"adapter repo {repo_id} has no adapter_config.json and weights")
    return folder
