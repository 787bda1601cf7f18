"""The ``topk`` codec's format: a gradient's largest values, by index."""

from __future__ import annotations

import math

import numpy as np

from allreduce_param.engine.blocks.codec.format import (
    F32,
    U32,
    WORKSPACE,
    ValueFormat,
    pieces,
)
from allreduce_param.engine.blocks.codec.header import BytesLike
from allreduce_param.errors import CodecOverflowError, CorruptBlockError


class TopK(ValueFormat):
    """The k = ceil(length / DENSITY) values of largest magnitude, as k u32 indices, strictly
    increasing, then their k float32 values; the others decode to 0. Where values tie at the
    k-th largest magnitude, those of the lowest indices are kept, on every path below: the
    choice is a function of the values alone, which ``models/device_codecs.py`` relies on to
    match this format bit for bit.

    Choosing them takes one pass over the part, not a partition of it (many times dearer).
    A threshold is taken from a strided sample of the magnitudes: if fewer than ``rank``
    sampled values are among the k largest, all k largest exceed the sample's rank-th
    largest. How many are among them is about binomial (mean ``expected``, the sample's
    share of k), so a rank four standard deviations above the mean misleads at most about
    one part in 10**4 (unless the layout beats with the stride), for some 60 % more
    candidates than k in a part of 2**19 values; a rank for 25 % more would mislead about
    one part in 30 there, each costing a partition of the whole part. The pass keeps the
    candidates, the values above the threshold, and only they are partitioned to keep k.
    Fewer than k candidates: values equal to the threshold (zeros, mostly) take the places
    left, and if even those are too few (a misleading sample), the whole part is
    partitioned. The kept are always k largest.

    A part holding NaN or Inf is written as NaN at its first k places, so it decodes to NaN
    there and the owner's check names it, never to finite garbage.

    The stream has no fixed size per value and is never lz4-chunked: ``unpack`` always gets
    the whole stream (``pos`` 0). It refuses indices out of range or not increasing.
    """

    sparse = True
    DENSITY = 100  # one value kept per DENSITY, rounded up
    _STRIDE = 97  # every 97th magnitude is sampled: a prime, so as not to beat with layouts
    _SIGMAS = 4  # the threshold's rank above the expected one, in standard deviations
    _MAX_LENGTH = 1 << 32  # the indices are u32

    def kept(self, length: int) -> int:
        """k: how many of ``length`` values a block keeps."""
        return -(-length // self.DENSITY)

    def stream_size(self, length: int) -> int:
        return 8 * self.kept(length)

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        if values.size > self._MAX_LENGTH:
            raise CodecOverflowError(
                f"topk indexes a block with u32: {values.size} values are more than it can hold "
                f"({self._MAX_LENGTH}); split the vector into smaller blocks"
            )
        k = self.kept(values.size)
        indices, kept = dst[: 4 * k].view(U32), dst[4 * k :].view(F32)
        threshold = self._threshold(values, k)
        candidates, magnitudes, largest = self._above(values, threshold)
        if not np.isfinite(largest):  # NaN or Inf: NaN wherever the block decodes
            indices[:] = np.arange(k)
            kept[:] = np.nan
            return
        if candidates.size >= k:
            chosen = candidates[self._select(magnitudes, k)]
        else:
            chosen = self._with_ties(values, candidates, threshold, k)
        np.copyto(indices, chosen, casting="unsafe")
        kept[:] = values[chosen]

    def _threshold(self, values: np.ndarray, k: int) -> np.float32:
        """A sampled magnitude that somewhat more than k of ``values`` exceed (see the class)."""
        sample = np.abs(values[:: self._STRIDE])
        expected = k * sample.size / values.size  # sampled values among the k largest
        rank = min(sample.size, math.ceil(expected + self._SIGMAS * math.sqrt(expected)) + 1)
        # without the zeros: np.partition slows down many times on a sample of mostly equal
        # values, such as a sparse gradient's zeros
        sample = sample[sample > 0]
        if sample.size < rank:
            return np.float32(0)
        return np.partition(sample, sample.size - rank)[sample.size - rank]

    @staticmethod
    def _above(
        values: np.ndarray, threshold: np.float32
    ) -> tuple[np.ndarray, np.ndarray, np.float32]:
        """The indices of the values whose magnitude exceeds ``threshold`` (increasing), those
        magnitudes, and the largest magnitude (NaN if any is NaN): one pass, in cache."""
        work = WORKSPACE
        found, magnitudes = [], []
        largest = np.float32(0)
        for start, stop in pieces(values.size):
            magnitude = np.abs(values[start:stop], out=work.magnitude[: stop - start])
            largest = np.maximum(largest, magnitude.max())  # np.maximum keeps a NaN
            hits = np.flatnonzero(np.greater(magnitude, threshold, out=work.mask[: stop - start]))
            magnitudes.append(magnitude[hits])
            hits += start
            found.append(hits)
        return np.concatenate(found), np.concatenate(magnitudes), largest

    def _with_ties(
        self, values: np.ndarray, candidates: np.ndarray, threshold: np.float32, k: int
    ) -> np.ndarray:
        """The k largest where fewer than k exceed ``threshold``: all of those, and values
        equal to it for the places left, or, if these are too few, by a partition of all."""
        need = k - candidates.size
        if threshold == 0:  # every value not above it is a zero: the first ones will do
            ties = np.setdiff1d(np.arange(k), candidates, assume_unique=True)[:need]
        else:
            ties = np.flatnonzero(np.abs(values) == threshold)[:need]
        if ties.size < need:  # a misleading sample: the threshold is above the k-th largest
            return self._select(np.abs(values), k)
        chosen = np.concatenate((candidates, ties))
        chosen.sort()
        return chosen

    @staticmethod
    def _select(magnitude: np.ndarray, k: int) -> np.ndarray:
        """The positions of k largest of ``magnitude``, increasing: a partition finds the
        k-th largest, and a mask keeps what exceeds it and the first of its equals, in
        position order, so the positions need no sort."""
        kth = np.partition(magnitude, magnitude.size - k)[magnitude.size - k]
        keep = magnitude > kth
        keep[np.flatnonzero(magnitude == kth)[: k - np.count_nonzero(keep)]] = True
        return np.flatnonzero(keep)

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        k = self.kept(out.size)
        indices = np.frombuffer(piece, U32, k)
        kept = np.frombuffer(piece, F32, k, 4 * k)
        if (indices[1:] <= indices[:-1]).any():
            place = int(np.argmax(indices[1:] <= indices[:-1])) + 1
            raise CorruptBlockError(
                f"the topk block's indices are not increasing: index {place} is {indices[place]}, "
                f"after {indices[place - 1]}"
            )
        if k and indices[-1] >= out.size:
            raise CorruptBlockError(
                f"the topk block's indices are out of range: {indices[-1]} in a block of {out.size} values"
            )
        out[:] = 0
        out[indices] = kept
