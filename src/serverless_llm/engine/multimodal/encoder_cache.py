"""Image features between steps: the vision tower runs once per image, in the step whose
tokens first need its features, and what it gives stays here until the image's last token is
computed, so a prefill chunked through an image never encodes it twice. Bounded in bytes; the
least recently used entries go first, and an entry a running request still needs is only
dropped when the cache would otherwise overflow (then it is encoded again, never wrong)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from .base import ImageFeatures


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._entries: OrderedDict[bytes, ImageFeatures] = OrderedDict()
        self.encoded = 0  # images encoded (for tests and stats)
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> ImageFeatures | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return found

    def put(
        self, key: bytes, features: ImageFeatures, keep: Container[bytes] = frozenset()
    ) -> None:
        """Adds an image's features, evicting the least recently used entries not in `keep`
        (the step's own images) while over capacity. An entry larger than the whole cache is
        kept until the next put (the step that made it uses it)."""
        self.encoded += 1
        if key in self._entries:
            return
        self._entries[key] = features
        self.used += features.nbytes()
        for old in list(self._entries):
            if self.used <= self.capacity:
                break
            if old == key or old in keep:
                continue
            self.used -= self._entries.pop(old).nbytes()

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0
