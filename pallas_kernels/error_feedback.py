r"""MicroAdam's error feedback: decode and add, select, re-encode.

MicroAdam keeps what its top-k left out of the gradient as 4-bit codes
``q`` (``pallas_kernels.quantize``'s min/max bucket format) and, each step,

.. math::
  a = y + \mathrm{dequantize}(q), \qquad
  (I, V) = \text{block-top-}k(|a|), \qquad
  q' = \mathrm{quantize}(a \text{ with } a_I = 0),

two ops, each with a plain reference, an XLA path and a kernel:

* ``feedback_topk``: ``a`` and its block top-k, with the selection, order
  and ties of ``topk.block_topk`` (block-local indices ascending within a
  block, ties toward the lower index). XLA: ``quantize.dequantize_add``
  then ``topk.block_topk``; XLA fuses the decoding into the top-k's reads,
  but its exact two-stage top-k reads ``y`` and the codes twice (group
  maxima, then the candidate groups) and sorts. Triton kernel
  (``pl.pallas_call``), one program per full block held in registers
  (Mosaic GPU has no prefix sum, which compaction needs): it decodes and
  adds, finds the k-th largest magnitude key ``T`` by a 31-step bisection
  on the key bits (``kth_largest_key``), takes the keys above ``T`` and the
  first ``k - #{key > T}`` keys equal to it in index order
  (``chosen_by_threshold``), and writes their indices and values at slots
  given by a prefix sum: ``y`` and the codes are read once. A tail block
  (``d mod block_size`` elements) takes the XLA path. ``block_size`` and
  ``bucket_size`` must be powers of two (Triton's block shapes),
  ``block_size >= 256`` a multiple of ``bucket_size``.
* ``requantize_unselected``: ``q'``. XLA: ``quantize.dequantize_add``,
  ``zero_selected``, ``quantize.quantize``. Mosaic GPU kernel
  (``plgpu.kernel``), one program per bucket of whole 256-element rows: it
  decodes ``a`` and zeroes the selection in each of its two passes over the
  bucket (statistics, then codes and packing), so no float32 ``a`` is
  written, and rewrites the codes in place. Its wrapper pads the input to
  whole buckets (the padding masked out of the statistics) and repacks a
  short last row with the packing module's tail rule, so both paths give
  the same bytes; that padding and repacking are XLA copies outside the
  kernel when the size is not a whole number of buckets or rows. Both
  paths zero the selection by position, from a bitmap of its indices
  (``selection_bitmap``, one bit per element, built by XLA), never by
  comparing ``a`` with the selected values: which entries are zeroed does
  not depend on how a program rounds ``a``.

``implementation=``: ``None`` (``pallas_kernels.dispatch``: the kernel in a
program lowered for a Hopper-or-newer GPU, XLA elsewhere), ``"xla"``,
``"pallas"`` or ``"interpret"`` (the kernel in its interpreter on the CPU).

References:
  Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
  Overhead and Provable Convergence", NeurIPS 2024,
  https://arxiv.org/abs/2405.15593 (``asymm_block_quant`` in
  IST-DASLab/ISTA-DASLab-Optimizers-CUDA).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, dispatch, microadam_update, packing, quantize, static_args, topk

# Elements per kernel row: one packed 4-bit row, two planes of ``packing.PLANE_WIDTH``.
_ROW = quantize.ROW
# Keys are non-negative int32: bisecting bits 30 .. 0 reaches every key.
_KEY_BITS = 31
_GRID_AXIS = "blocks"


# -- the selection rule, on magnitude keys (``topk.magnitude_key``) -----------


def kth_largest_key(count_at_least: Callable[[jax.Array], jax.Array], k: int) -> jax.Array:
  """The k-th largest magnitude key, by bisection on its bits from the top down.

  Keeps the largest ``T`` with ``count_at_least(T) = #{key >= T} >= k``, by
  31 counts over what the caller holds (``feedback_topk``'s kernel: a block
  in registers); shifts are on uint32.
  """

  def bisect(step, threshold):
    bit = lax.shift_left(jnp.uint32(1), (_KEY_BITS - 1 - step).astype(jnp.uint32))
    candidate = threshold + bit.astype(jnp.int32)
    return jnp.where(count_at_least(candidate) >= k, candidate, threshold)

  return lax.fori_loop(0, _KEY_BITS, bisect, jnp.int32(0))


def chosen_by_threshold(keys: jax.Array, threshold: jax.Array, ties: jax.Array) -> jax.Array:
  """The selection along the last axis: keys above ``threshold``, and the first ``ties`` keys equal to it.

  ``threshold`` is the k-th largest key and ``ties = k - #{key > threshold}``
  (broadcast against ``keys``); ties go to the lower index.
  """
  at_threshold = keys == threshold
  tie_rank = jnp.cumsum(at_threshold.astype(jnp.int32), axis=-1)
  return (keys > threshold) | (at_threshold & (tie_rank <= ties))


# -- the selection as a bitmap: zeroing by position ---------------------------

# Elements per byte row of a selection bitmap: four rows of ``_ROW``, each
# element one bit of the byte its lane reads.
_BITMAP_GROUP = 4 * _ROW


def _check_selection(indices: jax.Array, values: jax.Array, *, size: int, density: float, block_size: int) -> None:
  expected = (topk.selection_size(size, density=density, block_size=block_size),)
  if jnp.shape(indices) != expected or jnp.shape(values) != expected:
    raise ValueError(
      f"indices and values must have shape {expected}, as block_topk returns for"
      f" x of size {size}, density={density}, block_size={block_size}; got"
      f" {jnp.shape(indices)} and {jnp.shape(values)}."
    )


def selection_bitmap(indices: jax.Array, *, size: int, density: float, block_size: int) -> jax.Array:
  """The positions of a block-major top-k selection, one bit per element, in the kernel's lane order.

  Element ``p`` is bit ``(p // 128) mod 8`` of byte ``[p // 1024, p mod 128]``:
  a byte row covers four rows of 256 elements, and each of its 128 bytes
  holds the bits of one lane (one of ``requantize_unselected``'s kernel
  threads) in those rows' eight half rows, so that the kernel reads a row
  of bytes and shifts, without gathering across lanes.

  Args:
    indices: the block-local indices ``block_topk`` returned, block-major,
      distinct within a block (then the adds that set the bits are ors).
    size: elements covered; the bitmap has ``ceil(size / 1024)`` byte rows.
    density: fraction of each block kept, as given to ``block_topk``.
    block_size: elements per block, as given to ``block_topk``.

  Returns:
    A uint8 array ``[ceil(size / 1024), 128]``; positions at or past the
    rows' end are dropped.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.error_feedback import selection_bitmap
    >>> # One entry per block of 512: positions 1, 512 + 129 and 1024 + 0.
    >>> bitmap = selection_bitmap(jnp.array([1, 129, 0], jnp.int16), size=1100, density=1 / 512, block_size=512)
    >>> bitmap.shape, bitmap[0, :2].tolist(), bitmap[1, 0].tolist()  # 641 is lane 1's bit 5 of row 0
    ((2, 128), [0, 33], 1)
  """
  positions = microadam_update.flat_positions(indices, k=topk.entries_kept(block_size, density), block_size=block_size)
  byte = positions // _BITMAP_GROUP * packing.PLANE_WIDTH + positions % packing.PLANE_WIDTH
  bit = lax.shift_left(jnp.uint8(1), (positions // packing.PLANE_WIDTH % 8).astype(jnp.uint8))
  rows = -(-size // _BITMAP_GROUP)
  bitmap = jnp.zeros((rows * packing.PLANE_WIDTH,), jnp.uint8).at[byte].add(bit, mode="drop")
  return bitmap.reshape(rows, packing.PLANE_WIDTH)


def _selected(bitmap: jax.Array, size: int) -> jax.Array:
  """The first ``size`` positions of a ``selection_bitmap`` as booleans, by broadcasts XLA fuses into the reader."""
  bits = bitmap[:, None, :] >> jnp.arange(8, dtype=jnp.uint8)[None, :, None]
  return (bits & jnp.uint8(1)).reshape(-1)[:size] != 0


@functools.partial(jax.jit, static_argnames=("density", "block_size"))
def _zero_selected(x: jax.Array, indices: jax.Array, *, density: float, block_size: int) -> jax.Array:
  selected = _selected(selection_bitmap(indices, size=x.size, density=density, block_size=block_size), x.size)
  # A select over x itself rather than a scatter of zeros, for which XLA
  # would copy x into a new buffer; SPMD partitioning shards it like x.
  return jnp.where(selected.reshape(x.shape), jnp.zeros((), x.dtype), x)


def zero_selected(x: jax.Array, indices: jax.Array, values: jax.Array, *, density: float, block_size: int) -> jax.Array:
  """``x`` with the entries at a block top-k selection's positions set to 0.

  .. math::
    x_{bD + i} \\leftarrow 0 \\quad \\text{for each selected } (b, i),

  ``D = block_size``, the positions read from ``indices`` alone (through
  ``selection_bitmap``): the values are not compared with ``x``, so which
  entries are zeroed does not depend on how ``x`` was rounded when it was
  ranked. For ``(indices, values) = block_topk(x, ...)`` these are the
  entries ``block_topk`` selected.

  Args:
    x: a float array (any shape; flattened).
    indices: block-local indices, block-major, as ``block_topk`` returns
      them for an array of ``x.size`` elements.
    values: the values ``block_topk`` returned with them; only their shape
      is checked.
    density: fraction of each block kept, as given to ``block_topk``.
    block_size: elements per block, as given to ``block_topk``.

  Returns:
    ``x`` with the selected entries replaced by 0, same shape and dtype.

  Raises:
    ValueError: for ``density`` or ``block_size`` out of range, a non-float
      ``x``, or ``indices`` and ``values`` not of the selection's size.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.error_feedback import zero_selected
    >>> from pallas_kernels.topk import block_topk
    >>> x = jnp.array([0.5, -3., 1., 2., -0.25, 4., 0., -1., 7., -7.])
    >>> indices, values = block_topk(x, density=0.5, block_size=4)
    >>> zero_selected(x, indices, values, density=0.5, block_size=4).tolist()
    [0.5, 0.0, 1.0, 0.0, -0.25, 0.0, 0.0, 0.0, 0.0, -7.0]
  """
  density, block_size = topk.check_block_params(density, block_size)
  x = topk.float_array(x)
  _check_selection(indices, values, size=x.size, density=density, block_size=block_size)
  if x.size == 0:
    return x
  return _zero_selected(x, indices, density=density, block_size=block_size)


# -- feedback_topk: a = y + dequantize(q) and its block top-k ----------------


def feedback_topk_reference(
  q: quantize.QuantizedArray,
  y: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int,
  bucket_size: int,
) -> tuple[jax.Array, jax.Array]:
  """``feedback_topk`` in plain jnp: the quantizer's and the top-k's references, composed."""
  flat = jnp.asarray(y).reshape(-1)
  codes = packing.unpack(q.codes, flat.size, base=2**bits, planes=8 // bits)
  decoded = quantize.dequantize_reference(codes, q.minimum, q.maximum, bits=bits, bucket_size=bucket_size)
  return topk.block_topk_reference(flat.astype(jnp.float32) + decoded, density=density, block_size=block_size)


def _kernel(y_ref, codes_ref, min_ref, max_ref, indices_ref, values_ref, *, k, bits, bucket_size, discard):
  """One block: ``a = y + decode(codes)``, its top ``k`` by magnitude key, compacted in index order.

  refs: y ``[1, rows, 256]``, codes ``[1, rows, 256 * bits / 8]``, minimum
  and maximum ``[1, buckets per block]``; the outputs indices and values
  ``[blocks * k + 1]``, block ``b`` at ``[b k, (b + 1) k)``. Entries not
  taken are written to the last element, ``discard``, which the wrapper
  drops: Pallas' interpreter ignores the mask of a scattering store.
  """
  block = pl.program_id(0)
  rows = y_ref.shape[1]
  position = lax.broadcasted_iota(jnp.int32, (rows * _ROW,), 0)
  row, lane = position // _ROW, position % _ROW
  if bits == 4:
    byte = codes_ref[0, row, lane % packing.PLANE_WIDTH].astype(jnp.uint32)
    code = jnp.where(lane < packing.PLANE_WIDTH, byte % jnp.uint32(16), byte // jnp.uint32(16))
  else:
    code = codes_ref[0, row, lane].astype(jnp.uint32)
  bucket = position // bucket_size
  decoded = quantize.decode_values(code, min_ref[0, bucket], max_ref[0, bucket], bits=bits)
  x = y_ref[0].reshape(rows * _ROW).astype(jnp.float32) + decoded
  key = topk.magnitude_key(x)
  threshold = kth_largest_key(lambda candidate: jnp.sum((key >= candidate).astype(jnp.int32)), k)
  ties = k - jnp.sum((key > threshold).astype(jnp.int32))
  chosen = chosen_by_threshold(key, threshold, ties)
  slot = jnp.where(chosen, block * k + jnp.cumsum(chosen.astype(jnp.int32)) - 1, discard)
  indices_ref[slot] = position
  values_ref[slot] = x


def _pallas_full_blocks(q, flat, *, full_blocks, k, block_size, bits, bucket_size, interpret):
  """The kernel over the first ``full_blocks`` blocks: int32 indices and float32 values, ``[full_blocks * k]``."""
  from jax.experimental.pallas import triton as pltriton

  rows = block_size // _ROW
  row_bytes = _ROW * bits // 8
  buckets = block_size // bucket_size
  y = flat[: full_blocks * block_size].reshape(full_blocks, rows, _ROW)
  codes = q.codes[: full_blocks * rows * row_bytes].reshape(full_blocks, rows, row_bytes)
  minimum, maximum = (s[: full_blocks * buckets].reshape(full_blocks, buckets) for s in (q.minimum, q.maximum))
  discard = full_blocks * k
  entries = functools.partial(jax.ShapeDtypeStruct, (discard + 1,))
  kernel = pl.pallas_call(
    functools.partial(_kernel, k=k, bits=bits, bucket_size=bucket_size, discard=discard),
    out_shape=(entries(jnp.int32), entries(jnp.float32)),
    grid=(full_blocks,),
    in_specs=[
      pl.BlockSpec((1, rows, _ROW), lambda b: (b, 0, 0)),
      pl.BlockSpec((1, rows, row_bytes), lambda b: (b, 0, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
    ],
    out_specs=(pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)),
    # A block's tensors spread over up to 1024 threads, 16 elements each:
    # the block lives in registers, and fewer threads would each hold more
    # of it and spill more.
    compiler_params=pltriton.CompilerParams(num_warps=max(1, min(32, block_size // 512))),
    interpret=interpret,
  )
  indices, values = kernel(y, codes, minimum, maximum)
  return indices[:discard], values[:discard]


@functools.partial(jax.jit, static_argnames=("density", "block_size", "bits", "bucket_size", "implementation"))
def _feedback_topk(q, y, *, density, block_size, bits, bucket_size, implementation):
  flat = y.reshape(-1)
  if implementation == "xla" or flat.size == 0:
    accumulated = quantize.dequantize_add(q, flat.astype(jnp.float32), bits=bits, bucket_size=bucket_size)
    return topk.block_topk(accumulated, density=density, block_size=block_size)
  full_blocks, tail = divmod(flat.size, block_size)
  indices, values = [], []
  if full_blocks:
    kernel_indices, kernel_values = _pallas_full_blocks(
      q,
      flat,
      full_blocks=full_blocks,
      k=topk.entries_kept(block_size, density),
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      interpret=implementation == "interpret",
    )
    indices.append(kernel_indices.astype(static_args.index_dtype(block_size)))
    values.append(kernel_values)
  if tail:
    # Blocks and buckets start on whole packed rows, so the tail's codes and
    # statistics are a quantized array of their own.
    start = full_blocks * block_size
    tail_q = quantize.QuantizedArray(
      q.codes[start * bits // 8 :], q.minimum[start // bucket_size :], q.maximum[start // bucket_size :]
    )
    tail_indices, tail_values = _feedback_topk(
      tail_q,
      flat[start:],
      density=density,
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      implementation="xla",
    )
    indices.append(tail_indices)
    values.append(tail_values)
  return jnp.concatenate(indices), jnp.concatenate(values)


def _kernel_unsupported_reason(y: jax.Array, block_size: int, bucket_size: int) -> str | None:
  def power_of_two(n):
    return n & (n - 1) == 0

  if block_size < _ROW or not power_of_two(block_size):
    return (
      f"block_size must be a power of two of at least {_ROW} for the Triton kernel (its block shapes);"
      f" got {block_size}. Use implementation='xla' for other block sizes."
    )
  if not power_of_two(bucket_size) or block_size % bucket_size:
    return (
      f"bucket_size must be a power of two dividing block_size for the Triton kernel; got bucket_size={bucket_size},"
      f" block_size={block_size}. Use implementation='xla' for other sizes."
    )
  if jnp.dtype(y.dtype).itemsize > 4:
    return f"y must be a float type of at most 32 bits for the Triton kernel; got {y.dtype}. Use implementation='xla'."
  return None


def feedback_topk(
  q: quantize.QuantizedArray,
  y: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int = 4,
  bucket_size: int,
  implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """The block top-k of ``y + dequantize(q)``, ``y`` and the codes read once by the kernel.

  .. math::
    a = y + \\mathrm{dequantize}(q), \\qquad
    S_b = \\operatorname{top\\text{-}keep(n)}_{0 \\le i < n} |a_{bD + i}|,

  computed in float32, each block ``b`` of ``D = block_size`` elements (a
  tail block of ``n = d mod D``) keeping ``keep(n) = min(n, max(1,
  ceil(n * density)))`` entries, ties toward the lower ``i`` (see
  ``topk.block_topk``).

  Args:
    q: the output of ``quantize.quantize`` for ``y.size`` elements.
    y: a float array (float32, bfloat16 or float16) of any shape; flattened.
    density: fraction of each block kept, in ``(0, 1]``.
    block_size: elements per block; the kernel needs a power of two
      ``>= 256``.
    bits: the ``bits`` passed to ``quantize``, 4 or 8.
    bucket_size: the ``bucket_size`` passed to ``quantize``; the kernel
      needs a power of two dividing ``block_size``.
    implementation: ``None`` (the op's default, ``dispatch``), ``"xla"``,
      ``"pallas"`` or ``"interpret"``; the kernel's raise for what it cannot
      do, ``None`` then takes XLA.

  Returns:
    ``(indices, values)`` as ``topk.block_topk(y + dequantize(q))`` returns
    them: block-local indices (int16 for ``block_size <= 32768``),
    block-major and ascending within a block, and the float32 values of
    ``a`` there.

  Raises:
    ValueError: for ``density``, ``block_size``, ``bits`` or
      ``bucket_size`` out of range, a ``q`` that does not match ``y``, a
      non-float ``y``, an unknown ``implementation``, or a kernel asked for
      sizes it does not support.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> from pallas_kernels.error_feedback import feedback_topk
    >>> q = quantize.quantize(jnp.zeros(8), bits=4, bucket_size=32)
    >>> indices, values = feedback_topk(q, jnp.array([0.5, -3., 1., 2., -0.25, 4., 0., -1.]),
    ...                                 density=0.5, block_size=4, bucket_size=32)
    >>> indices, values
    (Array([1, 3, 1, 3], dtype=int16), Array([-3.,  2.,  4., -1.], dtype=float32))

  References:
    Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
    Overhead and Provable Convergence", NeurIPS 2024,
    https://arxiv.org/abs/2405.15593
  """
  density = static_args.check_fraction("density", density)
  block_size = static_args.check_int("block_size", block_size, 1, topk.MAX_BLOCK_SIZE)
  y = jnp.asarray(y)
  if not jnp.issubdtype(y.dtype, jnp.floating):
    raise ValueError(f"y must have a floating dtype; got {y.dtype}.")
  quantize.check_quantized(q, size=y.size, bits=bits, bucket_size=bucket_size)
  return dispatch.run(
    "feedback_topk",
    implementation,
    lambda resolved: _feedback_topk(
      q, y, density=density, block_size=block_size, bits=bits, bucket_size=bucket_size, implementation=resolved
    ),
    unsupported=_kernel_unsupported_reason(y, block_size, bucket_size),
  )


# -- requantize_unselected: a with its selection zeroed, re-encoded ----------


def _store_bucket_statistics(lowest, highest, min_ref, max_ref, b, stats_dtype, bits):
  """In a kernel: bucket ``b``'s minimum and maximum of its elementwise bounds, rounded outward
  to ``stats_dtype`` and stored at ``[b, 0, 0]``; returns the minimum and ``1 / step`` (float32)."""
  minimum = jnp.min(quantize.round_outward(lowest, stats_dtype, upward=False))
  maximum = jnp.max(quantize.round_outward(highest, stats_dtype, upward=True))
  min_ref[b, 0, 0] = minimum.astype(stats_dtype)
  max_ref[b, 0, 0] = maximum.astype(stats_dtype)
  return minimum, quantize.inverse_step(quantize.step_size(minimum, maximum, bits))


class _Blocks(NamedTuple):
  """How the kernel cuts a flat array: ``count`` programs (buckets) of ``rows`` rows of ``_ROW``."""

  count: int
  rows: int
  stats_shape: tuple[int, int, int]  # (count, 1, 1): one minimum and maximum per program.

  @property
  def elements(self) -> int:
    return self.count * self.rows * _ROW


def _blocks(size: int, bucket_size: int) -> _Blocks:
  """One program per bucket; ``bucket_size`` is a multiple of ``_ROW``."""
  count = -(-size // bucket_size)
  return _Blocks(count, bucket_size // _ROW, (count, 1, 1))


def _half(h: int) -> pl.Slice:
  return pl.ds(h * packing.PLANE_WIDTH, packing.PLANE_WIDTH)


def _store_codes(codes_ref: Any, b: jax.Array, r: jax.Array, half_codes: list[jax.Array], bits: int) -> None:
  """Writes the codes of a row's two halves as that row's packed bytes."""
  planes = 8 // bits
  for group in range(2 // planes):
    codes_ref[b, r, _half(group)] = packing.combine_planes(half_codes[group * planes : (group + 1) * planes], 2**bits)


def _load_codes(codes_ref: Any, b: jax.Array, r: jax.Array, bits: int) -> list[jax.Array]:
  """The codes of a row's two halves, from that row's packed bytes."""
  planes = 8 // bits
  half_codes = []
  for group in range(2 // planes):
    half_codes += packing.split_planes(codes_ref[b, r, _half(group)], 2**bits, planes)
  return half_codes


def _requantize_kernel(
  codes_ref: Any,
  min_ref: Any,
  max_ref: Any,
  lanes_ref: Any,
  y_ref: Any,
  bitmap_ref: Any,
  valid_ref: Any,
  codes_out_ref: Any,
  min_out_ref: Any,
  max_out_ref: Any,
  *,
  bits: int,
  rows: int,
  stats_dtype: np.dtype,
) -> None:
  """One program: a bucket of ``rows`` rows of ``x = y + decode(codes)``, its selection set to 0, encoded.

  refs: codes ``[buckets, rows, _ROW * bits / 8]``, minimum, maximum
  ``[buckets, 1, 1]``, lanes ``[128]``, y ``[buckets, rows, _ROW]``, the
  selection's ``selection_bitmap`` over the padded rows, and per bucket the
  number of real elements; the outputs codes, minimum and maximum. ``x`` is
  computed in both passes (statistics, then codes), never stored; the
  selection is zeroed by its bits, never judged on ``x``.
  """
  b = lax.axis_index(_GRID_AXIS)
  old_minimum = min_ref[b, 0, 0].astype(jnp.float32)
  old_step_size = quantize.step_size(old_minimum, max_ref[b, 0, 0].astype(jnp.float32), bits)
  valid = valid_ref[b, 0, 0]
  lanes = lanes_ref[...]
  rows_per_byte = _BITMAP_GROUP // _ROW

  def row_values(r):
    """The two halves of row ``r`` of ``x``, selected entries 0, with masks of the real elements."""
    row = b * rows + r
    # Each lane's byte holds its bits of this row's two halves (and of the
    # other rows of its group); 32-bit shifts, which Mosaic GPU has.
    lane_bits = lax.shift_right_logical(
      bitmap_ref[row // rows_per_byte, :].astype(jnp.uint32), (2 * (row % rows_per_byte)).astype(jnp.uint32)
    )
    halves = []
    for h, codes in enumerate(_load_codes(codes_ref, b, r, bits)):
      x = y_ref[b, r, _half(h)].astype(jnp.float32) + quantize.decode(codes, old_minimum, old_step_size)
      position = lanes + (r * _ROW + h * packing.PLANE_WIDTH)
      selected = (lane_bits & jnp.uint32(1 << h)) != 0
      halves.append((jnp.where(selected, 0.0, x), position < valid))
    return halves

  def widen(r, bounds):
    for x, real in row_values(r):
      if bounds is None:  # The first half of row 0 (element 0 is real).
        bounds = (x, x)
      bounds = (
        jnp.minimum(bounds[0], jnp.where(real, x, jnp.inf)),
        jnp.maximum(bounds[1], jnp.where(real, x, -jnp.inf)),
      )
    return bounds

  # Elementwise bounds over the rows, then one reduction per bucket.
  lowest, highest = lax.fori_loop(1, rows, widen, widen(0, None))
  minimum, inverse_step = _store_bucket_statistics(lowest, highest, min_out_ref, max_out_ref, b, stats_dtype, bits)

  def write_row(r, carry):
    codes = [quantize.encode(x, minimum, inverse_step, bits) for x, _ in row_values(r)]
    _store_codes(codes_out_ref, b, r, codes, bits)
    return carry

  lax.fori_loop(0, rows, write_row, 0)


def _kernel_rows_to_packed(row_bytes: jax.Array, size: int, bits: int) -> jax.Array:
  """Kernel bytes (every row full) to ``packing.pack``'s layout of ``size`` codes.

  Full packed rows are identical; the bytes of a last, short row are repacked
  by the packing module's tail rule, dropping the codes of the padding.
  """
  codes_per_row = 8 // bits * packing.PLANE_WIDTH
  full_rows, tail = divmod(size, codes_per_row)
  body = row_bytes[: full_rows * packing.PLANE_WIDTH]
  if not tail:
    return body
  last = row_bytes[full_rows * packing.PLANE_WIDTH : (full_rows + 1) * packing.PLANE_WIDTH]
  last = packing.unpack(last, codes_per_row, base=2**bits, planes=8 // bits)[:tail]
  return jnp.concatenate([body, packing.pack(last, base=2**bits, planes=8 // bits)])


def _packed_to_kernel_rows(codes: jax.Array, size: int, bits: int, n_bytes: int) -> jax.Array:
  """Inverse of ``_kernel_rows_to_packed``, zero-padded to ``n_bytes``."""
  codes_per_row = 8 // bits * packing.PLANE_WIDTH
  full_rows, tail = divmod(size, codes_per_row)
  parts = [codes[: full_rows * packing.PLANE_WIDTH]]
  if tail:
    last = packing.unpack(codes[full_rows * packing.PLANE_WIDTH :], tail, base=2**bits, planes=8 // bits)
    parts.append(packing.pack(jnp.pad(last, (0, codes_per_row - tail)), base=2**bits, planes=8 // bits))
  row_bytes = jnp.concatenate(parts)
  return jnp.pad(row_bytes, (0, n_bytes - row_bytes.size))


@functools.partial(
  jax.jit, static_argnames=("density", "block_size", "bits", "bucket_size", "stats_dtype", "interpret")
)
def _requantize_pallas(
  q: quantize.QuantizedArray,
  y: jax.Array,
  indices: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int,
  bucket_size: int,
  stats_dtype: np.dtype,
  interpret: bool,
) -> quantize.QuantizedArray:
  size = y.size
  blocks = _blocks(size, bucket_size)
  codes = _packed_to_kernel_rows(q.codes, size, bits, blocks.elements * bits // 8)
  codes = codes.reshape(blocks.count, blocks.rows, _ROW * bits // 8)
  minimum, maximum = (s.reshape(blocks.stats_shape) for s in (q.minimum, q.maximum))
  rows = jnp.pad(y.reshape(-1), (0, blocks.elements - size)).reshape(blocks.count, blocks.rows, _ROW)
  bitmap = selection_bitmap(indices, size=blocks.elements, density=density, block_size=block_size)
  valid = jnp.minimum(size - jnp.arange(blocks.count, dtype=jnp.int32) * bucket_size, bucket_size)
  kernel = _backend.mosaic_gpu_kernel(
    functools.partial(_requantize_kernel, bits=bits, rows=blocks.rows, stats_dtype=stats_dtype),
    out_type=(
      jax.ShapeDtypeStruct(blocks.stats_shape, stats_dtype),
      jax.ShapeDtypeStruct(blocks.stats_shape, stats_dtype),
    ),
    grid=(blocks.count,),
    grid_names=(_GRID_AXIS,),
    interpret=interpret,
    # Each program reads a row of its bucket's codes before writing it.
    in_place=(0,),
  )
  new_codes, new_minimum, new_maximum = kernel(
    codes,
    minimum,
    maximum,
    # Lane indices as an input rather than an iota: Mosaic GPU cannot infer an
    # iota's layout on JAX 0.10, and its interpreter does not run layout_cast.
    jnp.arange(packing.PLANE_WIDTH, dtype=jnp.int32),
    rows,
    bitmap,
    valid.reshape(blocks.stats_shape),
  )
  return quantize.QuantizedArray(
    _kernel_rows_to_packed(new_codes.reshape(-1), size, bits), new_minimum.reshape(-1), new_maximum.reshape(-1)
  )


def requantize_unselected(
  q: quantize.QuantizedArray,
  y: jax.Array,
  indices: jax.Array,
  values: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int = 4,
  bucket_size: int,
  stats_dtype: Any = jnp.float32,
  implementation: dispatch.Implementation = None,
) -> quantize.QuantizedArray:
  r"""``quantize`` of ``x = y + dequantize(q)`` with ``block_topk``'s selection of ``x`` set to 0.

  .. math::

    x = y + \hat{q}, \qquad x_i \leftarrow 0 \;\; (i \in \text{block-top-}k(|x|)), \qquad
    q' = \mathrm{quant}(x),

  the selection given by ``(indices, values) = topk.block_topk(x, ...)``
  (MicroAdam's error feedback: what its top-k left out, re-encoded). The
  kernel decodes ``x`` from ``q`` and ``y`` in each pass over a bucket, so
  no float32 ``x`` is written; it needs buckets of whole rows that do not
  straddle top-k blocks (``block_size`` a multiple of ``bucket_size``).
  Both paths zero the entries at the selection's positions, read from
  ``indices`` alone (a ``selection_bitmap``, one bit per element), and
  never compare ``values`` with their own ``x``: a program that computes
  ``x`` with other rounding than the one that ranked it (a GPU compiler
  contracts the decoding's multiply-add per program) still zeroes exactly
  the selection.

  Args:
    q: the output of ``quantize`` for ``y.size`` elements.
    y: a float array (bfloat16, float16 or float32) of any shape.
    indices: the block-local indices ``block_topk`` returned for ``x`` (float32).
    values: the values ``block_topk`` returned for ``x``; only their shape
      is checked.
    density: fraction of each block kept, as given to ``block_topk``.
    block_size: elements per top-k block, as given to ``block_topk``.
    bits: 4 or 8, as ``q`` was quantized and the result will be.
    bucket_size: elements per bucket of ``q`` and of the result.
    stats_dtype: dtype of the result's minimum and maximum.
    implementation: None (``pallas_kernels.dispatch``: the kernel on a
      Hopper-or-newer GPU, else XLA), ``"xla"``, ``"pallas"`` or
      ``"interpret"`` (the kernel in the Mosaic GPU interpreter, for tests).

  Returns:
    ``quantize.quantize(zero_selected(quantize.dequantize_add(q, y as
    float32), indices, values, ...), ...)``, a ``QuantizedArray`` like ``q``.

  Raises:
    ValueError: for arguments ``quantize``, ``dequantize_add`` or
      ``zero_selected`` refuse, or a Pallas implementation asked for
      buckets the kernel does not take.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import error_feedback, quantize, topk
    >>> q = quantize.quantize(jnp.zeros(512), bits=4, bucket_size=256)
    >>> y = jnp.arange(512.0)
    >>> indices, values = topk.block_topk(y, density=0.5, block_size=256)
    >>> e = error_feedback.requantize_unselected(q, y, indices, values, density=0.5, block_size=256,
    ...                                          bits=4, bucket_size=256)
    >>> e.maximum.tolist()  # the lower half of each block is left
    [127.0, 383.0]
  """
  y = jnp.asarray(y)
  static_args.check_dtype("y", y.dtype, quantize.VALUE_DTYPES)
  stats_dtype = static_args.check_dtype("stats_dtype", stats_dtype, quantize.STATS_DTYPES)
  quantize.check_quantized(q, size=y.size, bits=bits, bucket_size=bucket_size)
  density, block_size = topk.check_block_params(density, block_size)
  _check_selection(indices, values, size=y.size, density=density, block_size=block_size)
  dispatch.check(implementation)
  if y.size == 0:
    return quantize.QuantizedArray(
      jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), stats_dtype), jnp.zeros((0,), stats_dtype)
    )
  unsupported = None
  if bucket_size < _ROW or block_size % bucket_size:
    unsupported = (
      f"the Pallas kernel needs bucket_size a multiple of {_ROW} dividing block_size; got bucket_size={bucket_size},"
      f" block_size={block_size}. Use implementation='xla'."
    )

  def path(resolved: str) -> quantize.QuantizedArray:
    if resolved == "xla":
      x = quantize.dequantize_add(q, y.reshape(-1).astype(jnp.float32), bits=bits, bucket_size=bucket_size)
      x = zero_selected(x, indices, values, density=density, block_size=block_size)
      return quantize.quantize(x, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype)
    return _requantize_pallas(
      q,
      y,
      indices,
      density=density,
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      stats_dtype=stats_dtype,
      interpret=resolved == "interpret",
    )

  return dispatch.run("requantize_unselected", implementation, path, unsupported=unsupported)


def lowering_examples() -> list[_backend.LoweringExample]:
  """Both kernels at MicroAdam's defaults (top-k blocks of 16384, 4-bit buckets of 1024), with a short last block."""
  examples = []
  for dtype in (jnp.float32, jnp.bfloat16):
    size = 4 * 16384 + 1000
    q = quantize.QuantizedArray(
      jax.ShapeDtypeStruct((packing.packed_size(size, 2),), jnp.uint8),
      jax.ShapeDtypeStruct((quantize.num_buckets(size, 1024),), jnp.bfloat16),
      jax.ShapeDtypeStruct((quantize.num_buckets(size, 1024),), jnp.bfloat16),
    )
    fn = functools.partial(feedback_topk, density=0.01, block_size=16384, bucket_size=1024, implementation="pallas")
    examples.append(
      _backend.LoweringExample(
        name=f"feedback_topk_16384_{jnp.dtype(dtype).name}",
        backend=_backend.TRITON_CALL,
        fn=fn,
        args=(q, jax.ShapeDtypeStruct((size,), dtype)),
      )
    )
  size = 2 * 16384 + 1000
  kept = topk.selection_size(size, density=0.01, block_size=16384)
  stats = jax.ShapeDtypeStruct((quantize.num_buckets(size, 1024),), jnp.bfloat16)
  examples.append(
    _backend.LoweringExample(
      "requantize_unselected_4bit_bucket1024",
      _backend.MOSAIC_GPU_CALL,
      functools.partial(
        requantize_unselected,
        density=0.01,
        block_size=16384,
        bits=4,
        bucket_size=1024,
        stats_dtype=jnp.bfloat16,
        implementation="pallas",
      ),
      (
        quantize.QuantizedArray(jax.ShapeDtypeStruct((packing.packed_size(size, 2),), jnp.uint8), stats, stats),
        jax.ShapeDtypeStruct((size,), jnp.float32),
        jax.ShapeDtypeStruct((kept,), jnp.int16),
        jax.ShapeDtypeStruct((kept,), jnp.float32),
      ),
    )
  )
  return examples
