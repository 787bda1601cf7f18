"""Which part of the flattened parameter vector each partition owns.

A vector of ``size`` elements is cut into ``partition_num`` contiguous slices. With
``q, r = divmod(size, partition_num)``, slice ``i`` starts at ``i*q + min(i, r)`` and holds
``q + (i < r)`` elements: the first ``r`` slices are one element longer. Sizes smaller
than the number of partitions leave the last slices empty. This module is the only place
that does this arithmetic; everything else asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from allreduce_param.errors import ConfigurationError


@dataclass(frozen=True)
class SliceLayout:
    """The slices of a ``size``-element vector over ``partition_num`` partitions."""

    size: int
    partition_num: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ConfigurationError(
                f"size must be a positive whole number of elements, got {self.size!r}"
            )
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

    def owners(self, start: int, stop: int) -> range:
        """The partitions whose slices hold some element of ``start:stop`` (within the
        vector), in order; none for an empty range."""
        if not 0 <= start <= stop <= self.size:
            raise ConfigurationError(
                f"elements {start}:{stop} are outside the vector of {self.size}"
            )
        if start == stop:
            return range(0)
        return range(self._owner(start), self._owner(stop - 1) + 1)

    def _owner(self, index: int) -> int:
        """The partition whose slice holds element ``index``: the first ``remainder`` slices
        hold ``quotient + 1`` elements, the others ``quotient``."""
        quotient, remainder = divmod(self.size, self.partition_num)
        long_part = remainder * (quotient + 1)
        if index < long_part:
            return index // (quotient + 1)
        return remainder + (index - long_part) // quotient

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


class TensorLayout:
    """Several named tensors flattened, in order, into one vector.

    The engine moves one flat vector; a model thinks in tensors (a weight matrix, a bias).
    A ``TensorLayout`` maps between the two without copying: ``views(flat)`` gives, for each
    name, a reshaped view into ``flat``, so that reading weights or writing gradients through
    the views reads or writes the flat vector itself.

    >>> layout = TensorLayout([("w1", (64, 128)), ("b1", (128,))])
    >>> layout.size, layout.offset("b1"), layout.shape("w1")
    (8320, 8192, (64, 128))

    Tensors lie back to back in the given order, each in C order. A layout holds only names
    and shapes, so it pickles small and is safe to share between threads.
    """

    __slots__ = ("_shapes", "_offsets", "_lengths", "_size")

    def __init__(self, tensors: list[tuple[str, tuple[int, ...]]]) -> None:
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._offsets: dict[str, int] = {}
        self._lengths: dict[str, int] = {}
        offset = 0
        for entry in tensors:
            try:
                name, shape = entry
            except (TypeError, ValueError):
                raise ConfigurationError(
                    f"a tensor is a (name, shape) pair, got {entry!r}"
                ) from None
            if not isinstance(name, str) or not name:
                raise ConfigurationError(f"a tensor name must be a non-empty string, got {name!r}")
            if name in self._shapes:
                raise ConfigurationError(f"tensor name {name!r} appears twice")
            shape = tuple(shape)
            length = 1
            for dim in shape:
                if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
                    raise ConfigurationError(
                        f"tensor {name!r}: dimensions must be whole numbers >= 0, got {shape!r}"
                    )
                length *= dim
            self._shapes[name] = shape
            self._offsets[name] = offset
            self._lengths[name] = length
            offset += length
        self._size = offset

    @property
    def size(self) -> int:
        """The total number of elements: the length of the flat vector."""
        return self._size

    @property
    def names(self) -> tuple[str, ...]:
        """The tensor names, in their order in the flat vector."""
        return tuple(self._shapes)

    def offset(self, name: str) -> int:
        """The index in the flat vector of the first element of tensor ``name``."""
        self._require(name)
        return self._offsets[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``."""
        self._require(name)
        return self._shapes[name]

    def views(self, flat) -> dict:
        """``name -> view`` into ``flat``, each reshaped to its tensor's shape; no copies.

        ``flat`` must be a contiguous 1-D array of exactly ``size`` elements (any dtype), so
        that every reshape is a view: a write through a view lands in ``flat``.
        """
        shape = getattr(flat, "shape", None)
        if shape != (self._size,) or not flat.flags.c_contiguous:
            from allreduce_param.errors import InputError

            raise InputError(
                f"TensorLayout.views needs a contiguous 1-D array of {self._size} elements, "
                f"got {type(flat).__name__} of shape {shape}"
            )
        return {
            name: flat[self._offsets[name] : self._offsets[name] + self._lengths[name]].reshape(
                shape
            )
            for name, shape in self._shapes.items()
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorLayout):
            return NotImplemented
        return list(self._shapes.items()) == list(other._shapes.items())

    def __hash__(self) -> int:
        return hash(tuple(self._shapes.items()))

    def __repr__(self) -> str:
        inner = ", ".join(f"({name!r}, {shape!r})" for name, shape in self._shapes.items())
        return f"TensorLayout([{inner}])"

    def __reduce__(self):
        return (TensorLayout, (list(self._shapes.items()),))

    def _require(self, name: str) -> None:
        if name not in self._shapes:
            raise KeyError(f"no tensor named {name!r}; the layout has {list(self._shapes)}")


