"""Summing fetched chunks in the one order, and the NaN/Inf check that names the culprit.

Every sum of the engine goes through ``sum_in_order``: on each host in partition order,
then the hosts' sums in host order (``layout.HostLayout``), in fp32, part by part as the
parts arrive, so that a lossless codec gives the same bits whichever way they travelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from allreduce_param.engine.layout import split
from allreduce_param.engine.movement.peers import PART_LENGTH
from allreduce_param.errors import NonFiniteGradientError

#: elements summed, checked and divided at a time, within a part: the piece being summed
#: (256 KiB) stays in a core's L2 cache through the adds, the NaN check and the divide, and
#: a scratch piece's copy to ``out``; a whole part (2 MiB) did not, and every pass after
#: the adds read it from memory again (2.2x slower at 10M, N = 2, measured)
SUM_PIECE = 1 << 16


class Divide:
    """Divides float32 values by ``divisor`` in place, with the bits of ``values /=
    np.float32(divisor)``: by a power of two as a multiplication by its reciprocal (exact,
    so every quotient rounds the same, subnormals included), which takes a third of a
    division's time; by any other number, as that division."""

    def __init__(self, divisor: float) -> None:
        self.divisor = np.float32(divisor)
        mantissa, exponent = math.frexp(float(self.divisor))
        # 2**e with a normal reciprocal: 1/divisor is exact in float32
        exact = mantissa == 0.5 and -125 <= exponent <= 127
        self.reciprocal = np.float32(1.0 / float(self.divisor)) if exact else None

    def __call__(self, values: np.ndarray) -> None:
        if self.reciprocal is not None:
            np.multiply(values, self.reciprocal, out=values)
        else:
            np.divide(values, self.divisor, out=values)


