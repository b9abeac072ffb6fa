"""/v1/models and /v1/models/{id}: the names this worker answers to."""

from __future__ import annotations

from typing import Any

from .errors import model_not_found
from .protocol import ModelCard, ModelList


def model_card(name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    return ModelCard(id=name, created=created, max_model_len=max_model_len).model_dump(
        exclude_none=True
    )


def list_models(names: tuple[str, ...], created: int, max_model_len: int | None) -> dict[str, Any]:
    """The served name first, then its aliases (clients often take `data[0].id`)."""
    cards = [ModelCard(id=n, created=created, max_model_len=max_model_len) for n in names]
    return ModelList(data=cards).model_dump(exclude_none=True)


def retrieve_model(
    name: str, names: tuple[str, ...], created: int, max_model_len: int | None
) -> dict[str, Any]:
    if name not in names:
        return model_not_found(name)
    return model_card(name, created, max_model_len)