class HostLayout:
    """Which partitions share a host, and in what order everything is summed.

    ``scopes[i]`` is where partition ``i`` lives (its machine and network namespace, the
    ``local_scope`` its peers can reach it in over shared memory), or None when it shares
    nothing with anyone. A *host* is the partitions of one scope, in partition order; its
    *leader* is its first partition; hosts are in the order of their leaders.

    The sum of one value over all partitions is, in fp32: on each host, its partitions'
    values added in partition order (the host sum); then the host sums added in host
    order. Flat and hierarchical sync both sum this way, so they give the same bits
    whatever the topology; on one host it is plain partition order.
    """

    def __init__(self, scopes: list) -> None:
        groups: dict = {}
        for partition, scope in enumerate(scopes):
            groups.setdefault(partition if scope is None else ("scope", scope), []).append(
                partition
            )
        self.hosts: tuple[tuple[int, ...], ...] = tuple(sorted(tuple(g) for g in groups.values()))
        self.partition_num = len(scopes)
        self._host_of = [0] * self.partition_num
        for index, members in enumerate(self.hosts):
            for partition in members:
                self._host_of[partition] = index

    def host(self, partition: int) -> tuple[int, ...]:
        """The partitions on ``partition``'s host, its own included, in partition order."""
        return self.hosts[self._host_of[partition]]

    def leader(self, partition: int) -> int:
        """The partition that exchanges for ``partition``'s host: its first."""
        return self.host(partition)[0]

    @property
    def leaders(self) -> tuple[int, ...]:
        """Every host's leader, in host order."""
        return tuple(members[0] for members in self.hosts)

    def grouped(self, partitions) -> list[tuple[int, ...]]:
        """``partitions`` (any of them) by host, in the summing order: hosts in host order,
        each its partitions in partition order; hosts none of them is on are left out."""
        wanted = set(partitions)
        groups = [tuple(p for p in members if p in wanted) for members in self.hosts]
        return [group for group in groups if group]

    @property
    def nested(self) -> bool:
        """Whether a hierarchy changes anything: several hosts, one of them with several
        partitions. Otherwise every partition is its host's leader, or there is one host."""
        return len(self.hosts) > 1 and any(len(members) > 1 for members in self.hosts)

    def mates(self, partition: int) -> tuple[int, ...]:
        """The other partitions on ``partition``'s host."""
        return tuple(p for p in self.host(partition) if p != partition)

    def other_leaders(self, partition: int) -> tuple[int, ...]:
        """The other hosts' leaders when ``partition`` leads its host; none otherwise."""
        if self.leader(partition) != partition:
            return ()
        return tuple(leader for leader in self.leaders if leader != partition)

    def neighbours(self, partition: int, hierarchical: bool) -> tuple[int, ...]:
        """The partitions ``partition`` exchanges blocks with: every other one when flat;
        hierarchical, its host's, and a leader also the other hosts' leaders."""
        if not hierarchical:
            return tuple(p for p in range(self.partition_num) if p != partition)
        return tuple(sorted(self.mates(partition) + self.other_leaders(partition)))

    def __repr__(self) -> str:
        return f"HostLayout({[list(members) for members in self.hosts]})"
