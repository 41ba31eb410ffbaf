"""Checks of the arguments that ops and optimizers share, each error naming the argument.

A block size, a window or a number of bits fixes array shapes, so it must be
a Python value when a function is traced. Under ``optax.inject_hyperparams``
every numeric argument becomes an array unless it is listed in
``static_args``: the error says so, naming the argument. Float arguments
(decay rates, ``eps``) may be 0-d arrays or tracers: their type is checked,
and the range of plain numbers.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Indices below this fit in int16 (block-local top-k indices, TACO's output
# indices): half the bytes of int32 in a state.
INT16_INDEX_LIMIT = 2**15


def check_static(name: str, value: Any) -> None:
  """Raises ``ValueError`` naming ``name`` when ``value`` is a JAX array or tracer."""
  if isinstance(value, (jax.Array, jax.core.Tracer)) or (isinstance(value, np.ndarray) and value.ndim):
    raise ValueError(
      f"{name} fixes the state's shapes, so it must be a plain Python value, not"
      f" {type(value).__name__}: with optax.inject_hyperparams, list it in"
      f" static_args (static_args=({name!r},))."
    )


def check_dtype(name: str, dtype: Any, allowed: tuple[np.dtype, ...]) -> np.dtype:
  """``dtype`` as a NumPy dtype, or a ``ValueError`` naming ``name`` unless it is one of ``allowed``."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in allowed:
    names = ", ".join(d.name for d in allowed)
    raise ValueError(f"{name} must have one of the dtypes {names}; got {dtype}.")
  return dtype


def check_int(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> int:
  """``value`` as a Python ``int`` in ``[low, high]``, or a ``ValueError`` naming ``name``."""
  check_static(name, value)
  allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
  if isinstance(value, bool):
    raise ValueError(f"{name} must be an int {allowed}{hint}; got {value!r}.")
  try:
    value = operator.index(value)
  except TypeError:
    raise ValueError(f"{name} must be an int {allowed}{hint}; got {value!r}.") from None
  if value < low or (high is not None and value > high):
    raise ValueError(f"{name} must be an int {allowed}{hint}; got {value}.")
  return value


def check_fraction(name: str, value: Any) -> float:
  """``value`` as a Python ``float`` in ``(0, 1]``, or a ``ValueError`` naming ``name``."""
  check_static(name, value)
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
    raise ValueError(f"{name} must be a number in (0, 1]; got {value!r}.")
  return float(value)


def check_scalar(name: str, value: Any, allowed: str, *, alternatives: str = "") -> bool:
  """Whether a traceable float argument is a plain number (whose range the caller checks).

  A real Python or NumPy number, or a 0-d real array or tracer (what
  ``optax.inject_hyperparams`` passes); anything else (a string, None, a
  complex number, an array of another shape) raises a ``ValueError`` naming
  ``name``, ``allowed`` (its range) and ``alternatives`` (other accepted forms).
  """
  if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
    return True
  if isinstance(value, (jax.Array, jax.core.Tracer, np.ndarray)) and np.shape(value) == ():
    if jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer):
      return False
  raise ValueError(f"{name} must be a real number {allowed} or a 0-d real array{alternatives}; got {value!r}.")


def check_decay_rate(name: str, value: Any) -> None:
  """An exponential-moving-average rate such as ``b1``: in ``[0, 1)``."""
  if check_scalar(name, value, "in [0, 1)") and not 0 <= value < 1:
    raise ValueError(f"{name} must be in [0, 1); got {value}.")


def check_non_negative(name: str, value: Any, *, alternatives: str = "") -> None:
  """``eps``, ``weight_decay``: ``>= 0`` (and not NaN)."""
  if check_scalar(name, value, ">= 0", alternatives=alternatives) and not value >= 0:
    raise ValueError(f"{name} must be >= 0; got {value}.")


def index_dtype(extent: int) -> np.dtype:
  """The narrowest of int16 and int32 that holds indices ``0 .. extent - 1``."""
  return np.dtype(np.int16 if extent <= INT16_INDEX_LIMIT else np.int32)
