"""Arrow arrays to numpy and back inside a task, without pyarrow importing pandas.

pyarrow's own conversions (``Array.to_numpy``, ``pa.array`` on Python or numpy values) ask
whether pandas is installed, and so import it: in a fresh Python worker that import costs
more than a small task's work, and a fit's first tasks all pay it. These read and write the
Arrow buffers directly, for the fixed-width columns, the feature lists and the str/bytes
records the fit's tasks handle; anything else falls back to pyarrow's conversion.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Arrow type names (``str(pa.DataType)``) read as numpy views of their data buffer.
_FIXED_WIDTH = {
    "float": np.float32,
    "double": np.float64,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
}


def values(array) -> np.ndarray:
    """A pyarrow array's values as numpy: a view of its buffer for numbers, bools unpacked.

    Slots that are null hold whatever the buffer holds there; ``nulls`` says which they are.
    """
    kind = str(array.type)
    length, start = len(array), array.offset
    if kind == "bool":
        return _bits(array.buffers()[1], start, length)
    dtype = _FIXED_WIDTH.get(kind)
    if dtype is None:
        return array.to_numpy(zero_copy_only=False)
    data = array.buffers()[1]
    if data is None or length == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype, count=length, offset=start * np.dtype(dtype).itemsize)


def nulls(array) -> np.ndarray:
    """Which of a pyarrow array's slots are null, as a numpy bool array."""
    validity = array.buffers()[0]
    if validity is None or array.null_count == 0:
        return np.zeros(len(array), bool)
    return ~_bits(validity, array.offset, len(array))


def list_offsets(array) -> np.ndarray:
    """A pyarrow list array's offsets into its ``values`` (``len(array) + 1`` of them) as int64."""
    return values(array.offsets).astype(np.int64)


def record_batch(**columns: Sequence[str] | Sequence[bytes]):
    """A pyarrow RecordBatch of the given columns, each all ``str`` (an Arrow string column)
    or all ``bytes`` (binary), as a task yields to ``mapInArrow``."""
    import pyarrow as pa

    arrays, rows = [], None
    for name, column in columns.items():
        text = all(isinstance(value, str) for value in column)
        if not text and not all(
            isinstance(value, (bytes, bytearray, memoryview)) for value in column
        ):
            raise TypeError(f"column {name!r} must hold only str or only bytes values")
        encoded = [value.encode() if text else bytes(value) for value in column]
        if rows is not None and len(encoded) != rows:
            raise ValueError(
                f"column {name!r} has {len(encoded)} values, the columns before it {rows}"
            )
        rows = len(encoded)
        offsets = np.zeros(rows + 1, np.int64)
        np.cumsum([len(value) for value in encoded], out=offsets[1:])
        if offsets[-1] >= 2**31:
            raise ValueError(
                f"column {name!r} holds {int(offsets[-1])} bytes; an Arrow batch's column "
                "takes less than 2 GiB: yield it in several batches"
            )
        arrays.append(
            pa.Array.from_buffers(
                pa.string() if text else pa.binary(),
                rows,
                [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded))],
            )
        )
    return pa.RecordBatch.from_arrays(arrays, list(columns))


def float_lists(matrix: np.ndarray, dtype: Any = np.float32):
    """A pyarrow ``list<float>`` array (Spark's ``array<float>``; with ``dtype`` float64,
    ``list<double>``) with one list per row of a 2-D matrix, built from its buffer."""
    import pyarrow as pa

    matrix = np.ascontiguousarray(matrix, dtype=dtype)
    rows, width = matrix.shape
    values = pa.Array.from_buffers(
        pa.from_numpy_dtype(matrix.dtype), matrix.size, [None, pa.py_buffer(matrix.reshape(-1))]
    )
    offsets = pa.Array.from_buffers(
        pa.int32(), rows + 1, [None, pa.py_buffer(np.arange(rows + 1, dtype=np.int32) * width)]
    )
    return pa.ListArray.from_arrays(offsets, values)


def _bits(buffer, start: int, length: int) -> np.ndarray:
    """``length`` bits of an Arrow bitmap (least significant bit first) from bit ``start``."""
    if buffer is None or length == 0:
        return np.zeros(length, bool)
    bits = np.unpackbits(np.frombuffer(buffer, np.uint8), bitorder="little")
    return bits[start : start + length].astype(bool)


#: A thread's stack under an address-space limit (glibc's default is RLIMIT_STACK, 8 MiB, of
#: address space reserved per thread): the fit's threads run numpy and sockets, no deep
#: recursion.
LIMITED_THREAD_STACK = 1 << 20
#: glibc's malloc arenas under an address-space limit: each reserves 64 MiB of address
#: space, and glibc makes up to 8 per core as threads allocate.
LIMITED_MALLOC_ARENAS = 2
#: Allocations from this size up are their own mappings, given back when freed.
LIMITED_MMAP_THRESHOLD = 1 << 20


def fit_the_address_space_limit() -> bool:
    """Where the Python worker's address space is limited (``spark.executor.pyspark.memory``,
    which Spark passes as ``PYSPARK_EXECUTOR_MEMORY_MB`` and sets as RLIMIT_AS), spend it on
    data rather than on reservations, before the task reads its first batch:

    - Arrow's allocator: the system's (``ARROW_DEFAULT_MEMORY_POOL=system``) unless chosen
      otherwise. Arrow's default, mimalloc, reserves 1 GiB of address space with its first
      allocation, which a worker limited to less cannot map. Arrow reads the variable once,
      at its first allocation in the process: a reused worker keeps its allocator.
    - New threads' stacks: ``LIMITED_THREAD_STACK`` (``threading.stack_size``).
    - glibc's malloc: at most ``LIMITED_MALLOC_ARENAS`` arenas (``mallopt(M_ARENA_MAX)``),
      and allocations of ``LIMITED_MMAP_THRESHOLD`` and more mapped on their own.

    Whether the worker is limited (and so these were set)."""
    if not os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB"):
        return False
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    import threading

    threading.stack_size(LIMITED_THREAD_STACK)
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-8, LIMITED_MALLOC_ARENAS)  # M_ARENA_MAX
        # M_MMAP_THRESHOLD: a fixed one (glibc raises its own up to 32 MiB as blocks are
        # freed, and the arenas' heaps then keep address space that mmap would give back)
        libc.mallopt(-3, LIMITED_MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc
        pass
    return True
