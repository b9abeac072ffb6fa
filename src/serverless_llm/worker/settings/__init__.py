"""Every environment variable the worker reads, validated once at start-up.

The deployed worker is configured only by env vars (the RunPod console writes them), so this
package is the worker's whole configuration surface. Its modules, each importing only those
above it:

- `fields`: the declared settings (`SettingsFields`), each with its env name, aliases, title,
  description, type, default and console category, and what one field accepts in words;
- `limits`: the settings the engine cannot honour yet, in one table (`LIMITS`);
- `engine_config`: the engine's `EngineConfig` from the settings, and the download directory;
- `validation`: one-line errors (`SettingsError`) and the checks across settings;
- `loader`: `Settings`, read from the environment and checked, with its derived values;
- `docs`: the settings as data (`settings_metadata()`, which worker/console_form.py turns into
  worker-config.json) and as docs/settings.md (`settings_markdown()`);
- `__main__`: `python -m serverless_llm.worker.settings [--markdown]`.

A bad value stops start-up with one line naming the variable, the value and what is allowed.
A setting the engine cannot honour yet is never dropped silently: `Settings.limitations()` lists
it, as a warning when the worker still serves the same outputs without it (a performance or
memory knob) and as an error when it would change what is served.
"""

from .docs import settings_markdown, settings_metadata
from .fields import (
    CATEGORIES,
    DEFAULT_BASE_PATH,
    EMBEDDED_MODEL_NAME,
    ENV_TO_FIELD,
    LLM,
    OPENAI,
    SERVERLESS,
    STREAMING,
    SYSTEM,
    TOKENIZER,
    allowed_values,
)
from .limits import Limitation
from .loader import Settings, load_settings_or_exit
from .validation import SettingsError

__all__ = [
    "CATEGORIES",
    "DEFAULT_BASE_PATH",
    "EMBEDDED_MODEL_NAME",
    "ENV_TO_FIELD",
    "LLM",
    "OPENAI",
    "SERVERLESS",
    "STREAMING",
    "SYSTEM",
    "TOKENIZER",
    "Limitation",
    "Settings",
    "SettingsError",
    "allowed_values",
    "load_settings_or_exit",
    "settings_markdown",
    "settings_metadata",
]
