"""The text part of a multimodal checkpoint: a `...ForConditionalGeneration` model (vision or
audio towers feeding a text decoder) is served for text, as its decoder alone, until the engine
serves images.

transformers keeps such a model's decoder settings in the composite config's `text_config`,
beside the other towers' (`vision_config`, ...). `text_part` gives that text config standing for
the whole model, so every reader of the model config (the family description, the context
length, the vocabulary size, the EOS ids) reads the decoder's settings: it keeps the checkpoint's
`architectures` (a family registers the composite architecture whose text part it serves) and
takes the composite's own settings where they rule (tied embeddings: transformers ties by the
composite config) or where the text config lacks them (quantization, dtype, EOS id).

`text_weights` renames the decoder's tensors to a causal LM's names and skips the other towers':
transformers 5 checkpoints hold the decoder under `model.language_model.` beside `model.visual.`
(or another tower) and `lm_head`; older Llava-style ones under `language_model.model.` and
`language_model.lm_head`, beside `vision_tower.` and `multi_modal_projector.`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

# (prefix of the decoder's tensors in a composite checkpoint, its causal LM name)
TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),  # Idefics3, SmolVLM
    # Qwen2-VL, Qwen2.5-VL: a causal LM's own names beside `visual.` (transformers saves them so)
    ("model.layers.", "model.layers."),
    ("model.embed_tokens.", "model.embed_tokens."),
    ("model.norm.", "model.norm."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)

# settings of the composite config that the text part takes when it lacks them
_INHERITED = ("quantization_config", "dtype", "torch_dtype", "eos_token_id")


def is_composite(config) -> bool:
    """Whether `config` is a composite (multimodal) config with a text decoder's sub-config."""
    text = getattr(config, "text_config", None)
    return text is not None and text is not config and hasattr(text, "to_dict")


def text_part(config):
    """The config the engine serves: for a composite config, a copy of its text config with the
    composite's `architectures` and `tie_word_embeddings`, the settings of `_INHERITED` it lacks,
    and `text_part_of` naming the composite architecture; any other config unchanged."""
    if not is_composite(config):
        return config
    text = copy.deepcopy(config.text_config)
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    text.architectures = list(getattr(config, "architectures", None) or [arch])
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is not None:
        text.tie_word_embeddings = tied
    for key in _INHERITED:
        value = getattr(config, key, None)
        if value is not None and getattr(text, key, None) is None:
            setattr(text, key, value)
    text.text_part_of = arch
    towers = [k for k, v in vars(config).items() if k.endswith("_config") and hasattr(v, "to_dict")]
    towers = [k.removesuffix("_config") for k in towers if k != "text_config"]
    from ..multimodal import vision_family_of

    if vision_family_of([arch]) is None:
        logger.info(
            "%s: serving its text decoder only; images and other non-text inputs are not "
            "served yet (the weights of its %s are not loaded)",
            arch,
            " and ".join(f"{t} tower" for t in towers) or "other towers",
        )
    return text


def text_weights(
    weights: Iterable[tuple[str, object]],
    other: Callable[[str, object], None] | None = None,
) -> Iterator[tuple[str, object]]:
    """The decoder's tensors of a composite checkpoint under a causal LM's names (`model.X`,
    `lm_head.X`); the other towers' tensors go to `other` (name, tensor) when given (a lazy
    tensor is valid only during the call), else are skipped."""
    skipped = 0
    for name, tensor in weights:
        for prefix, renamed in TEXT_PREFIXES:
            if name.startswith(prefix):
                yield renamed + name[len(prefix) :], tensor
                break
        else:
            skipped += 1
            if other is not None:
                other(name, tensor)
    logger.debug("skipped %d tensors outside the text decoder", skipped)
