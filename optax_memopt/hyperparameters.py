"""Eager checks of hyper-parameters, shared by every optimizer of the library.

They run when a transformation is built, so a bad value fails with a message
naming the parameter instead of deep inside ``jit``. One helper per kind of
hyper-parameter: float ones (``check_scalar``, ``check_decay_rate``,
``check_non_negative``) may be 0-d arrays or tracers under
``optax.inject_hyperparams``, whose type is checked and, for plain numbers,
the range; a learning rate (``check_learning_rate``) may also be a schedule
(a callable, checked by its user); masks (``check_mask``), dtypes
(``check_dtype``) and name lists (``check_names``) are checked by type.
Shape-fixing hyper-parameters (``check_int``, ``check_fraction``) must be
plain Python values; traced ones raise an error that says to list them in
``inject_hyperparams``' ``static_args``.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.static_args import (
  check_decay_rate,
  check_fraction,
  check_int,
  check_non_negative,
  check_scalar,
  check_static,
)

__all__ = [
  "check_decay_rate",
  "check_dtype",
  "check_fraction",
  "check_int",
  "check_learning_rate",
  "check_mask",
  "check_names",
  "check_non_negative",
  "check_scalar",
  "check_static",
  "renamed_keyword",
  "typed_key",
]


def check_learning_rate(learning_rate: Any, name: str = "learning_rate") -> None:
  """A schedule (a callable of the step count), or a constant ``>= 0``: the alias negates the step itself."""
  if not callable(learning_rate):
    check_non_negative(name, learning_rate, alternatives=", or a schedule (a callable of the step count)")


def check_mask(name: str, mask: Any) -> None:
  """``None``, a callable of the params, or a pytree of booleans, as ``optax.add_decayed_weights`` takes."""
  if mask is None or callable(mask):
    return
  for leaf in jax.tree.leaves(mask):
    if not (isinstance(leaf, (bool, np.bool_)) or (hasattr(leaf, "dtype") and jnp.dtype(leaf.dtype) == jnp.bool_)):
      raise ValueError(
        f"{name} must be None, a function of the params or a pytree of booleans like the params; got a leaf {leaf!r}."
      )


def check_dtype(name: str, dtype: Any) -> Any:
  """``None`` or a floating dtype, as a ``jnp.dtype``."""
  check_static(name, dtype)
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name} must be None or a floating dtype (for example jnp.bfloat16); got {dtype!r}.")
  return dtype


def check_names(name: str, names: Any) -> tuple[str, ...]:
  """A string or a sequence of strings, as a tuple."""
  if isinstance(names, str):
    return (names,)
  if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
    return tuple(names)
  raise ValueError(f"{name} must be a string or a sequence of strings; got {names!r}.")


def renamed_keyword(old_name: str, old_value: Any, new_name: str, new_value: Any, default: Any) -> Any:
  """The value of a keyword argument renamed from ``old_name`` to ``new_name``.

  ``new_value``, unless the caller passed ``old_name`` (``old_value`` is not
  None): then ``old_value``, with a ``DeprecationWarning`` that names
  ``new_name``. Both passed is a ``ValueError``.
  """
  if old_value is None:
    return new_value
  if not (isinstance(new_value, numbers.Integral) and new_value == default):
    raise ValueError(f"{old_name} is the old name of {new_name}; pass {new_name} only.")
  warnings.warn(f"{old_name} is deprecated; pass {new_name}={old_value!r} instead.", DeprecationWarning, stacklevel=3)
  return old_value


def typed_key(name: str, key: int | jax.Array) -> jax.Array:
  """A typed PRNG key from an int seed, a typed key or a legacy uint32 key.

  A scalar integer array is a seed that ``inject_hyperparams`` turned into an
  array. Anything else raises a ``ValueError`` naming ``name``.
  """
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    return jax.random.key(key)
  if isinstance(key, (jax.Array, np.ndarray)):
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
      return key
    if key.dtype == jnp.uint32 and key.shape == (2,):
      return jax.random.wrap_key_data(key)
    if jnp.issubdtype(key.dtype, jnp.integer) and key.shape == ():
      return jax.random.key(key)
  raise ValueError(
    f"{name} must be an int seed or a single JAX PRNG key (typed, or legacy uint32 of shape (2,)); got {key!r}."
  )
