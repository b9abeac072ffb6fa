"""/v1/models and /v1/models/{id}: the names this worker answers to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import model_not_found
from .protocol import ModelCard, ModelList

# A served LoRA adapter's card: (name, root: its path or repo, parent: the base model's name).
AdapterCard = tuple[str, str, str]


def _cards(
    names: tuple[str, ...], created: int, max_model_len: int | None, adapters: Sequence[AdapterCard]
) -> list[ModelCard]:
    cards = [ModelCard(id=n, created=created, max_model_len=max_model_len) for n in names]
    cards += [
        ModelCard(id=name, created=created, root=root, parent=parent, max_model_len=max_model_len)
        for name, root, parent in adapters
    ]
    return cards


def list_models(
    names: tuple[str, ...],
    created: int,
    max_model_len: int | None,
    adapters: Sequence[AdapterCard] = (),
) -> dict[str, Any]:
    """The served name first, then its aliases (clients often take `data[0].id`), then the LoRA
    adapters with the base model as their parent."""
    return ModelList(data=_cards(names, created, max_model_len, adapters)).model_dump(
        exclude_none=True
    )


def retrieve_model(
    name: str,
    names: tuple[str, ...],
    created: int,
    max_model_len: int | None,
    adapters: Sequence[AdapterCard] = (),
) -> dict[str, Any]:
    for card in _cards(names, created, max_model_len, adapters):
        if card.id == name:
            return card.model_dump(exclude_none=True)
    return model_not_found(name)
