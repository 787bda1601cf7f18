"""Checked settings of the optimizers and schedules: each wrong one a ConfigurationError
naming the setting and its allowed range."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError


def describe_range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return "finite"


def real_setting(
    owner: str,
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a Python float; ``ConfigurationError`` unless finite and in range."""
    allowed = describe_range(low, high, low_open, high_open)
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if ok:
        value = float(value)
        ok = (
            math.isfinite(value)
            and (low is None or (value > low if low_open else value >= low))
            and (high is None or (value < high if high_open else value <= high))
        )
    if not ok:
        raise ConfigurationError(
            f"{owner}: {name} must be a finite number {allowed}, got {value!r}"
        )
    return value


def integer_setting(owner: str, name: str, value: Any, low: int) -> int:
    """``value`` as a Python int; ``ConfigurationError`` unless an integer ``>= low``."""
    if (
        not isinstance(value, numbers.Integral)
        or isinstance(value, (bool, np.bool_))
        or int(value) < low
    ):
        raise ConfigurationError(f"{owner}: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def flag_setting(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"{owner}: {name} must be True or False, got {value!r}")
    return bool(value)


def check_step(step: Any) -> int:
    if not isinstance(step, numbers.Integral) or isinstance(step, (bool, np.bool_)) or step < 0:
        raise InputError(f"step must be an integer >= 0 (0-based), got {step!r}")
    return int(step)


class Config:
    """Shared by schedules and optimizers: repr, equality and hash from ``_fields``."""

    _fields: tuple[str, ...] = ()

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self._fields)

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self._values()))
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))
