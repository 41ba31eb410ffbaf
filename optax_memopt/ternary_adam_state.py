"""The state of ternary-state Adam: one parameter-shaped tree per field.

Each parameter falls in one of three kinds, by its size and rank:

* **small** (fewer than ``min_quantized_size`` elements): plain Adam,
  float32 ``mu`` and ``nu`` of the parameter's shape (``mu.per_element``,
  ``nu.per_element``);
* **ternary vector** (at least ``min_quantized_size`` elements, rank < 2):
  ``mu`` as block-major trits (:mod:`pallas_kernels.ternary`;
  ``mu.packed``, ``mu.scales``), float32 ``nu`` of the parameter's shape
  (``nu.per_element``);
* **ternary matrix** (at least ``min_quantized_size`` elements, rank >= 2):
  ``mu`` as trits, ``nu`` as Adafactor's row and column statistics over the
  last two axes (``nu.row``, ``nu.col``).

Every field is a tree shaped like the parameters holding at most one array
per parameter (Flax NNX rebuilds any container found at a parameter's place
as an ``nnx.State``). A parameter for which a field does not apply holds
``None`` there, an empty subtree: it costs no bytes, and orbax (which
refuses to save arrays of size 0) and ``jax.tree`` functions skip it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_memopt import sharding
from pallas_kernels import ternary


class TernaryAdamMu(NamedTuple):
  """The first moment ``mu``: trits and block scales per ternary parameter, float32 per small one.

  One tree per field. Named ``TernaryMoment``, with ``per_element`` named
  ``dense``, before issue 42 (``optax_memopt.checkpoint`` restores
  checkpoints saved then).
  """

  # uint8 (*blocks, ceil(block_size / trits_per_byte)) per ternary parameter,
  # the block-major layout of ternary.shapes; None per small one.
  packed: optax.Updates
  # float32 (*blocks, 1) per ternary parameter, its block scales; None per
  # small one.
  scales: optax.Updates
  # float32 of the parameter's shape per small parameter; None per
  # ternary one.
  per_element: optax.Updates

  field_layouts = {
    "packed": sharding.Layout.BLOCKS,
    "scales": sharding.Layout.BLOCKS,
    "per_element": sharding.Layout.PARAM,
  }


class TernaryAdamNu(NamedTuple):
  """The second moment ``nu``: row and column statistics per ternary matrix, float32 per other parameter.

  One tree per field. Named ``FactoredSecondMoment``, with ``per_element``
  named ``dense``, before issue 42 (``optax_memopt.checkpoint`` restores
  checkpoints saved then).
  """

  # float32 (..., r) per ternary matrix (..., r, c): EMA of the mean of
  # g**2 + 1e-30 over the last axis; None per other parameter.
  row: optax.Updates
  # float32 (..., c) per ternary matrix: EMA of the mean over the
  # second-to-last axis; None per other parameter.
  col: optax.Updates
  # float32 of the parameter's shape per small parameter and ternary vector;
  # None per ternary matrix.
  per_element: optax.Updates

  # The row statistics follow the rows, cut over the whole mesh as the
  # partitioner scatters a reduction over a sharded last axis. The column
  # statistics are whole over the rows' mesh axes, which every device's rows
  # read: a mean over sharded rows is then one all-reduce of its partial sums
  # (cut flat, it was scattered over the mesh and gathered back for the
  # rebuild, twice the bytes through collectives).
  field_layouts = {
    "row": sharding.Layout.FLAT,
    "col": sharding.Layout.COLUMN_STATISTICS,
    "per_element": sharding.Layout.PARAM,
  }


class ScaleByTernaryAdamState(NamedTuple):
  """State of ``scale_by_ternary_adam``."""

  count: jax.typing.ArrayLike  # shape=(), dtype=jnp.int32.
  key: jax.Array  # uint32 key data of the rounding key, shape of the key's impl.
  mu: TernaryAdamMu  # Three trees like the params (see TernaryAdamMu).
  nu: TernaryAdamNu  # Three trees like the params (see TernaryAdamNu).

  # mu and nu declare their own fields' layouts.
  field_layouts = {"count": sharding.Layout.REPLICATED, "key": sharding.Layout.REPLICATED, "mu": None, "nu": None}


def is_ternary(param: jax.Array, min_quantized_size: int) -> bool:
  """Whether ``param``'s first moment is stored as trits."""
  return param.size >= min_quantized_size


def is_factored(param: jax.Array, min_quantized_size: int) -> bool:
  """Whether ``param``'s second moment is factored into row and column statistics."""
  return is_ternary(param, min_quantized_size) and param.ndim >= 2


def init_state(
  params: optax.Params, key_data: jax.Array, *, block_size: int, min_quantized_size: int, packing: str
) -> ScaleByTernaryAdamState:
  """Zero moments for ``params``: zero trits and scales, zero statistics."""

  def zero_trits(param):
    if is_ternary(param, min_quantized_size):
      return ternary.zeros(param.shape, block_size=block_size, packing=packing)
    return None, None

  def zero_per_element(param, applies):
    return jnp.zeros(param.shape, jnp.float32) if applies else None

  def zero_statistic(param, axis):
    if not is_factored(param, min_quantized_size):
      return None
    shape = list(param.shape)
    del shape[axis]
    return jnp.zeros(shape, jnp.float32)

  return ScaleByTernaryAdamState(
    count=jnp.zeros([], jnp.int32),
    key=key_data,
    mu=TernaryAdamMu(
      packed=jax.tree.map(lambda p: zero_trits(p)[0], params),
      scales=jax.tree.map(lambda p: zero_trits(p)[1], params),
      per_element=jax.tree.map(lambda p: zero_per_element(p, not is_ternary(p, min_quantized_size)), params),
    ),
    nu=TernaryAdamNu(
      row=jax.tree.map(lambda p: zero_statistic(p, -1), params),
      col=jax.tree.map(lambda p: zero_statistic(p, -2), params),
      per_element=jax.tree.map(lambda p: zero_per_element(p, not is_factored(p, min_quantized_size)), params),
    ),
  )
