"""A model baked into the image at build time: the file the builder writes and the worker reads.

`builder/download_model.py` resolves the model with the engine's own loader into the HF cache
under BASE_PATH, then records where it landed in `BAKED_MODEL_FILE`. At start the worker reads
that file before its settings: the local model and tokenizer directories stand in for MODEL_NAME
and TOKENIZER_NAME, the repo id stays the served model name, and the hub is switched off
(HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1) so that a hub outage cannot stop a baked worker.

The environment still wins: a MODEL_NAME naming another model leaves the baked one unused (and
the hub on). A baked directory that is missing at start (a network volume mounted over the
BASE_PATH the model was baked into) is reported and the hub stays on, so the worker can still
fetch the model instead of failing offline.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass, fields

logger = logging.getLogger(__name__)

BAKED_MODEL_ENV = "SERVERLESS_LLM_BAKED_MODEL"
DEFAULT_BAKED_MODEL_FILE = "/etc/serverless-llm/baked-model.json"
FORMAT_VERSION = 1
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class BakedModelError(RuntimeError):
    """The baked-model file exists but cannot be read; the message names the file."""


@dataclass
class BakedModel:
    model_name: str  # what MODEL_NAME was at build time (a hub id): the served model name
    model_revision: str | None
    tokenizer_name: str | None
    tokenizer_revision: str | None
    base_path: str
    model_dir: str  # the resolved snapshot: config, tokenizer and weights
    tokenizer_dir: str
    load_format: str
    # LORA_MODULES at build time (their hub repos are in the cache too); the worker serves them
    # when the endpoint sets no LORA_MODULES of its own.
    lora_modules: str | None = None


def baked_model_file(environ: MutableMapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(BAKED_MODEL_ENV) or DEFAULT_BAKED_MODEL_FILE


def write_baked_model(baked: BakedModel, path: str) -> None:
    """Writes the file atomically (a crashed build never leaves half a file)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format_version": FORMAT_VERSION, **asdict(baked)}, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_baked_model(path: str) -> BakedModel | None:
    """The baked model, or None when the image has none (no file)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BakedModelError(f"cannot read the baked-model file {path}: {e}") from e
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        raise BakedModelError(
            f"{path} is not a baked-model file of format {FORMAT_VERSION}: rebuild the image"
        )
    try:
        return BakedModel(
            **{f.name: raw[f.name] for f in fields(BakedModel) if f.name != "lora_modules"},
            lora_modules=raw.get("lora_modules"),
        )
    except KeyError as e:
        raise BakedModelError(f"{path} lacks the field {e.args[0]}: rebuild the image") from e


def apply_baked_model(
    environ: MutableMapping[str, str] | None = None, path: str | None = None
) -> BakedModel | None:
    """Points the settings at the baked model and switches the hub off; None when there is no
    baked model or it is not used. Call before reading the settings. Only `environ` (default
    os.environ) is changed, plus huggingface_hub's offline flag when `environ` is os.environ
    (that library reads the variable once, at import)."""
    env = os.environ if environ is None else environ
    path = path or baked_model_file(env)
    baked = read_baked_model(path)
    if baked is None:
        return None
    wanted = env.get("MODEL_NAME") or None
    wanted_revision = env.get("MODEL_REVISION") or None
    if (wanted is not None and wanted not in (baked.model_name, baked.model_dir)) or (
        wanted_revision is not None
        and wanted_revision != (baked.model_revision or "main")
        and wanted != baked.model_dir
    ):
        logger.warning(
            "MODEL_NAME=%s MODEL_REVISION=%s differ from the model baked into the image (%s@%s): "
            "the baked model is not used",
            wanted or baked.model_name,
            wanted_revision or "main",
            baked.model_name,
            baked.model_revision or "main",
        )
        if wanted is None:  # another revision of the baked repo: from the hub cache
            env["MODEL_NAME"] = baked.model_name
        return None
    missing = [d for d in {baked.model_dir, baked.tokenizer_dir} if not os.path.isdir(d)]
    if missing:
        logger.warning(
            "the model baked into the image is not at %s (a network volume mounted over "
            "BASE_PATH=%s hides it?); serving MODEL_NAME=%s from the hub cache instead",
            ", ".join(sorted(missing)),
            baked.base_path,
            baked.model_name,
        )
        for key, value in (
            ("MODEL_NAME", baked.model_name),
            ("MODEL_REVISION", baked.model_revision),
            ("TOKENIZER_NAME", baked.tokenizer_name),
            ("TOKENIZER_REVISION", baked.tokenizer_revision),
        ):
            if value and not env.get(key):
                env[key] = value
        return None
    env["MODEL_NAME"] = baked.model_dir
    env.pop("MODEL_REVISION", None)  # a local directory has no revision
    offline = True
    if baked.tokenizer_dir != baked.model_dir:
        wanted_tokenizer = env.get("TOKENIZER_NAME") or None
        if wanted_tokenizer in (None, baked.tokenizer_name, baked.tokenizer_dir):
            env["TOKENIZER_NAME"] = baked.tokenizer_dir
            env.pop("TOKENIZER_REVISION", None)
        else:
            offline = False  # another tokenizer was asked for: it may need the hub
    if not (env.get("OPENAI_SERVED_MODEL_NAME_OVERRIDE") or env.get("SERVED_MODEL_NAME")):
        env["OPENAI_SERVED_MODEL_NAME_OVERRIDE"] = baked.model_name
    if baked.lora_modules and not env.get("LORA_MODULES"):
        env["LORA_MODULES"] = baked.lora_modules
        env.setdefault("ENABLE_LORA", "true")
    if not offline:
        logger.info("baked model %s at %s; the hub stays on", baked.model_name, baked.model_dir)
        return baked
    for key in _OFFLINE_VARS:
        env[key] = "1"
    if env is os.environ:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True
    logger.info(
        "baked model %s at %s; the hub is off (HF_HUB_OFFLINE=1)", baked.model_name, baked.model_dir
    )
    return baked
