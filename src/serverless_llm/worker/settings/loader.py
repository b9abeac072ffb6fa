"""`Settings`: the declared fields read from the environment, checked, and what they give the
worker (the engine's configuration, stream batch sizes, limitations to report)."""

from __future__ import annotations

import logging
import os
import re
import sys

from pydantic import PrivateAttr, ValidationError

from ...api.batching import BatchSizes
from ...api.limits import RequestLimits
from ...api.media import MediaConfig, parse_limit_mm_per_prompt
from ...api.openai.response_store import MemoryResponseStore, RedisResponseStore, ResponseStore
from ...engine import LoRARequest
from ...engine.config import EngineConfig
from . import engine_config as _engine_config
from .engine_args import check_json_engine_args, ignored_engine_args, ignored_warning
from .fields import EMBEDDED_MODEL_NAME, ENV_TO_FIELD, SettingsFields, field_extra, shown_value
from .limits import Limitation, limitations
from .validation import SettingsError, check, format_validation_error

logger = logging.getLogger(__package__)


def served_name_of(model_name: str) -> str:
    """The id a model is served as: a hub repo id as it is; a local path (a directory or a GGUF
    file, which is how the loader reads any name that exists on disk) by its last component.
    A path's slashes break clients: the OpenAI Agents SDK reads what precedes a '/' as a
    provider prefix, and `/v1/models/{id}` would need the id URL-encoded."""
    expanded = os.path.expanduser(model_name)
    is_path = os.path.isabs(expanded) or model_name.startswith((".", "~"))
    if not (is_path or os.path.exists(expanded)):
        return model_name
    return os.path.basename(os.path.normpath(expanded)) or model_name


def split_names(text: str | None) -> list[str]:
    """A served-name setting as its names: separated by commas and/or whitespace (vLLM's
    `--served-model-name a b` written into one variable either way)."""
    return [n for n in re.split(r"[\s,]+", text or "") if n]


class Settings(SettingsFields):
    """The worker's configuration, read from the environment (`Settings.from_env()`)."""

    # vLLM engine arguments set in the environment that no setting honours, with why
    # (engine_args.py); logged in one warning line at start-up.
    _ignored_engine_args: list[tuple[str, str]] = PrivateAttr(default_factory=list)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """Reads and validates the environment (or `environ`), raising SettingsError on the
        first problem, as one line. Settings the engine cannot honour are checked too: an
        error-level limitation raises here; warnings are for `log_startup()`."""
        env = os.environ if environ is None else environ
        try:
            check_json_engine_args(env)
        except ValueError as e:
            raise SettingsError(str(e)) from None
        try:
            if environ is None:
                settings = cls()
            else:
                # Only the variables we know, so a dict behaves exactly like the environment.
                settings = cls.model_validate(
                    {
                        k.upper(): v
                        for k, v in environ.items()
                        if k.upper() in ENV_TO_FIELD and v != ""
                    }
                )
        except ValidationError as e:
            raise SettingsError(format_validation_error(e, env)) from None
        check(settings)
        settings._ignored_engine_args = ignored_engine_args(env)
        return settings

    # -- derived values ---------------------------------------------------------------------

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names `/v1/models` lists, the main one first: OPENAI_SERVED_MODEL_NAME_OVERRIDE's
        and SERVED_MODEL_NAME's names, or else the one MODEL_NAME gives."""
        names = split_names(self.openai_served_model_name_override)
        names += split_names(self.served_names)
        if not names:
            names = [served_name_of(self.model_name) if self.model_name else EMBEDDED_MODEL_NAME]
        return tuple(dict.fromkeys(names))

    @property
    def served_model_name(self) -> str:
        """The name OpenAI clients send as `model` and `/v1/models` lists first."""
        return self.served_model_names[0]

    @property
    def model_name_aliases(self) -> tuple[str, ...]:
        """Names requests may also use that `/v1/models` does not list: MODEL_NAME as written
        (vLLM answers to a path as given) and the name it is served by when no served name is
        set (its last component), so a client configured either way is served."""
        if not self.model_name:
            return ()
        listed = set(self.served_model_names)
        names = (self.model_name, served_name_of(self.model_name))
        return tuple(n for n in dict.fromkeys(names) if n not in listed)

    @property
    def request_limits(self) -> RequestLimits:
        """What one request may ask for (the Request Limits settings the API routes check)."""
        return RequestLimits(
            max_prompt_chars=self.max_prompt_chars,
            max_messages=self.max_messages,
            max_stop_strings=self.max_stop_strings,
            max_logit_bias=self.max_logit_bias,
            max_tools=self.max_tools,
            max_n=self.max_n,
            max_prompts=self.max_prompts,
        )

    def response_store(self) -> ResponseStore:
        """Where /v1/responses keeps responses: Redis with RESPONSES_STORE_URL, else memory."""
        if self.responses_store_url is not None:
            return RedisResponseStore(
                self.responses_store_url.get_secret_value(), self.responses_store_ttl_seconds
            )
        return MemoryResponseStore(self.responses_store_max_count, self.responses_store_max_bytes)

    @property
    def media_config(self) -> MediaConfig:
        """How request images are loaded and bounded (the Multimodal settings)."""
        return MediaConfig(
            max_image_bytes=self.max_image_bytes,
            media_fetch_timeout=self.media_fetch_timeout,
            allow_private_image_urls=self.allow_private_image_urls,
            allowed_local_media_path=self.allowed_local_media_path,
            limit_mm_per_prompt=parse_limit_mm_per_prompt(self.limit_mm_per_prompt),
        )

    @property
    def batch_sizes(self) -> BatchSizes:
        """The stream batch sizes of a job that sets none of its own."""
        return BatchSizes(
            max_batch_size=self.default_batch_size,
            min_batch_size=self.default_min_batch_size,
            growth_factor=self.default_batch_size_growth_factor,
        )

    @property
    def download_dir(self) -> str | None:
        """Where models are downloaded (see `engine_config.download_dir`)."""
        return _engine_config.download_dir(self.base_path)

    def lora_requests(self) -> list[LoRARequest]:
        """The adapters LORA_MODULES names (ids 1, 2, ... in order)."""
        return _engine_config.lora_requests(self)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration from these settings. Raises ConfigError when the engine
        refuses a combination."""
        return _engine_config.engine_config(self)

    # -- reporting --------------------------------------------------------------------------

    def limitations(self) -> list[Limitation]:
        """Settings whose values the engine cannot honour yet, with what happens instead."""
        return limitations(self)

    def ignored_engine_args_warning(self) -> str | None:
        """One line naming the vLLM engine arguments set but ignored, and why; None if none."""
        return ignored_warning(self._ignored_engine_args)

    def non_default(self) -> dict[str, str]:
        """Env name -> shown value of every setting that differs from its default; secrets are
        shown as `***`."""
        out: dict[str, str] = {}
        for name, field in type(self).model_fields.items():
            if getattr(self, name) != field.default:
                env = field_extra(field)["env"]
                out[env] = shown_value(self, env)
        return out

    def log_startup(self, log: logging.Logger = logger) -> None:
        """Logs the effective settings (secrets masked) and every limitation."""
        shown = ", ".join(f"{k}={v}" for k, v in self.non_default().items())
        log.info("settings: %s", shown or "all defaults")
        for lim in self.limitations():
            log.warning("%s", lim.message)
        ignored = self.ignored_engine_args_warning()
        if ignored:
            log.warning("%s", ignored)


def load_settings_or_exit() -> Settings:
    """For entry points: the settings, or one line on stderr and exit status 2."""
    try:
        return Settings.from_env()
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
