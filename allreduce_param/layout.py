"""Which part of the flattened parameter vector each partition owns.

A vector of ``size`` elements is cut into ``partition_num`` contiguous slices. With
``q, r = divmod(size, partition_num)``, slice ``i`` starts at ``i*q + min(i, r)`` and holds
``q + (i < r)`` elements: the first ``r`` slices are one element longer. Sizes smaller
than the number of partitions leave the last slices empty. This module is the only place
that does this arithmetic; everything else asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigurationError


@dataclass(frozen=True)
class SliceLayout:
    """The slices of a ``size``-element vector over ``partition_num`` partitions."""

    size: int
    partition_num: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ConfigurationError(f"size must be a positive whole number of elements, got {self.size!r}")
        if not isinstance(self.partition_num, int) or self.partition_num < 1:
            raise ConfigurationError(
                f"partition_num must be a positive whole number, got {self.partition_num!r}"
            )

    def start(self, partition_id: int) -> int:
        """The index of the first element that ``partition_id`` owns."""
        quotient, remainder = divmod(self.size, self.partition_num)
        self._check(partition_id)
        return partition_id * quotient + min(partition_id, remainder)

    def length(self, partition_id: int) -> int:
        """How many elements ``partition_id`` owns (0 when size < partition_num)."""
        quotient, remainder = divmod(self.size, self.partition_num)
        self._check(partition_id)
        return quotient + (1 if partition_id < remainder else 0)

    def bounds(self, partition_id: int) -> slice:
        """The owned part as a ``slice``, ready to index the full vector."""
        start = self.start(partition_id)
        return slice(start, start + self.length(partition_id))

    @property
    def max_length(self) -> int:
        """The longest slice: what a buffer must hold to take any partition's slice."""
        return self.length(0)

    def _check(self, partition_id: int) -> None:
        if not 0 <= partition_id < self.partition_num:
            raise ConfigurationError(
                f"partition {partition_id} is outside 0..{self.partition_num - 1}"
            )


def split(length: int, part_length: int) -> list[tuple[int, int]]:
    """Cut ``length`` elements into consecutive parts of at most ``part_length``.

    Returns ``(start, length)`` pairs, always at least one (an empty slice is one empty
    part, so that a block, with its sample count, still travels for it).
    """
    if part_length < 1:
        raise ConfigurationError(f"part_length must be at least 1, got {part_length}")
    if length == 0:
        return [(0, 0)]
    return [(start, min(part_length, length - start)) for start in range(0, length, part_length)]
