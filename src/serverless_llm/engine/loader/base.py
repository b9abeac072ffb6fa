"""Types shared by the loader's submodules: the error it raises and what resolution produces."""

from __future__ import annotations

from dataclasses import dataclass


class ModelLoadError(RuntimeError):
    """The model cannot be found, downloaded, converted or read; the message says which and why."""


@dataclass
class ResolvedModel:
    """A model on local disk, ready to load: everything after this point is offline."""

    model_dir: str  # holds config.json (+ weights unless dummy)
    tokenizer_dir: str  # what transformers.AutoTokenizer.from_pretrained loads from
    # "safetensors" | "pt" | "dummy"; "gguf": weights read from gguf_path itself (served from
    # its blocks on CPU), else a GGUF file arrives here converted, as safetensors
    load_format: str
    source: str  # what the user asked for, for logs; never contains a token
    gguf_path: str | None = None  # the .gguf file model_dir was converted from, if any


def scrub(text: str, token: str | None) -> str:
    """Removes a secret from a message: hub errors echo URLs and headers we do not control."""
    if token:
        text = text.replace(token, "***")
    return text
