"""Eager checks of hyper-parameters, shared by every optimizer of the library.

They run when a transformation is built, so a bad value fails with a message
naming the parameter instead of deep inside ``jit``. Float hyper-parameters
may be arrays or tracers under ``optax.inject_hyperparams``: only plain
numbers are checked; a schedule (a callable) is checked by its user.
Shape-fixing hyper-parameters (``check_int``, ``check_fraction``) must be
plain Python values; traced ones raise an error that says to list them in
``inject_hyperparams``' ``static_args``.
"""

from __future__ import annotations

import numbers
from typing import Any

from pallas_kernels.static_args import check_fraction, check_int, check_static

__all__ = [
  "check_decay_rate",
  "check_fraction",
  "check_int",
  "check_learning_rate",
  "check_non_negative",
  "check_static",
]


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_decay_rate(name: str, value: Any) -> None:
  """An exponential-moving-average rate such as ``b1``: in ``[0, 1)``."""
  if _is_number(value) and not 0 <= value < 1:
    raise ValueError(f"{name} must be in [0, 1); got {value}.")


def check_non_negative(name: str, value: Any) -> None:
  """``eps``, ``weight_decay``: ``>= 0`` (and not NaN)."""
  if _is_number(value) and not value >= 0:
    raise ValueError(f"{name} must be >= 0; got {value}.")


def check_learning_rate(learning_rate: Any) -> None:
  """A constant learning rate must be ``>= 0``; the alias negates the step itself."""
  if not callable(learning_rate):
    check_non_negative("learning_rate", learning_rate)
