"""The task-side Arrow conversions: the same values as pyarrow's own, and no pandas import."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from allreduce_param.spark import arrow


@pytest.mark.parametrize(
    "kind", [pa.float32(), pa.float64(), pa.int32(), pa.int64(), pa.int8(), pa.uint16()]
)
def test_values_and_nulls_match_pyarrow_on_slices(kind):
    rng = np.random.default_rng(3)
    raw = rng.integers(-100, 100, 70).astype(kind.to_pandas_dtype())
    mask = rng.random(70) < 0.3
    array = pa.array(raw, kind, mask=mask)
    for start, length in ((0, 70), (5, 40), (13, 0), (69, 1)):
        part = array.slice(start, length)
        got_nulls = arrow.nulls(part)
        np.testing.assert_array_equal(got_nulls, mask[start : start + length])
        got = arrow.values(part)
        assert got.dtype == raw.dtype and len(got) == length
        np.testing.assert_array_equal(got[~got_nulls], raw[start : start + length][~got_nulls])


def test_booleans_are_unpacked_from_their_bits():
    flags = [True, False, None, True, True, False, False, True, True, None, False]
    array = pa.array(flags).slice(3)
    np.testing.assert_array_equal(
        arrow.values(array)[[0, 1, 2, 3, 4, 5, 7]], [True, True, False, False, True, True, False]
    )
    np.testing.assert_array_equal(arrow.nulls(array), [flag is None for flag in flags[3:]])


def test_list_offsets_of_a_sliced_list_array_index_its_values():
    lists = pa.array([[1.0, 2.0], [], None, [3.0, 4.0, 5.0], [6.0]], pa.list_(pa.float32())).slice(
        1, 3
    )
    offsets = arrow.list_offsets(lists)
    values = arrow.values(lists.values)
    assert offsets.dtype == np.int64 and len(offsets) == 4
    assert [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [
        [],
        [],
        [3.0, 4.0, 5.0],
    ]
    np.testing.assert_array_equal(arrow.nulls(lists), [False, True, False])


def test_other_types_fall_back_to_pyarrow():
    assert arrow.values(pa.array(["a", "b"])).tolist() == ["a", "b"]


def test_record_batch_of_text_and_bytes():
    batch = arrow.record_batch(
        kind=["steps", "é", ""], payload=[b"\x00\x01", b"", bytearray(b"xyz")]
    )
    assert batch.schema.types == [pa.string(), pa.binary()]
    assert batch.to_pydict() == {"kind": ["steps", "é", ""], "payload": [b"\x00\x01", b"", b"xyz"]}
    assert arrow.record_batch(stats=[]).num_rows == 0


def test_record_batch_refuses_mixed_or_uneven_columns():
    with pytest.raises(TypeError, match="'kind' must hold only str or only bytes"):
        arrow.record_batch(kind=["a", b"b"])
    with pytest.raises(ValueError, match="'payload' has 1 values, the columns before it 2"):
        arrow.record_batch(kind=["a", "b"], payload=[b"x"])


def test_the_conversions_leave_pandas_unimported():
    """pyarrow's own conversions import pandas; a fresh Python worker would pay for it."""
    script = """
import sys
import numpy as np
import pyarrow as pa
from allreduce_param.spark import arrow
values = pa.Array.from_buffers(pa.float32(), 3, [None, pa.py_buffer(np.arange(3, dtype=np.float32))])
offsets = pa.Array.from_buffers(pa.int32(), 3, [None, pa.py_buffer(np.array([0, 1, 3], np.int32))])
lists = pa.ListArray.from_arrays(offsets, values)
assert arrow.values(lists.flatten()).tolist() == [0.0, 1.0, 2.0]
assert arrow.list_offsets(lists).tolist() == [0, 1, 3]
assert not arrow.nulls(lists).any()
arrow.record_batch(kind=["steps"], payload=[b"x"])
arrow.float_lists(np.ones((2, 3)))
print("pandas" in sys.modules)
"""
    found = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "False"


def test_float_lists_are_the_lists_pyarrow_makes_of_the_rows():
    matrix = np.arange(12, dtype=np.float64).reshape(4, 3) / 7
    made = arrow.float_lists(matrix)
    assert made.type == pa.list_(pa.float32())
    assert made.equals(
        pa.array([list(row) for row in matrix.astype(np.float32)], pa.list_(pa.float32()))
    )
    assert len(arrow.float_lists(np.zeros((0, 5)))) == 0
