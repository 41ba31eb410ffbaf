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
toward the lower column, so every implementation selects the same columns in
the same order. ``lax.top_k`` ranks floats this way; the kernel and the
one-column XLA path compare ``topk.magnitude_key`` (those bits as an int32,
whose integer order is that order).

Implementations (``implementation=``, see ``pallas_kernels.dispatch``):

* ``"xla"``: ``lax.top_k`` per row, as the reference; for ``keep = 1`` two
  reductions over the magnitude keys instead (the largest, then the lowest
  column holding it), with a single tracked entry added by a compare, which
  keeps ``u`` elementwise in ``g`` (split as ``g`` under sharding).
* ``"pallas"``: a Mosaic GPU kernel (``plgpu.kernel``). Mosaic GPU has no
  argmax, sort or top-k, but the lowest index of a row's largest key is two
  full reductions: ``m = max(key)``, then ``min`` of the column positions
  where ``key == m``. The kernel holds one row segment in registers, adds the
  tracked offsets with one masked select per slot, and selects ``keep``
  times, marking each chosen column as taken. Rows wider than
  ``MAX_SEGMENT_WIDTH`` are cut into equal segments (one program each, no
  padding when the width allows it); ``lax.top_k`` then merges the
  ``segments * keep`` candidates of a row, a small array. Candidates sit
  segment-major, each segment's by decreasing key and rising index, so the
  merge keeps the lower index among equal keys as well.
* ``"interpret"``: the same kernel in the Mosaic GPU interpreter (CPU).
* ``None``: the Pallas kernel on a Hopper-or-newer GPU where it supports the
  input, XLA otherwise.

References:
  Jiang, McGee, Bergou, Cai, Dutta, "TACO: Ternary Absolute-max Column-wise
  One-sparse Optimizer for LLM Fine-Tuning", 2026,
  https://arxiv.org/abs/2610.02199
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _backend, dispatch, static_args, xla_cpu
from pallas_kernels.topk import magnitude_key

# Threads of a Mosaic GPU warpgroup: a segment is a whole multiple of them.
_LANES = 128
# A segment lives in registers as three 32-bit vectors (u, its keys, column
# positions): at 4096 that is 96 registers per thread of the warpgroup.
MAX_SEGMENT_WIDTH = 4096
# Keys below every magnitude key (>= 0). Padding ranks above chosen columns:
# a last segment with fewer real columns than ``keep`` fills up with padding
# (|u| = 0, behind every real candidate in the merge), never with a column it
# already offered.
_PADDING = -1
_TAKEN = -2
# Matches no column: stands in for "no tracked entry" inside the kernel.
_NO_COLUMN = -1


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
  """The reference, with ``keep = 1`` taken by two reductions instead of a top-k.

  The largest magnitude key, then the lowest column holding it
  (``xla_cpu.reduce_row``); the value there is read from ``grads`` plus the
  tracked offset rather than from ``u``, which keeps ``u`` a value XLA
  recomputes inside each reduction instead of writing it out.
  """
  if keep > 1 or tracked_index.shape[-1] > 1:
    return column_select_reference(grads, tracked_index, tracked_offset, keep=keep)
  width = grads.shape[-1]
  position = jnp.arange(width, dtype=jnp.int32)
  tracked = tracked_index.shape[-1] == 1
  u = grads.astype(jnp.float32)
  if tracked:
    u = jnp.where(position == tracked_index, u + tracked_offset, u)
  keys = magnitude_key(u)
  largest = xla_cpu.reduce_row(keys, np.int32(np.iinfo(np.int32).min), lax.max, fold_to=xla_cpu.FUSED_REDUCTION)
  at_largest = jnp.where(keys == largest[..., None], position, width)
  index = xla_cpu.reduce_row(at_largest, np.int32(np.iinfo(np.int32).max), lax.min, fold_to=xla_cpu.FUSED_REDUCTION)
  index = index[..., None]
  value = jnp.take_along_axis(grads.astype(jnp.float32), index, axis=-1)
  if tracked:
    # -0.0 where the column is not the tracked one leaves every float as it is.
    value = value + jnp.where(index == tracked_index, tracked_offset.astype(jnp.float32), -0.0)
  return ColumnSelection(index, value)


