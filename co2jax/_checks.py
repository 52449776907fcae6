"""Eager argument validation: every factory checks its hyper-parameters before anything is
traced, and names the argument and the value in its ``ValueError``."""

from __future__ import annotations

import math
import numbers
from typing import Any


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_positive(name: str, value: Any) -> float:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")
    return float(value)


def check_unit_interval(name: str, value: Any, *, closed_right: bool = False) -> float:
    ok = _is_real(value) and 0 <= value and (value <= 1 if closed_right else value < 1)
    if not ok:
        bound = "[0, 1]" if closed_right else "[0, 1)"
        raise ValueError(f"{name} must be a number in {bound}, got {name}={value!r}")
    return float(value)


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    return int(value)


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool; a one-line error naming the setting otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {name}={value!r}")
    return value


def check_axis_name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")
    return value


def check_transform(name: str, value: Any):
    """``value`` if it is an optax ``GradientTransformation`` (has ``init`` and ``update``)."""
    if not (hasattr(value, "init") and hasattr(value, "update")):
        raise ValueError(
            f"{name} must be an optax GradientTransformation (with init and update), "
            f"got {name}={value!r}"
        )
    return value


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {name}={value!r}")
    return value
