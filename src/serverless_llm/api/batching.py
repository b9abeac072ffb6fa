"""Stream batches that grow geometrically: 1, 3, 9, 27, 50, 50, ... tokens with the defaults.

A client sees its first token at once, and later batches grow so a long answer costs few
messages. Dynamic growth applies when growth > 1, min >= 1 and max > min; otherwise every batch
holds `max` tokens. Whatever is left when the stream ends is sent as a last, smaller batch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# A job may set the knobs to any positive integer. Sizes past this are never reached (no stream
# carries that many tokens) and would overflow the float the growth is computed in.
_MAX_SIZE = 2**53


@dataclass(frozen=True)
class BatchSizes:
    max_batch_size: int = 50
    min_batch_size: int = 1
    growth_factor: float = 3.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.min_batch_size < 1:
            raise ValueError(f"min_batch_size must be >= 1, got {self.min_batch_size}")
        if self.growth_factor <= 0:
            raise ValueError(f"batch_size_growth_factor must be > 0, got {self.growth_factor}")

    @property
    def dynamic(self) -> bool:
        return (
            self.growth_factor > 1
            and self.min_batch_size >= 1
            and self.max_batch_size > self.min_batch_size
        )

    def sizes(self) -> Iterator[int]:
        if not self.dynamic:
            while True:
                yield self.max_batch_size
        top = float(min(self.max_batch_size, _MAX_SIZE))
        current = float(min(self.min_batch_size, _MAX_SIZE))
        while True:
            yield int(current)
            current = min(current * self.growth_factor, top)


async def batch_stream(
    source: AsyncIterator[T], sizes: BatchSizes, weight: Callable[[T], int] = lambda _: 1
) -> AsyncIterator[list[T]]:
    """Groups items of `source` into lists whose total weight (tokens) reaches the next size.

    An item is never split: an item that carries several tokens may overshoot the size.
    """
    targets = sizes.sizes()
    target = next(targets)
    pending: list[T] = []
    count = 0
    async for item in source:
        pending.append(item)
        count += weight(item)
        if count >= target:
            yield pending
            pending, count = [], 0
            target = next(targets)
    if pending:
        yield pending
