"""The owner's sum, Spark-free: its divide keeps the bits of a float32 division."""

import numpy as np
import pytest

from allreduce_param.engine.movement.sums import Divide


def _values() -> np.ndarray:
    """float32 values of every kind: random bit patterns (normals, subnormals, NaN, Inf),
    the extremes, both zeros."""
    rng = np.random.default_rng(5)
    patterns = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 3.0, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38],
        np.float32,
    )
    tiny = np.float32(1.1754944e-38) * rng.random(1000).astype(np.float32)  # subnormal results
    return np.concatenate([patterns.view(np.float32), special, tiny])


@pytest.mark.parametrize(
    "divisor", [1, 2, 3, 4, 6, 8, 16, 4096, 2**-3, 0.75, 2.0**126, 2.0**-126, 7.5, 1e30]
)
def test_a_divide_by_any_number_has_the_bits_of_a_float32_division(divisor):
    values = _values()
    got = values.copy()
    with np.errstate(all="ignore"):  # overflows and underflows are the point here
        expected = values / np.float32(divisor)
        Divide(divisor)(got)
    # NaN's payload aside (a NaN sum is refused before any divide), the very same bits
    finite_or_inf = ~np.isnan(expected)
    assert np.array_equal(
        got[finite_or_inf].view(np.uint32), expected[finite_or_inf].view(np.uint32)
    )
    assert np.array_equal(np.isnan(got), np.isnan(expected))


def test_only_a_power_of_two_with_a_normal_reciprocal_multiplies():
    assert Divide(4).reciprocal == np.float32(0.25)
    assert Divide(2**-3).reciprocal == np.float32(8)
    assert Divide(3).reciprocal is None and Divide(0.75).reciprocal is None
    assert Divide(2.0**127).reciprocal is None  # 2**-127 is subnormal: divide