def _add_up(values: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``out`` = the ``values`` added in order, in fp32: the first two in one pass, not
    copied and then added."""
    if len(values) == 1:
        np.copyto(out, values[0])
    else:
        np.add(values[0], values[1], out=out)
        for more in values[2:]:
            out += more
    return out


class NonFiniteSum:
    """Finds what made a summed gradient part NaN/Inf, for a message that names it.

    ``version`` is the step; ``slice_start`` where the summed chunk begins in the full vector.
    """

    def __init__(self, version: int, slice_start: int) -> None:
        self.version = version
        self.slice_start = slice_start

    def check(
        self,
        target: np.ndarray,
        start: int,
        sources: list[str],
        parts: list[np.ndarray],
        positions: np.ndarray | None = None,
    ) -> None:
        """Raise ``NonFiniteGradientError`` if the summed part ``target`` (from ``start`` in the
        slice) holds NaN/Inf: naming the first source (``sources``: "partition 3") whose
        part does, or else saying the sum overflowed. ``positions``: where in the slice each
        value of ``target`` lies, for a sum of the touched elements alone (then ``start`` 0)."""
        if np.isfinite(target.sum()) or np.isfinite(target).all():  # one cheap pass in cache
            return

        def place(at: int) -> int:
            return self.slice_start + start + (at if positions is None else int(positions[at]))

        for source, values in zip(sources, parts):
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                index = place(int(bad[0]))
                raise NonFiniteGradientError(
                    f"the gradient of {source} for step {self.version} holds NaN/Inf "
                    f"(first at index {index}: {values[bad[0]]}); the model diverged or the "
                    "data holds NaN. Lower the learning rate or clean the data, or pass "
                    "AllReduceParameter(allow_nonfinite=True) to let them through"
                )
        index = place(int(np.flatnonzero(~np.isfinite(target))[0]))
        raise NonFiniteGradientError(
            f"the gradients of step {self.version} are finite but their sum overflows float32 "
            f"(first at index {index}); the model diverged: lower the learning rate, or clip the "
            "gradients (clip_norm), or pass AllReduceParameter(allow_nonfinite=True) to let it through"
        )


def sum_in_order(
    pending: dict[int, list[Future]],
    groups: list[tuple[int, ...]],
    out: np.ndarray,
    divisor: Callable[[float], float | None] | None = None,
    check: NonFiniteSum | None = None,
    names: list[str] | None = None,
    out_is_a_source: bool = False,
) -> float:
    """Sum the fetched chunks (``pending[source][part]``, as ``Fetcher.fetch_all`` gives them)
    into ``out``; their counts.

    ``groups``: the sources in the order summed: each group in its order, then the groups'
    sums in their order (a host's partitions each, or one host sum each).
    ``divisor(total)``, once the counts are known, gives what to divide the sum by (None:
    leave it a sum); ``check`` raises if a summed piece holds NaN/Inf, naming the first
    source (by ``names``, default its partition) whose piece does. Both act on each piece
    (``SUM_PIECE`` elements of a part) just after it is summed, while it is in cache.
    Every part is summed before anything is raised, so no fetch is left running.
    ``out_is_a_source``: ``out`` may be one source's chunk; each piece is then summed into
    a scratch piece and written to ``out`` once summed, checked and divided (the sources
    intact until then: the same bits, and the check names the right source).
    """
    order = [source for group in groups for source in group]
    piece = min(out.size, SUM_PIECE)
    scratch = np.empty(piece, np.float32) if out_is_a_source else None
    group_sum = np.empty(piece, np.float32) if any(len(g) > 1 for g in groups[1:]) else None
    names = names or [f"partition {source}" for source in order]
    total, scale, failure = 0.0, None, None
    for part, (start, length) in enumerate(split(out.size, PART_LENGTH)):
        parts = {source: pending[source][part].result() for source in order}
        if part == 0:
            total = sum(sum(parts[source][1] for source in group) for group in groups)
            value = None if divisor is None else divisor(total)
            scale = None if value is None else Divide(value)
        for begin in range(0, length, SUM_PIECE):
            end = min(length, begin + SUM_PIECE)
            at = start + begin
            target = out[at : start + end] if scratch is None else scratch[: end - begin]
            for index, group in enumerate(groups):
                values = [parts[source][2][begin:end] for source in group]
                if index == 0:
                    _add_up(values, target)
                elif len(values) == 1:
                    target += values[0]
                else:
                    target += _add_up(values, group_sum[: end - begin])
            if check is not None and failure is None:
                try:
                    sources = [parts[source][2][begin:end] for source in order]
                    check.check(target, at, names, sources)
                except NonFiniteGradientError as error:
                    failure = error
            if scale is not None:
                scale(target)
            if scratch is not None:
                out[at : start + end] = target
        for _, _, _, recheck in parts.values():
            if recheck is not None:
                recheck()
    if failure is not None:
        raise failure
    return total


def sum_touched_in_order(
    pairs: dict[int, tuple[np.ndarray, np.ndarray, float]],
    groups: list[tuple[int, ...]],
    out: np.ndarray,
    divisor: Callable[[float], float | None] | None = None,
    check: NonFiniteSum | None = None,
    names: list[str] | None = None,
) -> float:
    """``sum_in_order`` for sources that sent only their touched elements: ``pairs[source]``
    is ``(indices in the slice, increasing; their values; the count)``. Writes the sum into
    ``out`` (the whole slice: zeros where no source touched it); returns the counts' sum.

    The same bits as ``sum_in_order`` over the dense chunks (each +0.0 where its source
    did not touch it): the sum is taken over the union of the touched elements, each
    source's values spread over it with +0.0 in the gaps, with the same additions in the
    same order (``-0.0 + 0.0`` is +0.0 here as there); an element no source touched is a
    sum of +0.0s, +0.0, divided still +0.0.
    """
    order = [source for group in groups for source in group]
    names = names or [f"partition {source}" for source in order]
    total = sum(sum(pairs[source][2] for source in group) for group in groups)
    touched = np.sort(np.concatenate([pairs[source][0] for source in order]))
    if touched.size > 1:  # the union: each index once (a sort and a mask beat np.unique's hash)
        touched = touched[np.concatenate(([True], touched[1:] != touched[:-1]))]
    spread: dict[int, np.ndarray] = {}
    for source in order:
        indices, values, _ = pairs[source]
        spread[source] = np.zeros(touched.size, np.float32)
        spread[source][np.searchsorted(touched, indices)] = values
    target = np.empty(touched.size, np.float32)
    for index, group in enumerate(groups):
        values = [spread[source] for source in group]
        if index == 0:
            _add_up(values, target)
        elif len(values) == 1:
            target += values[0]
        else:
            target += _add_up(values, np.empty(touched.size, np.float32))
    value = None if divisor is None else divisor(total)
    if check is not None:
        check.check(target, 0, names, [spread[source] for source in order], positions=touched)
    if value is not None:
        Divide(value)(target)
    out.fill(0)
    out[touched] = target
    return total
