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
import warnings
from typing import Any

from pallas_kernels.static_args import check_fraction, check_int, check_static

__all__ = [
  "check_decay_rate",
  "check_fraction",
  "check_int",
  "check_learning_rate",
  "check_non_negative",
  "check_static",
  "renamed_keyword",
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


def renamed_keyword(old_name: str, old_value: Any, new_name: str, new_value: Any, default: Any) -> Any:
  """The value of a keyword argument renamed from ``old_name`` to ``new_name``.

  ``new_value``, unless the caller passed ``old_name`` (``old_value`` is not
  None): then ``old_value``, with a ``DeprecationWarning`` that names
  ``new_name``. Both passed is a ``ValueError``.
  """
  if old_value is None:
    return new_value
  if not (_is_number(new_value) and new_value == default):
    raise ValueError(f"{old_name} is the old name of {new_name}; pass {new_name} only.")
  warnings.warn(f"{old_name} is deprecated; pass {new_name}={old_value!r} instead.", DeprecationWarning, stacklevel=3)
  return old_value
