"""Build-time model download: `docker build --build-arg MODEL_NAME=...` runs this once.

It resolves the model with the worker's own loader (`serverless_llm.engine.loader.resolve_model`:
the HF cache first, then only the files the engine reads, with timeouts and errors that never
show the token) into `<BASE_PATH>/huggingface-cache/hub`, the directory the worker reads at run
time, checks that the engine can load what it got (config, architecture, tokenizer; for a
vision-language model it builds the image processor from the baked files as the worker does at
start, and warns when it cannot: the worker then serves the model for text only), and writes
the baked-model file (`serverless_llm.worker.baked`) the worker reads at start to switch the hub
off.

Configured like the worker, by environment variables (the Dockerfile's build args): MODEL_NAME
(required), MODEL_REVISION, TOKENIZER_NAME, TOKENIZER_REVISION, BASE_PATH, QUANTIZATION,
LOAD_FORMAT, TRUST_REMOTE_CODE, and LORA_MODULES with ENABLE_LORA (each adapter given as a hub
repo is downloaded into the same cache and the list is recorded, so the worker serves them
offline unless the endpoint sets its own LORA_MODULES). The Hugging Face token is read from the BuildKit secret file
(`RUN --mount=type=secret,id=HF_TOKEN` puts it at /run/secrets/HF_TOKEN), else from HF_TOKEN; it
is handed to the loader and nowhere else, and never printed.

Exit status: 0 done; 1 the model cannot be fetched or loaded; 2 a bad setting. Every failure is
one line on stderr starting with `error:`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

DEFAULT_TOKEN_FILE = "/run/secrets/HF_TOKEN"


def read_token(token_file: str, environ: dict[str, str]) -> str | None:
    """The secret file's content when it has one, else HF_TOKEN, else None."""
    try:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError:  # no secret given (required=false): the file is absent
        token = ""
    return token or (environ.get("HF_TOKEN") or "").strip() or None


def fail(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


def image_processor(model_dir: str, hf_config, trust_remote_code: bool) -> str:
    """For a vision-language model, builds its processor from the baked files as the engine
    does at start and returns ", images: <processor class>", or ", text only" after a warning
    on stderr when it cannot (as the worker, which then refuses image prompts); "" for any
    other model."""
    from serverless_llm.engine.multimodal import vision_family_of

    family = vision_family_of(getattr(hf_config, "architectures", None))
    if family is None:
        return ""
    import transformers

    try:
        composite = transformers.AutoConfig.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code, local_files_only=True
        )
        processor = family.make_processor(model_dir, composite)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(
            f"warning: cannot build the image processor from {model_dir} "
            f"({type(e).__name__}: {first}): the worker will serve the model for text only",
            file=sys.stderr,
            flush=True,
        )
        return ", text only"
    return f", images: {type(processor).__name__}"


def main(argv: list[str] | None = None) -> int:
    from serverless_llm.worker.baked import BakedModel, baked_model_file, write_baked_model

    ap = argparse.ArgumentParser(
        prog="builder/download_model.py",
        description="Download MODEL_NAME (and its tokenizer) into <BASE_PATH>/huggingface-cache"
        "/hub and record it for the worker.",
    )
    ap.add_argument(
        "--output",
        default=None,
        help="the baked-model file to write (default: $SERVERLESS_LLM_BAKED_MODEL, else "
        f"{baked_model_file({})})",
    )
    ap.add_argument("--token-file", default=DEFAULT_TOKEN_FILE, help="BuildKit secret file")
    ap.add_argument("--no-progress", action="store_true", help="no download progress bars")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from serverless_llm.engine.config import ConfigError
    from serverless_llm.engine.loader import ModelLoadError, load_hf_config, resolve_model
    from serverless_llm.engine.loader.hub import adapter_snapshot
    from serverless_llm.engine.models import describe_model
    from serverless_llm.engine.tokenizer import load_tokenizer
    from serverless_llm.worker.settings import Settings, SettingsError

    environ = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    token = read_token(args.token_file, dict(os.environ))
    if not environ.get("MODEL_NAME"):
        return fail("MODEL_NAME is not set: pass --build-arg MODEL_NAME=<hub repo id>", 2)
    try:
        settings = Settings.from_env({**environ, **({"HF_TOKEN": token} if token else {})})
    except SettingsError as e:
        return fail(str(e), 2)
    download_dir = settings.download_dir
    if download_dir is None:
        return fail(f"BASE_PATH={settings.base_path} cannot be created: set BASE_PATH", 2)
    cfg = settings.engine_config()
    cfg.show_progress = not args.no_progress
    output = args.output or baked_model_file()
    start = time.monotonic()
    try:
        resolved = resolve_model(cfg)
        # What the worker will do at start, so a model it cannot serve fails the build instead.
        hf_config = load_hf_config(resolved, trust_remote_code=cfg.trust_remote_code)
        describe_model(hf_config)
        load_tokenizer(resolved.tokenizer_dir, trust_remote_code=cfg.trust_remote_code)
        images = image_processor(resolved.model_dir, hf_config, cfg.trust_remote_code)
        for lora in settings.lora_requests():  # LORA_MODULES: hub adapters into the same cache
            if not os.path.isdir(lora.lora_path):
                adapter_snapshot(lora.lora_path, cache_dir=download_dir, token=token)
    except (ModelLoadError, ConfigError) as e:
        return fail(str(e), 1)
    except Exception as e:  # unsupported architecture, unreadable tokenizer
        message = f"{type(e).__name__}: {e}"
        return fail(message.replace(token, "***") if token else message, 1)
    baked = BakedModel(
        model_name=settings.model_name or "",
        model_revision=settings.model_revision,
        tokenizer_name=settings.tokenizer_name,
        tokenizer_revision=settings.tokenizer_revision,
        base_path=settings.base_path,
        model_dir=resolved.model_dir,
        tokenizer_dir=resolved.tokenizer_dir,
        load_format=resolved.load_format,
        lora_modules=settings.lora_modules,
    )
    try:
        write_baked_model(baked, output)
    except OSError as e:
        return fail(f"cannot write the baked-model file {output}: {e}", 1)
    print(
        f"baked {resolved.source} ({resolved.load_format}{images}) into {resolved.model_dir} "
        f"in {time.monotonic() - start:.1f} s; recorded in {output}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
