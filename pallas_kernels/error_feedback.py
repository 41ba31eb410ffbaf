r"""MicroAdam's error feedback: decode and add, select, re-encode.

MicroAdam keeps what its top-k left out of the gradient as 4-bit codes
``q`` (``pallas_kernels.quantize``'s min/max bucket format) and, each step,

.. math::
  a = y + \mathrm{dequantize}(q), \qquad
  (I, V) = \text{block-top-}k(|a|), \qquad
  q' = \mathrm{quantize}(a \text{ with } a_I = 0).

One op, ``feedback_step``, computes all three, with a plain reference
(``feedback_step_reference``), an XLA path and a Triton kernel
(``implementation=``: ``None``, ``pallas_kernels.dispatch``: the kernel in a
program lowered for a Hopper-or-newer GPU, XLA elsewhere; ``"xla"``;
``"pallas"``; ``"interpret"``, the kernel in Pallas' interpreter on the CPU).

* XLA path: ``feedback_topk`` (``quantize.dequantize_add`` then
  ``topk.block_topk``: XLA fuses the decoding into the top-k's reads, but
  its exact two-stage top-k reads ``y`` and the codes twice, group maxima
  then the candidate groups, and sorts) and ``requantize_unselected``
  (``dequantize_add``, ``zero_selected``, ``quantize.quantize``: ``y`` and
  the codes read again). Both are public, XLA only.
* Triton kernel (``pl.pallas_call``), one program per full block held in
  registers (Mosaic GPU has no prefix sum, which compaction needs): it
  decodes and adds, finds the k-th largest magnitude key ``T`` by a 31-step
  bisection on the key bits (``kth_largest_key``), takes the keys above
  ``T`` and the first ``k - #{key > T}`` keys equal to it in index order
  (``chosen_by_threshold``), writes their indices and values at slots given
  by a prefix sum, and encodes the block with its selection set to 0, the
  codes and statistics rewritten in place: ``y`` and the codes are read
  once. The selection it zeroes is the one it wrote, from the one ``a`` it
  computed, so no other program's rounding of the decoding can leave a
  selected entry in the error. A tail block (``d mod block_size``
  elements) takes the XLA path. ``block_size`` and ``bucket_size`` must be
  powers of two (Triton's block shapes), ``block_size >= 256`` a multiple
  of ``bucket_size``.

The XLA path zeroes the selection by position, from a bitmap of its indices
(``selection_bitmap``, one bit per element), never by comparing ``a`` with
the selected values: which entries are zeroed does not depend on how a
program rounds ``a``.

References:
  Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
  Overhead and Provable Convergence", NeurIPS 2024,
  https://arxiv.org/abs/2405.15593 (``asymm_block_quant`` in
  IST-DASLab/ISTA-DASLab-Optimizers-CUDA).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, dispatch, microadam_update, packing, quantize, static_args, topk

# Elements per kernel row: one packed 4-bit row, two planes of ``packing.PLANE_WIDTH``.
_ROW = quantize.ROW
# Keys are non-negative int32: bisecting bits 30 .. 0 reaches every key.
_KEY_BITS = 31


# -- the selection rule, on magnitude keys (``topk.magnitude_key``) -----------


def kth_largest_key(count_at_least: Callable[[jax.Array], jax.Array], k: int) -> jax.Array:
  """The k-th largest magnitude key, by bisection on its bits from the top down.

  Keeps the largest ``T`` with ``count_at_least(T) = #{key >= T} >= k``, by
  31 counts over what the caller holds (``feedback_step``'s kernel: a block
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


def _check_selection(indices: jax.Array, values: jax.Array, *, size: int, density: float, block_size: int) -> None:
  expected = (topk.selection_size(size, density=density, block_size=block_size),)
  if jnp.shape(indices) != expected or jnp.shape(values) != expected:
    raise ValueError(
      f"indices and values must have shape {expected}, as block_topk returns for"
      f" x of size {size}, density={density}, block_size={block_size}; got"
      f" {jnp.shape(indices)} and {jnp.shape(values)}."
    )


def selection_bitmap(indices: jax.Array, *, size: int, density: float, block_size: int) -> jax.Array:
  """The positions of a block-major top-k selection, one bit per element: bit ``p mod 8`` of byte ``p // 8``.

  Args:
    indices: the block-local indices ``block_topk`` returned, block-major,
      distinct within a block (then the adds that set the bits are ors).
    size: elements covered; the bitmap has ``ceil(size / 8)`` bytes.
    density: fraction of each block kept, as given to ``block_topk``.
    block_size: elements per block, as given to ``block_topk``.

  Returns:
    A uint8 array ``[ceil(size / 8)]``; positions at or past ``size`` are dropped.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.error_feedback import selection_bitmap
    >>> # One entry per block of 8: positions 1, 8 + 3 and 16 + 0.
    >>> selection_bitmap(jnp.array([1, 3, 0], jnp.int16), size=20, density=1 / 8, block_size=8).tolist()
    [2, 8, 1]
  """
  positions = microadam_update.flat_positions(indices, k=topk.entries_kept(block_size, density), block_size=block_size)
  bit = lax.shift_left(jnp.uint8(1), (positions % 8).astype(jnp.uint8))
  return jnp.zeros((-(-size // 8),), jnp.uint8).at[positions // 8].add(bit, mode="drop")


def _selected(bitmap: jax.Array, size: int) -> jax.Array:
  """The first ``size`` positions of a ``selection_bitmap`` as booleans, by broadcasts XLA fuses into the reader."""
  bits = bitmap[:, None] >> jnp.arange(8, dtype=jnp.uint8)[None, :]
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


# -- the XLA path: the selection, then the error re-encoded ------------------


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


@functools.partial(jax.jit, static_argnames=("density", "block_size", "bits", "bucket_size"))
def _feedback_topk(q, y, *, density, block_size, bits, bucket_size):
  accumulated = quantize.dequantize_add(q, y.reshape(-1).astype(jnp.float32), bits=bits, bucket_size=bucket_size)
  return topk.block_topk(accumulated, density=density, block_size=block_size)


def feedback_topk(
  q: quantize.QuantizedArray,
  y: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int = 4,
  bucket_size: int,
) -> tuple[jax.Array, jax.Array]:
  """The block top-k of ``y + dequantize(q)``: the selection of ``feedback_step``'s XLA path.

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
    block_size: elements per block, in ``[1, 32768]``.
    bits: the ``bits`` passed to ``quantize``, 4 or 8.
    bucket_size: the ``bucket_size`` passed to ``quantize``.

  Returns:
    ``(indices, values)`` as ``topk.block_topk(y + dequantize(q))`` returns
    them: block-local indices (int16 for ``block_size <= 32768``),
    block-major and ascending within a block, and the float32 values of
    ``a`` there.

  Raises:
    ValueError: for ``density``, ``block_size``, ``bits`` or
      ``bucket_size`` out of range, a ``q`` that does not match ``y``, or a
      non-float ``y``.

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
  return _feedback_topk(q, y, density=density, block_size=block_size, bits=bits, bucket_size=bucket_size)


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
) -> quantize.QuantizedArray:
  r"""``quantize`` of ``x = y + dequantize(q)`` with ``block_topk``'s selection of ``x`` set to 0.

  .. math::

    x = y + \hat{q}, \qquad x_i \leftarrow 0 \;\; (i \in \text{block-top-}k(|x|)), \qquad
    q' = \mathrm{quant}(x),

  the selection given by ``(indices, values) = topk.block_topk(x, ...)``
  (MicroAdam's error feedback: what its top-k left out, re-encoded; the
  re-encoding of ``feedback_step``'s XLA path). The entries at the
  selection's positions are zeroed, read from ``indices`` alone (a
  ``selection_bitmap``, one bit per element), never by comparing
  ``values`` with their own ``x``: a program that computes ``x`` with other
  rounding than the one that ranked it (a GPU compiler contracts the
  decoding's multiply-add per program) still zeroes exactly the selection.

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

  Returns:
    ``quantize.quantize(zero_selected(quantize.dequantize_add(q, y as
    float32), indices, values, ...), ...)``, a ``QuantizedArray`` like ``q``.

  Raises:
    ValueError: for arguments ``quantize``, ``dequantize_add`` or
      ``zero_selected`` refuse.

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
  y, density, block_size, stats_dtype = _check_error_arguments(
    q, y, density, block_size, bits, bucket_size, stats_dtype
  )
  _check_selection(indices, values, size=y.size, density=density, block_size=block_size)
  if y.size == 0:
    return _empty_error(stats_dtype)
  return _requantize_unselected(
    q, y, indices, density=density, block_size=block_size, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype
  )


@functools.partial(jax.jit, static_argnames=("density", "block_size", "bits", "bucket_size", "stats_dtype"))
def _requantize_unselected(q, y, indices, *, density, block_size, bits, bucket_size, stats_dtype):
  x = quantize.dequantize_add(q, y.reshape(-1).astype(jnp.float32), bits=bits, bucket_size=bucket_size)
  x = _zero_selected(x, indices, density=density, block_size=block_size)
  return quantize.quantize(x, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype)


# -- feedback_step: the selection and the re-encoded error in one pass -------


def kernel_unsupported_reason(block_size: int, bucket_size: int) -> str | None:
  """Why ``feedback_step``'s kernel cannot take these sizes, naming the argument; ``None`` where it can.

  The kernel's block shapes are Triton's: ``block_size`` a power of two of at
  least 256, ``bucket_size`` a power of two dividing it. MicroAdam refuses an
  ``implementation="pallas"`` it cannot run with this text, when it is built.
  """

  def power_of_two(n):
    return n & (n - 1) == 0

  if block_size < _ROW or not power_of_two(block_size):
    return (
      f"block_size must be a power of two of at least {_ROW} for the Pallas error-feedback kernel (Triton's block"
      f" shapes); got {block_size}. Use implementation='xla' for other block sizes."
    )
  if not power_of_two(bucket_size) or block_size % bucket_size:
    return (
      f"bucket_size must be a power of two dividing block_size for the Pallas error-feedback kernel (Triton's block"
      f" shapes); got bucket_size={bucket_size}, block_size={block_size}. Use implementation='xla' for other sizes."
    )
  return None


def _empty_error(stats_dtype) -> quantize.QuantizedArray:
  """The re-encoded error of an empty tensor."""
  return quantize.QuantizedArray(jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), stats_dtype), jnp.zeros((0,), stats_dtype))


def _check_error_arguments(q, y, density, block_size, bits, bucket_size, stats_dtype):
  """``(y, density, block_size, stats_dtype)`` checked, as both ops that re-encode the error take them."""
  y = jnp.asarray(y)
  static_args.check_dtype("y", y.dtype, quantize.VALUE_DTYPES)
  stats_dtype = static_args.check_dtype("stats_dtype", stats_dtype, quantize.STATS_DTYPES)
  quantize.check_quantized(q, size=y.size, bits=bits, bucket_size=bucket_size)
  density, block_size = topk.check_block_params(density, block_size)
  return y, density, block_size, stats_dtype


def feedback_step_reference(
  q: quantize.QuantizedArray,
  y: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int,
  bucket_size: int,
  stats_dtype: Any = jnp.float32,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
  """``feedback_step`` in plain jnp: the references of the decoding, the top-k and the quantizer, composed.

  Returns the selection as ``topk.block_topk_reference`` does and the new
  error unpacked, as ``quantize.quantize_reference`` returns it.
  """
  flat = jnp.asarray(y).reshape(-1)
  codes = packing.unpack(q.codes, flat.size, base=2**bits, planes=8 // bits)
  decoded = quantize.dequantize_reference(codes, q.minimum, q.maximum, bits=bits, bucket_size=bucket_size)
  accumulated = flat.astype(jnp.float32) + decoded
  indices, values = topk.block_topk_reference(accumulated, density=density, block_size=block_size)
  positions = microadam_update.flat_positions(indices, k=topk.entries_kept(block_size, density), block_size=block_size)
  residual = accumulated.at[positions].set(0.0)
  error = quantize.quantize_reference(residual, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype)
  return indices, values, error


def _step_kernel(
  y_ref,
  codes_ref,
  min_ref,
  max_ref,
  indices_ref,
  values_ref,
  codes_out_ref,
  min_out_ref,
  max_out_ref,
  *,
  k,
  bits,
  bucket_size,
  stats_dtype,
  discard,
):
  """One block: ``a = y + decode(codes)``, its top ``k`` by magnitude key, and ``a`` without them, encoded.

  refs: y ``[1, rows, 256]``, codes ``[1, rows, 256 * bits / 8]``, minimum
  and maximum ``[1, buckets per block]``; the outputs indices and values
  ``[blocks * k + 1]``, block ``b`` at ``[b k, (b + 1) k)`` in index order
  (entries not taken go to the last element, ``discard``, which the wrapper
  drops: Pallas' interpreter ignores the mask of a scattering store), and
  the block's new codes and statistics, shaped like its inputs. The
  selection is zeroed by the same ``chosen`` that wrote it, from the one
  ``a`` this program computed.
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

  residual = jnp.where(chosen, 0.0, x).reshape(-1, bucket_size)
  minimum = quantize.round_outward(jnp.min(residual, axis=1), stats_dtype, upward=False)
  maximum = quantize.round_outward(jnp.max(residual, axis=1), stats_dtype, upward=True)
  inverse = quantize.inverse_step(quantize.step_size(minimum, maximum, bits))
  codes = quantize.encode(residual, minimum[:, None], inverse[:, None], bits).astype(jnp.uint32)
  if bits == 4:
    # A packed row: byte j holds element j (low nibble) and j + 128 (high).
    halves = codes.reshape(rows, 2, packing.PLANE_WIDTH)
    shift = lax.broadcasted_iota(jnp.uint32, halves.shape, 1) * jnp.uint32(4)
    codes = jnp.sum(lax.shift_left(halves, shift), axis=1)
  codes_out_ref[0] = codes.reshape(codes_out_ref.shape[1:]).astype(jnp.uint8)
  min_out_ref[0] = minimum.astype(stats_dtype)
  max_out_ref[0] = maximum.astype(stats_dtype)


def _step_full_blocks(q, flat, *, full_blocks, k, block_size, bits, bucket_size, stats_dtype, interpret):
  """The kernel over the first ``full_blocks`` blocks: int32 indices and float32 values ``[full_blocks * k]``,
  and those blocks' new codes and statistics (flat)."""
  from jax.experimental.pallas import triton as pltriton

  rows = block_size // _ROW
  row_bytes = _ROW * bits // 8
  buckets = block_size // bucket_size
  y = flat[: full_blocks * block_size].reshape(full_blocks, rows, _ROW)
  codes = q.codes[: full_blocks * rows * row_bytes].reshape(full_blocks, rows, row_bytes)
  minimum, maximum = (s[: full_blocks * buckets].reshape(full_blocks, buckets) for s in (q.minimum, q.maximum))
  discard = full_blocks * k
  entries = functools.partial(jax.ShapeDtypeStruct, (discard + 1,))
  # The codes are rewritten in place; the statistics too where their dtype stays.
  aliases = {1: 2} | ({2: 3, 3: 4} if minimum.dtype == stats_dtype else {})
  kernel = pl.pallas_call(
    functools.partial(_step_kernel, k=k, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype, discard=discard),
    out_shape=(
      entries(jnp.int32),
      entries(jnp.float32),
      jax.ShapeDtypeStruct(codes.shape, jnp.uint8),
      jax.ShapeDtypeStruct(minimum.shape, stats_dtype),
      jax.ShapeDtypeStruct(maximum.shape, stats_dtype),
    ),
    grid=(full_blocks,),
    in_specs=[
      pl.BlockSpec((1, rows, _ROW), lambda b: (b, 0, 0)),
      pl.BlockSpec((1, rows, row_bytes), lambda b: (b, 0, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
    ],
    out_specs=(
      pl.BlockSpec(memory_space=pl.ANY),
      pl.BlockSpec(memory_space=pl.ANY),
      pl.BlockSpec((1, rows, row_bytes), lambda b: (b, 0, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
    ),
    input_output_aliases=aliases,
    # A block's tensors spread over up to 1024 threads, 16 elements each:
    # the block lives in registers, and fewer threads would each hold more
    # of it and spill more.
    compiler_params=pltriton.CompilerParams(num_warps=max(1, min(32, block_size // 512))),
    interpret=interpret,
  )
  indices, values, codes, minimum, maximum = kernel(y, codes, minimum, maximum)
  return (
    indices[:discard],
    values[:discard],
    quantize.QuantizedArray(codes.reshape(-1), minimum.reshape(-1), maximum.reshape(-1)),
  )


@functools.partial(
  jax.jit, static_argnames=("density", "block_size", "bits", "bucket_size", "stats_dtype", "implementation")
)
def _feedback_step(q, y, *, density, block_size, bits, bucket_size, stats_dtype, implementation):
  flat = y.reshape(-1)
  full_blocks, tail = divmod(flat.size, block_size)
  if implementation == "xla" or not full_blocks:
    indices, values = _feedback_topk(
      q, flat, density=density, block_size=block_size, bits=bits, bucket_size=bucket_size
    )
    error = _requantize_unselected(
      q,
      flat,
      indices,
      density=density,
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      stats_dtype=stats_dtype,
    )
    return indices, values, error
  indices, values, error = _step_full_blocks(
    q,
    flat,
    full_blocks=full_blocks,
    k=topk.entries_kept(block_size, density),
    block_size=block_size,
    bits=bits,
    bucket_size=bucket_size,
    stats_dtype=stats_dtype,
    interpret=implementation == "interpret",
  )
  indices = indices.astype(static_args.index_dtype(block_size))
  if not tail:
    return indices, values, error
  # Blocks and buckets start on whole packed rows, so the tail's codes and
  # statistics are a quantized array of their own.
  start = full_blocks * block_size
  tail_q = quantize.QuantizedArray(
    q.codes[start * bits // 8 :], q.minimum[start // bucket_size :], q.maximum[start // bucket_size :]
  )
  tail_indices, tail_values, tail_error = _feedback_step(
    tail_q,
    flat[start:],
    density=density,
    block_size=block_size,
    bits=bits,
    bucket_size=bucket_size,
    stats_dtype=stats_dtype,
    implementation="xla",
  )
  return (
    jnp.concatenate([indices, tail_indices]),
    jnp.concatenate([values, tail_values]),
    quantize.QuantizedArray(*(jnp.concatenate(parts) for parts in zip(error, tail_error))),
  )


def feedback_step(
  q: quantize.QuantizedArray,
  y: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int = 4,
  bucket_size: int,
  stats_dtype: Any = jnp.float32,
  implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array, quantize.QuantizedArray]:
  r"""MicroAdam's error feedback in one pass: the block top-k of ``y + dequantize(q)`` and what it left, re-encoded.

  .. math::
    a = y + \mathrm{dequantize}(q), \qquad
    (I, V) = \text{block-top-}k(|a|), \qquad
    q' = \mathrm{quantize}(a \text{ with } a_I = 0),

  in float32; the selection is ``feedback_topk``'s (block-local indices
  ascending within a block, ties toward the lower index) and ``q'`` is
  ``requantize_unselected``'s. The Triton kernel holds a block in
  registers, so ``y`` and the codes are read once and the codes and
  statistics rewritten in place, where the two ops read them twice; a tail
  block (``d mod block_size`` elements) takes the XLA path.

  Args:
    q: the output of ``quantize.quantize`` for ``y.size`` elements.
    y: a float array (float32, bfloat16 or float16) of any shape; flattened.
    density: fraction of each block kept, in ``(0, 1]``.
    block_size: elements per block; the kernel needs a power of two
      ``>= 256``.
    bits: the ``bits`` ``q`` was quantized with, 4 or 8; ``q'`` takes the same.
    bucket_size: elements per bucket of ``q`` and ``q'``; the kernel needs a
      power of two dividing ``block_size``.
    stats_dtype: dtype of ``q'``'s minimum and maximum (default float32).
    implementation: ``None`` (``pallas_kernels.dispatch``: the kernel in a
      program lowered for a Hopper-or-newer GPU, else XLA), ``"xla"``,
      ``"pallas"`` or ``"interpret"`` (the kernel in Pallas' interpreter).

  Returns:
    ``(indices, values, q')``: ``feedback_topk(q, y, ...)`` and
    ``requantize_unselected(q, y, indices, values, ...)``.

  Raises:
    ValueError: for arguments ``feedback_topk`` or ``requantize_unselected``
      refuse, or a kernel asked for sizes it does not support.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> from pallas_kernels.error_feedback import feedback_step
    >>> q = quantize.quantize(jnp.zeros(8), bits=4, bucket_size=32)
    >>> indices, values, error = feedback_step(q, jnp.array([0.5, -3., 1., 2., -0.25, 4., 0., -1.]),
    ...                                        density=0.5, block_size=4, bucket_size=32)
    >>> indices.tolist(), values.tolist(), error.minimum.tolist(), error.maximum.tolist()
    ([1, 3, 1, 3], [-3.0, 2.0, 4.0, -1.0], [-0.25], [1.0])

  References:
    Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
    Overhead and Provable Convergence", NeurIPS 2024,
    https://arxiv.org/abs/2405.15593
  """
  y, density, block_size, stats_dtype = _check_error_arguments(
    q, y, density, block_size, bits, bucket_size, stats_dtype
  )
  if y.size == 0:
    return jnp.zeros((0,), static_args.index_dtype(block_size)), jnp.zeros((0,), jnp.float32), _empty_error(stats_dtype)
  return dispatch.run(
    "feedback_step",
    implementation,
    lambda resolved: _feedback_step(
      q,
      y,
      density=density,
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      stats_dtype=stats_dtype,
      implementation=resolved,
    ),
    unsupported=kernel_unsupported_reason(block_size, bucket_size),
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """The kernel at MicroAdam's defaults (top-k blocks of 16384, 4-bit buckets of 1024, bfloat16 statistics), with
  a short last block, for float32 and bfloat16 gradients."""
  size = 4 * 16384 + 1000
  stats = jax.ShapeDtypeStruct((quantize.num_buckets(size, 1024),), jnp.bfloat16)
  q = quantize.QuantizedArray(jax.ShapeDtypeStruct((packing.packed_size(size, 2),), jnp.uint8), stats, stats)
  fn = functools.partial(
    feedback_step,
    density=0.01,
    block_size=16384,
    bucket_size=1024,
    stats_dtype=jnp.bfloat16,
    implementation="pallas",
  )
  return [
    _backend.LoweringExample(
      name=f"feedback_step_16384_{jnp.dtype(dtype).name}",
      backend=_backend.TRITON_CALL,
      fn=fn,
      args=(q, jax.ShapeDtypeStruct((size,), dtype)),
    )
    for dtype in (jnp.float32, jnp.bfloat16)
  ]
