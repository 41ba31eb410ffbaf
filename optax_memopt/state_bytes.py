"""Measuring optimizer state: bytes of every array leaf of a pytree."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _leaf_nbytes(leaf: Any) -> int:
  shape = getattr(leaf, "shape", None)
  dtype = getattr(leaf, "dtype", None)
  if shape is None or dtype is None:
    if isinstance(leaf, (bool, int, float, complex, np.generic)):
      return np.asarray(leaf).nbytes
    raise TypeError(
      "state_nbytes expects a pytree of arrays or jax.ShapeDtypeStruct"
      f" leaves; got a leaf of type {type(leaf).__name__}."
    )
  # Typed PRNG keys are not numpy dtypes but report their own itemsize.
  itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize
  return int(np.prod(shape, dtype=np.int64)) * itemsize


def state_nbytes(tree: Any) -> int:
  """Total bytes of the array leaves of ``tree``.

  Works on real states and on ``jax.eval_shape`` results alike, so the state
  of a multi-billion-parameter model can be measured without allocating it.
  ``None`` leaves and ``optax.MaskedNode`` contribute nothing.

  Args:
    tree: a pytree whose leaves are arrays, ``jax.ShapeDtypeStruct`` or Python
      scalars.

  Returns:
    The number of bytes the leaves occupy.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {"w": jnp.zeros((1000, 1000))}
    >>> state = jax.eval_shape(optax.adam(1e-3).init, params)
    >>> optax_memopt.state_nbytes(state)  # m and v in fp32, plus the count
    8000004
  """
  return sum(_leaf_nbytes(leaf) for leaf in jax.tree.leaves(tree))
