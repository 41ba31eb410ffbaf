"""Per-row largest entries of a gradient plus sparse offsets: TACO's selection.

TACO (arXiv 2610.02199) steps, in every column of a torch-layout weight, on
the entry of largest magnitude. In Flax's ``(in, out)`` kernel layout a torch
column is a *row*, so this op works on the rows of a ``[*rows, width]``
gradient ``g``. Each row may carry ``t`` tracked entries (TACO's heavy
hitters): column indices ``c[r, s]``, distinct within a row, with offsets
``o[r, s]`` added to the gradient there:

.. math::

  u_{r, j} = g_{r, j} + \\sum_s [j = c_{r, s}] \\, o_{r, s}

and the op returns, per row, the ``keep`` columns of largest ``|u|`` by
decreasing ``|u|`` together with ``u`` there: with no tracked entries and
``keep = 1`` the per-row argmax of ``|g|``; with TACO's heavy hitters, the
merge of the tracked entries with the row's largest gradients.
:func:`column_select_reference` is that math in a few lines of jnp.

Order and ties. Magnitudes rank as ``|float32(u)|`` in IEEE total order:
NaNs above infinities, ``-0.0`` tied with ``0.0``; equal magnitudes break
toward the lower column, so both paths select the same columns in the same
order. ``lax.top_k`` ranks floats this way; the one-column path compares
``topk.magnitude_key`` (those bits as an int32, whose integer order is that
order).

:func:`column_select` is the reference, with ``keep = 1`` and at most one
tracked entry taken by an argmax of the magnitude keys instead of a top-k
(one reduction, which reads ``g`` once and returns the lowest column among
equal keys; a reduction of the keys and then one of the columns holding the
largest would make XLA:GPU write each element's key out between them), the
tracked entry added by a compare, which keeps ``u`` elementwise in ``g`` (split as ``g``
under sharding). It is XLA only, on every platform, and takes no
``implementation=`` (``pallas_kernels.dispatch``: its Mosaic GPU kernel,
slower than this path on an H200, is deleted).

References:
  Jiang, McGee, Bergou, Cai, Dutta, "TACO: Ternary Absolute-max Column-wise
  One-sparse Optimizer for LLM Fine-Tuning", 2026,
  https://arxiv.org/abs/2610.02199
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import static_args
from pallas_kernels.topk import magnitude_key


class ColumnSelection(NamedTuple):
  """What ``column_select`` returns, per row ``r`` and rank ``j < keep``."""

  index: jax.Array  # shape=(*rows, keep), dtype=jnp.int32: columns by decreasing |u|.
  value: jax.Array  # shape=(*rows, keep), dtype=jnp.float32: u[r, index[r, j]].


def column_select_reference(
  grads: jax.Array,
  tracked_index: jax.Array | None = None,
  tracked_offset: jax.Array | None = None,
  *,
  keep: int = 1,
) -> ColumnSelection:
  """The math of :func:`column_select` in plain jnp: the ground truth of its tests.

  ``u = g`` with the offsets added at the tracked columns; per row, the
  ``keep`` columns of largest ``|u|``. ``lax.top_k`` ranks NaN above
  infinity and puts the lower column first among equal magnitudes.
  """
  u = grads.astype(jnp.float32)
  if tracked_index is not None:
    rows = u.reshape(-1, u.shape[-1])
    row = jnp.arange(len(rows))[:, None]
    offsets = tracked_offset.astype(jnp.float32).reshape(len(rows), -1)
    u = rows.at[row, tracked_index.reshape(len(rows), -1)].add(offsets).reshape(u.shape)
  index = lax.top_k(jnp.abs(u), keep)[1]
  return ColumnSelection(index, jnp.take_along_axis(u, index, axis=-1))


def _select_xla(grads, tracked_index, tracked_offset, keep: int) -> ColumnSelection:
  """The reference, with ``keep = 1`` taken by an argmax instead of a top-k.

  ``jnp.argmax`` of the magnitude keys: the largest, at the lowest column
  holding it. The value there is read from ``grads`` plus the tracked offset
  rather than from ``u``, which keeps ``u`` a value XLA recomputes inside
  the reduction instead of writing it out.
  """
  if keep > 1 or tracked_index.shape[-1] > 1:
    return column_select_reference(grads, tracked_index, tracked_offset, keep=keep)
  position = jnp.arange(grads.shape[-1], dtype=jnp.int32)
  tracked = tracked_index.shape[-1] == 1
  u = grads.astype(jnp.float32)
  if tracked:
    u = jnp.where(position == tracked_index, u + tracked_offset, u)
  keys = magnitude_key(u)
  index = jnp.argmax(keys, axis=-1, keepdims=True).astype(jnp.int32)
  value = jnp.take_along_axis(grads.astype(jnp.float32), index, axis=-1)
  if tracked:
    # -0.0 where the column is not the tracked one leaves every float as it is.
    value = value + jnp.where(index == tracked_index, tracked_offset.astype(jnp.float32), -0.0)
  return ColumnSelection(index, value)


@functools.partial(jax.jit, static_argnames=("keep",))
def _column_select(grads, tracked_index, tracked_offset, *, keep: int) -> ColumnSelection:
  return _select_xla(grads, tracked_index.astype(jnp.int32), tracked_offset.astype(jnp.float32), keep)


def column_select(
  grads: jax.Array,
  tracked_index: jax.Array | None = None,
  tracked_offset: jax.Array | None = None,
  *,
  keep: int = 1,
) -> ColumnSelection:
  """Each row's ``keep`` largest entries of ``|grads + tracked offsets|``.

  .. math::

    u_{r, j} = g_{r, j} + \\sum_s [j = c_{r, s}] \\, o_{r, s}, \\qquad
    \\text{index}_{r, :} = \\operatorname{top\\text{-}keep}_j |u_{r, j}|,

  by decreasing ``|u|``, ties toward the lower column (module docstring).
  XLA only: the ``implementation=`` and ``segment_width=`` arguments, which
  chose and cut the deleted Mosaic GPU kernel, are removed, and passing
  either raises ``TypeError`` naming it.

  Args:
    grads: ``[*rows, width]`` floating array, one or more row axes (a Flax
      ``(in, out)`` kernel's gradient: row ``r`` is the torch column of input
      feature ``r``; a leading axis is kept as it is, so the partitioner
      keeps it split as the caller's).
    tracked_index: ``[*rows, t]`` integer columns in ``[0, width)``, distinct
      within a row; ``None`` (with ``tracked_offset``) for no tracked entries.
    tracked_offset: ``[*rows, t]`` offsets added to ``grads`` at
      ``tracked_index``. With ``keep = 1`` and one tracked entry, ``u`` at
      the selected column is computed again from ``grads`` and the offset:
      if the offset is an inexact product computed in the same jit, XLA may
      fuse it into the add as an FMA in the argmax and not there, and the
      value returned would differ from the one ranked in its last bit. Pass
      offsets whose product is exact (TACO rounds its momentum weight to
      bfloat16) or computed outside the jit.
    keep: columns returned per row, in ``[1, width]``.

  Returns:
    A ``ColumnSelection``: ``index`` (int32) and ``value = u[r, index]``
    (float32), both ``[*rows, keep]``.

  Raises:
    ValueError: for a ``grads`` of fewer than 2 axes or not floating, tracked
      arrays of another shape than ``[*rows, t]`` or given alone, or ``keep``
      out of range.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.column_select import column_select
    >>> g = jnp.array([[0.5, -3., 3., 1.], [0., 0., 0., 0.]])
    >>> column_select(g).index  # ties toward the lower column
    Array([[1],
           [0]], dtype=int32)
    >>> selection = column_select(
    ...     g, jnp.array([[3], [2]]), jnp.array([[4.], [-1.]]), keep=2)
    >>> selection.index
    Array([[3, 1],
           [2, 0]], dtype=int32)
    >>> selection.value
    Array([[ 5., -3.],
           [-1.,  0.]], dtype=float32)

  References:
    Jiang et al., "TACO: Ternary Absolute-max Column-wise One-sparse Optimizer
    for LLM Fine-Tuning", 2026, https://arxiv.org/abs/2610.02199
  """
  grads = jnp.asarray(grads)
  if grads.ndim < 2 or not jnp.issubdtype(grads.dtype, jnp.floating):
    raise ValueError(
      f"grads must be a floating array [*rows, width] of at least 2 axes; got {grads.dtype}{list(grads.shape)}."
    )
  *rows, width = grads.shape
  if (tracked_index is None) != (tracked_offset is None):
    raise ValueError("tracked_index and tracked_offset must be given together.")
  if tracked_index is None:
    tracked_index = jnp.zeros((*rows, 0), jnp.int32)
    tracked_offset = jnp.zeros((*rows, 0), jnp.float32)
  for name, tracked in (("tracked_index", tracked_index), ("tracked_offset", tracked_offset)):
    if list(jnp.shape(tracked)[:-1]) != rows or jnp.ndim(tracked) != grads.ndim:
      raise ValueError(f"{name} must have shape [*rows={rows}, t]; got {list(jnp.shape(tracked))}.")
  if jnp.shape(tracked_index) != jnp.shape(tracked_offset):
    raise ValueError(
      "tracked_index and tracked_offset must have the same shape; got"
      f" {list(jnp.shape(tracked_index))} and {list(jnp.shape(tracked_offset))}."
    )
  if not jnp.issubdtype(jnp.result_type(tracked_index), jnp.integer):
    raise ValueError(f"tracked_index must be integer; got {jnp.result_type(tracked_index)}.")
  keep = static_args.check_int("keep", keep, 1, width, hint=" (at most the row width)")
  return _column_select(grads, tracked_index, tracked_offset, keep=keep)