def _strided_layout(dtype: Any, segment_width: int) -> Any:
  """The register layout Mosaic GPU infers for a loaded ``(segment_width,)`` row of ``dtype``.

  A freshly created iota has no layout to infer from; it must be cast to the
  one of the gradient row it is compared with. This mirrors Mosaic GPU's
  ``WGStridedFragLayout.from_shaped_type``: the widest vector of at most 8
  bytes per thread that tiles the row.
  """
  vec_size = min(8 // jnp.dtype(dtype).itemsize, segment_width // _LANES)
  while segment_width % (vec_size * _LANES):
    vec_size //= 2
  return plgpu.Layout.WG_STRIDED((segment_width,), vec_size=vec_size)


def _select_kernel(
  grads_ref,
  tracked_index_ref,
  tracked_offset_ref,
  index_ref,
  value_ref,
  *,
  width: int,
  segments: int,
  segment_width: int,
  keep: int,
  layout: Any,
):
  """Segment ``block`` of ``grads_ref[rows * segments, segment_width]``: its ``keep`` largest |u|."""
  block = lax.axis_index("segments")
  row = block // segments
  position = lax.broadcasted_iota(jnp.int32, (segment_width,), 0)
  if layout is not None:  # The interpreter needs no layout (and JAX 0.10's has no rule for it).
    position = plgpu.layout_cast(position, layout)
  position = position + (block % segments) * segment_width

  def add_tracked(slot, u):
    hit = position == tracked_index_ref[row, slot]
    return jnp.where(hit, u + tracked_offset_ref[row, slot], u)

  u = lax.fori_loop(0, tracked_index_ref.shape[1], add_tracked, grads_ref[block].astype(jnp.float32))
  # The constant leads: JAX 0.10's Mosaic GPU gives a select the signedness of
  # its first value, and bitcast keys count as unsigned, which the signed
  # carry that ``take_largest`` returns would not match.
  keys = jnp.where(position >= width, _PADDING, magnitude_key(u))

  def take_largest(rank, keys):
    largest = jnp.max(keys)
    column = jnp.min(jnp.where(keys == largest, position, jnp.iinfo(jnp.int32).max))
    chosen = position == column
    index_ref[block, rank] = column
    value_ref[block, rank] = jnp.sum(jnp.where(chosen, u, 0.0))
    return jnp.where(chosen, _TAKEN, keys)

  lax.fori_loop(0, keep, take_largest, keys)


def _select_pallas(
  grads, tracked_index, tracked_offset, keep: int, segment_width: int, *, interpret: bool
) -> ColumnSelection:
  rows, width = grads.shape
  segments = -(-width // segment_width)
  padded = jnp.pad(grads, ((0, 0), (0, segments * segment_width - width)))
  if tracked_index.shape[1] == 0:
    tracked_index = jnp.full((rows, 1), _NO_COLUMN, jnp.int32)
    tracked_offset = jnp.zeros((rows, 1), jnp.float32)
  candidates = jax.ShapeDtypeStruct((rows * segments, keep), jnp.int32)
  kernel = _backend.mosaic_gpu_kernel(
    functools.partial(
      _select_kernel,
      width=width,
      segments=segments,
      segment_width=segment_width,
      keep=keep,
      layout=None if interpret else _strided_layout(grads.dtype, segment_width),
    ),
    out_type=(candidates, jax.ShapeDtypeStruct(candidates.shape, jnp.float32)),
    grid=(rows * segments,),
    grid_names=("segments",),
    interpret=interpret,
  )
  index, value = kernel(padded.reshape(rows * segments, segment_width), tracked_index, tracked_offset)
  index = index.reshape(rows, segments * keep)
  value = value.reshape(rows, segments * keep)
  if segments > 1:
    best = lax.top_k(jnp.abs(value), keep)[1]
    index = jnp.take_along_axis(index, best, axis=1)
    value = jnp.take_along_axis(value, best, axis=1)
  return ColumnSelection(index, value)


@functools.partial(jax.jit, static_argnames=("keep", "implementation", "segment_width"))
def _column_select(
  grads, tracked_index, tracked_offset, *, keep: int, implementation: str, segment_width: int
) -> ColumnSelection:
  tracked_index = tracked_index.astype(jnp.int32)
  tracked_offset = tracked_offset.astype(jnp.float32)
  if implementation == "xla":
    return _select_xla(grads, tracked_index, tracked_offset, keep)
  rows = grads.shape[:-1]
  n_rows = math.prod(rows)
  selection = _select_pallas(
    *(x.reshape(n_rows, x.shape[-1]) for x in (grads, tracked_index, tracked_offset)),
    keep,
    segment_width,
    interpret=implementation == "interpret",
  )
  return ColumnSelection(*(leaf.reshape(*rows, keep) for leaf in selection))


def default_segment_width(width: int, keep: int) -> int | None:
  """The segment the kernel cuts a row of ``width`` into, or ``None``.

  Among multiples of 128 from ``keep`` up to ``MAX_SEGMENT_WIDTH``, the one
  that pads the row least (rows whose width is a multiple of 128 are mostly
  not padded at all), the widest among equals (fewer candidates to merge).
  ``None`` when ``keep`` exceeds ``MAX_SEGMENT_WIDTH``: the kernel cannot
  take that many columns from one segment.
  """
  lanes = -(-width // _LANES)
  fewest, most = max(-(-keep // _LANES), 1), min(lanes, MAX_SEGMENT_WIDTH // _LANES)
  if fewest > most:
    return None

  def padding_then_count(segment_lanes):
    return -(-lanes // segment_lanes) * segment_lanes, -segment_lanes

  return _LANES * min(range(fewest, most + 1), key=padding_then_count)


def column_select(
  grads: jax.Array,
  tracked_index: jax.Array | None = None,
  tracked_offset: jax.Array | None = None,
  *,
  keep: int = 1,
  implementation: dispatch.Implementation = None,
  segment_width: int | None = None,
) -> ColumnSelection:
  """Each row's ``keep`` largest entries of ``|grads + tracked offsets|``.

  .. math::

    u_{r, j} = g_{r, j} + \\sum_s [j = c_{r, s}] \\, o_{r, s}, \\qquad
    \\text{index}_{r, :} = \\operatorname{top\\text{-}keep}_j |u_{r, j}|,

  by decreasing ``|u|``, ties toward the lower column (module docstring).

  Args:
    grads: ``[*rows, width]`` floating array, one or more row axes (a Flax
      ``(in, out)`` kernel's gradient: row ``r`` is the torch column of input
      feature ``r``; a leading axis is kept as it is, so the partitioner
      keeps it split as the caller's).
    tracked_index: ``[*rows, t]`` integer columns in ``[0, width)``, distinct
      within a row; ``None`` (with ``tracked_offset``) for no tracked entries.
    tracked_offset: ``[*rows, t]`` offsets added to ``grads`` at
      ``tracked_index``. With ``keep = 1`` and one tracked entry, XLA may
      recompute ``u`` in each of the two reductions: if the offset is an
      inexact product computed in the same jit, XLA may fuse it into the add
      as an FMA in one reduction and not the other, and a row's largest
      would then match no entry. Pass offsets whose product is exact (TACO
      rounds its momentum weight to bfloat16) or computed outside the jit.
    keep: columns returned per row, in ``[1, width]``.
    implementation: ``None`` (auto), ``"xla"``, ``"pallas"`` or
      ``"interpret"``. ``None`` picks the Pallas kernel on a Hopper-or-newer
      GPU where it supports the input, XLA otherwise; ``"pallas"`` and
      ``"interpret"`` raise for what the kernel cannot do (``keep`` above
      ``MAX_SEGMENT_WIDTH``, float64).
    segment_width: the kernel's row segment, a multiple of 128 and at least
      ``keep``; ``None`` picks ``default_segment_width(width, keep)``. Rows
      are zero padded to whole segments (padding is never selected).

  Returns:
    A ``ColumnSelection``: ``index`` (int32) and ``value = u[r, index]``
    (float32), both ``[*rows, keep]``.

  Raises:
    ValueError: for a ``grads`` of fewer than 2 axes or not floating, tracked
      arrays of another shape than ``[*rows, t]`` or given alone, ``keep`` or
      ``segment_width`` out of range, an unknown ``implementation``, or a
      Pallas implementation asked for what the kernel does not support.

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
  if segment_width is not None:
    hint = f" (a multiple of {_LANES}, at least keep)"
    segment_width = static_args.check_int("segment_width", segment_width, keep, hint=hint)
    if segment_width % _LANES:
      raise ValueError(f"segment_width must be a multiple of {_LANES}; got {segment_width}.")

  kernel_segment_width = segment_width or default_segment_width(width, keep)
  unsupported = None
  if kernel_segment_width is None:
    unsupported = f"keep must be at most {MAX_SEGMENT_WIDTH} for the Pallas kernel; got {keep}."
  elif grads.dtype.itemsize > 4:
    unsupported = f"grads must be at most 32-bit for the Pallas kernel; got {grads.dtype}."
  return dispatch.run(
    "column_select",
    implementation,
    lambda resolved: _column_select(
      grads,
      tracked_index,
      tracked_offset,
      keep=keep,
      implementation=resolved,
      segment_width=kernel_segment_width,
    ),
    unsupported=None if unsupported is None else unsupported + " Use implementation='xla'.",
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """TACO's argmax and heavy-hitter merge at LLM widths, fp32 and bf16, one and many segments, rows in parts."""
  cases = (
    # name, rows, width, dtype, tracked, keep
    ("argmax", (4096,), 4096, jnp.bfloat16, 0, 1),
    ("heavy_hitters", (1024,), 4096, jnp.float32, 16, 16),
    # 11008 = 43 * 256: 43 segments of 256, merged by XLA.
    ("heavy_hitters_segmented", (512,), 11008, jnp.bfloat16, 16, 16),
    # TACO's default: rows of 4096 in 16 parts of one heavy hitter each.
    ("one_per_part", (1024, 16), 256, jnp.bfloat16, 1, 1),
  )
  examples = []
  for name, rows, width, dtype, tracked, keep in cases:
    args = (jax.ShapeDtypeStruct((*rows, width), dtype),)
    if tracked:
      args += (
        jax.ShapeDtypeStruct((*rows, tracked), jnp.int16),
        jax.ShapeDtypeStruct((*rows, tracked), jnp.float32),
      )
    examples.append(
      _backend.LoweringExample(
        name=f"column_select_{name}_{width}_{jnp.dtype(dtype).name}",
        backend=_backend.MOSAIC_GPU_CALL,
        fn=functools.partial(column_select, keep=keep, implementation="pallas"),
        args=args,
      )
    )
  return examples
