r"""Blockwise min/max quantization: asymmetric 4-bit and 8-bit codes, and MicroAdam's error feedback re-encoded.

The flattened input is cut into buckets of ``bucket_size`` consecutive
elements (the last one may be shorter). Each bucket keeps its ``min`` and
``max`` (zeros included) and every element becomes a code of ``bits`` bits
(``levels = 2**bits - 1``):

.. math::

  s = (\max - \min) \cdot \mathrm{fl}(1 / levels), \qquad
  q = \mathrm{clip}(\mathrm{round}((x - \min) \cdot (1 / s)), 0, levels),
  \qquad \hat{x} = \min + q \, s,

so :math:`|x - \hat{x}| \le (\max - \min) / (2 \, levels)` up to float32
rounding. A constant bucket (``max == min``) stores ``q = 0`` and decodes
exactly to its ``min``; so does a bucket whose step ``s`` is below the smallest
normal float32, which GPUs flush to zero. Statistics stored in a narrower
dtype than float32 (bfloat16) are rounded outward (``min`` toward -inf, ``max``
toward +inf) and codes are computed against the stored values, so the bound
holds against what is stored. Rounding ``round`` is half to even.

Codes are packed with ``pallas_kernels.packing`` (planar layout: a 4-bit byte
holds element ``j`` and ``j + 128`` of a 256-element row, an 8-bit byte one
code), so ``size`` codes take exactly ``ceil(size * bits / 8)`` bytes.

The division by the step is a multiplication by its reciprocal, computed once
per bucket, and the step is a multiplication by a float32 constant: XLA turns
divisions by a broadcast value into such multiplications anyway, so writing
them out keeps XLA, the interpreter and the GPU kernel bit-identical in codes.

``bucket_size`` is a positive multiple of 256, so that a bucket is whole
packed rows, or 32, 64 or 128, so that buckets tile a 128-element plane.

``quantize``, ``dequantize`` and ``dequantize_add`` are XLA only: XLA fuses
the decoding into its readers (``pallas_kernels/dispatch.py`` says why no
kernel is kept). ``requantize_unselected`` (MicroAdam's error feedback:
``y + dequantize(q)`` with its top-k selection zeroed, re-encoded) has a
Mosaic GPU kernel (``plgpu.kernel``) beside its XLA path: one program per
bucket of whole 256-element rows, which decodes and zeroes in each of its
two passes over the bucket (statistics, then codes and packing) and
rewrites the codes in place. Its wrapper pads the input to whole buckets
(the padding masked out of the statistics) and repacks a short last row
with the packing module's tail rule, so both paths give the same bytes;
that padding and repacking are XLA copies outside the kernel when the size
is not a whole number of buckets or rows.

References:
  Modoranu et al., `MicroAdam: Accurate Adaptive Optimization with Low Space
  Overhead and Provable Convergence <https://arxiv.org/abs/2405.15593>`_, 2024
  (``asymm_block_quant`` in IST-DASLab/ISTA-DASLab-Optimizers-CUDA).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, dispatch, packing, static_args, topk

SUPPORTED_BITS = (4, 8)
# Elements per kernel row: two planes of ``packing.PLANE_WIDTH``, which is one
# packed 4-bit row or two packed 8-bit rows.
ROW = 2 * packing.PLANE_WIDTH
# Bucket sizes below a row: segments of a 128-element plane.
SMALL_BUCKET_SIZES = (32, 64, 128)
_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_STATS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SMALLEST_NORMAL_STEP = float(np.finfo(np.float32).tiny)
_GRID_AXIS = "blocks"


class QuantizedArray(NamedTuple):
  """Packed codes and per-bucket statistics of a flat array."""

  codes: jax.Array  # shape=(ceil(size * bits / 8),), dtype=uint8, planar layout of pallas_kernels.packing.
  minimum: jax.Array  # shape=(n_buckets,), dtype=stats_dtype.
  maximum: jax.Array  # shape=(n_buckets,), dtype=stats_dtype.


# -- validation ---------------------------------------------------------------


def _check_bits(bits: Any) -> None:
  if static_args.check_int("bits", bits, 4, 8) not in SUPPORTED_BITS:
    raise ValueError(f"bits must be 4 or 8; got {bits!r}.")


def _check_bucket_size(bucket_size: Any) -> None:
  bucket_size = static_args.check_int("bucket_size", bucket_size, 1)
  if not (bucket_size in SMALL_BUCKET_SIZES or bucket_size % ROW == 0):
    raise ValueError(
      f"bucket_size must be a positive multiple of {ROW} or one of"
      f" {', '.join(map(str, SMALL_BUCKET_SIZES))}; got {bucket_size!r}."
    )


def _check_size(size: Any) -> None:
  static_args.check_int("size", size, 0)


def _check_dtype(name: str, dtype: Any, allowed: tuple[np.dtype, ...]) -> np.dtype:
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in allowed:
    names = ", ".join(d.name for d in allowed)
    raise ValueError(f"{name} must have one of the dtypes {names}; got {dtype}.")
  return dtype


def num_buckets(size: int, bucket_size: int) -> int:
  """Number of buckets of ``bucket_size`` elements that cover ``size`` elements.

  Args:
    size: number of elements (non-negative).
    bucket_size: elements per bucket: a positive multiple of 256, or 32, 64
      or 128.

  Returns:
    ``ceil(size / bucket_size)``; the last bucket may be shorter.

  Examples:
    >>> from pallas_kernels import quantize
    >>> quantize.num_buckets(1000, 256)
    4
  """
  _check_size(size)
  _check_bucket_size(bucket_size)
  return -(-size // bucket_size)


# -- the arithmetic every implementation shares --------------------------------


def _levels(bits: int) -> int:
  return 2**bits - 1


def _round_outward(values: jax.Array, stats_dtype: np.dtype, *, upward: bool) -> jax.Array:
  """Rounds float32 ``values`` to ``stats_dtype`` toward +inf (or -inf), kept in float32.

  A bfloat16 is the upper half of a float32: clearing the low 16 bits rounds
  toward zero, and one bfloat16 step away from zero fixes the values for which
  that went the wrong way. Integer ops on a vector lower in Mosaic GPU (on
  scalars they do not, on JAX 0.12), and the rounding is monotonic, so kernels
  round elements before reducing and XLA rounds the reduced values: the same.
  """
  if stats_dtype == jnp.float32:
    return values
  bits = lax.bitcast_convert_type(values, jnp.uint32)
  sign_bit = jnp.uint32(0x80000000)
  truncated_wrong_way = (bits < sign_bit) if upward else (bits >= sign_bit)
  inexact = (bits & jnp.uint32(0xFFFF)) != jnp.uint32(0)
  one_step = jnp.where(inexact & truncated_wrong_way, jnp.uint32(0x10000), jnp.uint32(0))
  rounded = (bits & jnp.uint32(0xFFFF0000)) + one_step
  return lax.bitcast_convert_type(rounded, jnp.float32)


def _step(minimum: jax.Array, maximum: jax.Array, bits: int) -> jax.Array:
  return (maximum - minimum) * np.float32(1 / _levels(bits))


def _inverse_step(step: jax.Array) -> jax.Array:
  """``1 / step``, or 0 (every code 0) for a step that is zero or subnormal."""
  safe_step = jnp.where(step >= _SMALLEST_NORMAL_STEP, step, 1.0)
  return jnp.where(step >= _SMALLEST_NORMAL_STEP, 1.0 / safe_step, 0.0)


def _store_bucket_statistics(lowest, highest, min_ref, max_ref, b, stats_dtype, bits):
  """In a kernel: bucket ``b``'s minimum and maximum of its elementwise bounds, rounded outward
  to ``stats_dtype`` and stored at ``[b, 0, 0]``; returns the minimum and ``1 / step`` (float32)."""
  minimum = jnp.min(_round_outward(lowest, stats_dtype, upward=False))
  maximum = jnp.max(_round_outward(highest, stats_dtype, upward=True))
  min_ref[b, 0, 0] = minimum.astype(stats_dtype)
  max_ref[b, 0, 0] = maximum.astype(stats_dtype)
  return minimum, _inverse_step(_step(minimum, maximum, bits))


def _encode(values: jax.Array, minimum: jax.Array, inverse_step: jax.Array, bits: int) -> jax.Array:
  """Codes as float32 integers in ``[0, 2**bits - 1]``."""
  return jnp.clip(jnp.round((values - minimum) * inverse_step), 0, _levels(bits))


def _decode(codes: jax.Array, minimum: jax.Array, step: jax.Array) -> jax.Array:
  return minimum + codes.astype(jnp.float32) * step


def decode_values(codes: jax.Array, minimum: jax.Array, maximum: jax.Array, *, bits: int) -> jax.Array:
  """``min + q * s`` in float32, each code with its bucket's statistics, as every implementation decodes."""
  minimum = minimum.astype(jnp.float32)
  return _decode(codes, minimum, _step(minimum, maximum.astype(jnp.float32), bits))


def _packing_args(bits: int) -> dict[str, int]:
  return {"base": 2**bits, "planes": 8 // bits}


# -- The reference: the formula, element by element ---------------------------


def quantize_reference(
  x: jax.Array, *, bits: int, bucket_size: int, stats_dtype: Any = jnp.float32
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The module docstring's formula in plain jnp: ``(codes, minimum, maximum)``.

  ``codes`` is one uint8 per element of flattened ``x`` (not packed),
  ``minimum`` and ``maximum`` one float32 per bucket, rounded outward to
  ``stats_dtype``. :func:`quantize` returns the same codes, packed.
  """
  flat = x.reshape(-1).astype(jnp.float32)
  n_buckets = num_buckets(flat.size, bucket_size)
  bucket_of = jnp.arange(flat.size) // bucket_size
  minimum = jax.ops.segment_min(flat, bucket_of, n_buckets)
  maximum = jax.ops.segment_max(flat, bucket_of, n_buckets)
  minimum = _round_outward(minimum, np.dtype(stats_dtype), upward=False)
  maximum = _round_outward(maximum, np.dtype(stats_dtype), upward=True)
  inverse_step = _inverse_step(_step(minimum, maximum, bits))
  codes = _encode(flat, minimum[bucket_of], inverse_step[bucket_of], bits)
  return codes.astype(jnp.uint8), minimum, maximum


def dequantize_reference(
  codes: jax.Array, minimum: jax.Array, maximum: jax.Array, *, bits: int, bucket_size: int
) -> jax.Array:
  """``min + q * s`` per element, from unpacked ``codes`` and per-bucket statistics (float32)."""
  bucket_of = jnp.arange(codes.size) // bucket_size
  return decode_values(codes, minimum[bucket_of], maximum[bucket_of], bits=bits)


# -- XLA: the formula on packed rows ------------------------------------------


def _row_planes(
  values: jax.Array, stats: tuple[jax.Array, ...], bucket_size: int, bits: int
) -> list[tuple[jax.Array, tuple[jax.Array, ...]]]:
  """The planes of every packed row of flat ``values``, each with its buckets' stats.

  ``values`` holds whole packed rows (``8 // bits`` planes of 128) and whole
  buckets, ``stats`` one value per bucket. Encoding plane by plane and
  combining the planes is the packed layout directly, and cheaper in XLA
  than encoding every element and then slicing out the planes.
  """
  planes = 8 // bits
  width = packing.PLANE_WIDTH
  if bucket_size >= planes * width:
    rows = values.reshape(-1, bucket_size // (planes * width), planes, width)
    return [(rows[:, :, p], tuple(s[:, None, None] for s in stats)) for p in range(planes)]
  rows = values.reshape(-1, planes, width // bucket_size, bucket_size)
  stats = tuple(s.reshape(-1, planes, width // bucket_size, 1) for s in stats)
  return [(rows[:, p], tuple(s[:, p] for s in stats)) for p in range(planes)]


def _planes_to_packed(planes: list[jax.Array], size: int, bits: int) -> jax.Array:
  """Codes of whole rows, plane by plane, to ``packing.pack``'s bytes of the first ``size``."""
  width = packing.PLANE_WIDTH
  full_rows, tail = divmod(size, len(planes) * width)
  packed = packing.combine_planes(planes, 2**bits).reshape(-1)[: full_rows * width]
  if not tail:
    return packed
  last = jnp.stack([p.reshape(-1, width)[full_rows] for p in planes]).reshape(-1)[:tail]
  return jnp.concatenate([packed, packing.pack(last.astype(jnp.uint8), **_packing_args(bits))])


@functools.partial(jax.jit, static_argnames=("bits", "bucket_size", "stats_dtype"))
def _quantize_xla(x: jax.Array, *, bits: int, bucket_size: int, stats_dtype: np.dtype) -> QuantizedArray:
  flat = x.reshape(-1).astype(jnp.float32)
  n_buckets = num_buckets(flat.size, bucket_size)
  # Whole buckets and whole rows (bucket sizes divide a row or are rows).
  # Repeating the last element keeps the last bucket's min and max; the
  # statistics of whole buckets of padding and the codes of the padding are
  # dropped.
  padding = -flat.size % max(bucket_size, ROW)
  padded = jnp.pad(flat, (0, padding), mode="edge") if padding else flat
  buckets = padded.reshape(-1, bucket_size)
  minimum = _round_outward(buckets.min(axis=1), stats_dtype, upward=False)
  maximum = _round_outward(buckets.max(axis=1), stats_dtype, upward=True)
  inverse_step = _inverse_step(_step(minimum, maximum, bits))
  planes = [
    _encode(plane, low, inverse, bits)
    for plane, (low, inverse) in _row_planes(padded, (minimum, inverse_step), bucket_size, bits)
  ]
  return QuantizedArray(
    _planes_to_packed(planes, flat.size, bits),
    minimum[:n_buckets].astype(stats_dtype),
    maximum[:n_buckets].astype(stats_dtype),
  )


def _unpack_xla(packed: jax.Array, size: int, bits: int) -> jax.Array:
  """``packing.unpack`` written as one broadcast over the planes of each row.

  Code ``p * 128 + j`` of a row is digit ``p`` of byte ``j``: a division and
  a remainder by powers of ``2**bits``, elementwise on a ``[rows, planes,
  128]`` view. Without the planes' concatenation XLA fuses the decoding into
  every reader of the decoded values instead of writing them out.
  """
  base, planes = 2**bits, 8 // bits
  if planes == 1:  # One code per byte, in order.
    return packed
  width = packing.PLANE_WIDTH
  full_rows, tail = divmod(size, planes * width)
  place = (base ** np.arange(planes)).astype(np.uint8)[:, None]
  body = packed[: full_rows * width].reshape(full_rows, 1, width)
  codes = (body // place % np.uint8(base)).reshape(-1)
  if not tail:
    return codes
  # The last, short row has planes of ceil(tail / planes) codes.
  last = packed[full_rows * width :]
  last = (last[None, :] // place % np.uint8(base)).reshape(-1)[:tail]
  return jnp.concatenate([codes, last])


@functools.partial(jax.jit, static_argnames=("size", "bits", "bucket_size"))
def _decode_xla(q: QuantizedArray, *, size: int, bits: int, bucket_size: int) -> jax.Array:
  n_buckets = q.minimum.shape[0]
  codes = _unpack_xla(q.codes, size, bits)
  codes = jnp.pad(codes, (0, n_buckets * bucket_size - size)).reshape(n_buckets, bucket_size)
  minimum = q.minimum.astype(jnp.float32)[:, None]
  step = _step(minimum, q.maximum.astype(jnp.float32)[:, None], bits)
  return _decode(codes, minimum, step).reshape(-1)[:size]


# -- requantize_unselected's Mosaic GPU kernel --------------------------------


class _Blocks(NamedTuple):
  """How the kernel cuts a flat array: ``count`` programs (buckets) of ``rows`` rows of ``ROW``."""

  count: int
  rows: int
  stats_shape: tuple[int, int, int]  # (count, 1, 1): one minimum and maximum per program.

  @property
  def elements(self) -> int:
    return self.count * self.rows * ROW


def _blocks(size: int, bucket_size: int) -> _Blocks:
  """One program per bucket; ``bucket_size`` is a multiple of ``ROW``."""
  count = -(-size // bucket_size)
  return _Blocks(count, bucket_size // ROW, (count, 1, 1))


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
  threshold_ref: Any,
  last_ref: Any,
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

  refs: codes ``[buckets, rows, ROW * bits / 8]``, minimum, maximum
  ``[buckets, 1, 1]``, lanes ``[128]``, y ``[buckets, rows, ROW]``, then per
  bucket the selection's key bound ``T``, its last index ``L`` (bucket-local)
  and the number of real elements; the outputs codes, minimum and maximum.
  ``x`` is computed in both passes (statistics, then codes), never stored.
  """
  b = lax.axis_index(_GRID_AXIS)
  old_minimum = min_ref[b, 0, 0].astype(jnp.float32)
  old_step = _step(old_minimum, max_ref[b, 0, 0].astype(jnp.float32), bits)
  threshold, last, valid = threshold_ref[b, 0, 0], last_ref[b, 0, 0], valid_ref[b, 0, 0]
  lanes = lanes_ref[...]

  def row_values(r):
    """The two halves of row ``r`` of ``x``, selected entries 0, with masks of the real elements."""
    halves = []
    for h, codes in enumerate(_load_codes(codes_ref, b, r, bits)):
      x = y_ref[b, r, _half(h)].astype(jnp.float32) + _decode(codes, old_minimum, old_step)
      position = lanes + (r * ROW + h * packing.PLANE_WIDTH)
      key = topk.magnitude_key(x)
      selected = (key > threshold) | ((key == threshold) & (position <= last))
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
    codes = [_encode(x, minimum, inverse_step, bits) for x, _ in row_values(r)]
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
  last = packing.unpack(last, codes_per_row, **_packing_args(bits))[:tail]
  return jnp.concatenate([body, packing.pack(last, **_packing_args(bits))])


def _packed_to_kernel_rows(codes: jax.Array, size: int, bits: int, n_bytes: int) -> jax.Array:
  """Inverse of ``_kernel_rows_to_packed``, zero-padded to ``n_bytes``."""
  codes_per_row = 8 // bits * packing.PLANE_WIDTH
  full_rows, tail = divmod(size, codes_per_row)
  parts = [codes[: full_rows * packing.PLANE_WIDTH]]
  if tail:
    last = packing.unpack(codes[full_rows * packing.PLANE_WIDTH :], tail, **_packing_args(bits))
    parts.append(packing.pack(jnp.pad(last, (0, codes_per_row - tail)), **_packing_args(bits)))
  row_bytes = jnp.concatenate(parts)
  return jnp.pad(row_bytes, (0, n_bytes - row_bytes.size))


@functools.partial(
  jax.jit, static_argnames=("density", "block_size", "bits", "bucket_size", "stats_dtype", "interpret")
)
def _requantize_pallas(
  q: QuantizedArray,
  y: jax.Array,
  indices: jax.Array,
  values: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int,
  bucket_size: int,
  stats_dtype: np.dtype,
  interpret: bool,
) -> QuantizedArray:
  size = y.size
  blocks = _blocks(size, bucket_size)
  codes = _packed_to_kernel_rows(q.codes, size, bits, blocks.elements * bits // 8)
  codes = codes.reshape(blocks.count, blocks.rows, ROW * bits // 8)
  minimum, maximum = (s.reshape(blocks.stats_shape) for s in (q.minimum, q.maximum))
  rows = jnp.pad(y.reshape(-1), (0, blocks.elements - size)).reshape(blocks.count, blocks.rows, ROW)
  # Per bucket: its block's bound (a bucket lies in one block), the last
  # index relative to the bucket, and how many of its elements are real.
  thresholds, last_ties = topk.selection_bounds(indices, values, size=size, density=density, block_size=block_size)
  start = jnp.arange(blocks.count, dtype=jnp.int32) * bucket_size
  block = start // block_size
  per_bucket = [
    thresholds[block],
    last_ties[block] - (start - block * block_size),
    jnp.minimum(size - start, bucket_size),
  ]
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
    *(x.reshape(blocks.stats_shape) for x in per_bucket),
  )
  return QuantizedArray(
    _kernel_rows_to_packed(new_codes.reshape(-1), size, bits), new_minimum.reshape(-1), new_maximum.reshape(-1)
  )


# -- public entry points -------------------------------------------------------


def quantize(
  x: jax.Array,
  *,
  bits: int = 4,
  bucket_size: int,
  stats_dtype: Any = jnp.float32,
) -> QuantizedArray:
  r"""Quantizes ``x`` (flattened) to ``bits``-bit codes per bucket of ``bucket_size``.

  .. math::

    s_b = (\max_b - \min_b) \cdot \mathrm{fl}(1 / (2^{bits} - 1)), \qquad
    q_i = \mathrm{clip}(\mathrm{round}((x_i - \min_b) \cdot (1 / s_b)), 0, 2^{bits} - 1)

  for element ``i`` in bucket ``b``, where ``min_b`` and ``max_b`` are the
  stored statistics (rounded outward to ``stats_dtype``).

  Args:
    x: a finite float array (bfloat16, float16 or float32) of any shape.
    bits: 4 (16 levels, two codes per byte) or 8 (256 levels, one per byte).
    bucket_size: elements per bucket: a positive multiple of 256, or 32, 64
      or 128. The last bucket may be shorter.
    stats_dtype: dtype of the stored minimum and maximum: float32 or bfloat16.

  Returns:
    A ``QuantizedArray``: ``codes`` (uint8, ``ceil(x.size * bits / 8)``
    bytes, the planar layout of ``pallas_kernels.packing``), ``minimum`` and
    ``maximum`` (``num_buckets(x.size, bucket_size)`` each, ``stats_dtype``).

  Raises:
    ValueError: for an unsupported ``bits``, ``bucket_size``, ``x`` dtype or
      ``stats_dtype``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> x = jnp.linspace(-1.0, 1.0, 300)
    >>> q = quantize.quantize(x, bits=4, bucket_size=256)
    >>> q.codes.shape, q.minimum.shape
    ((150,), (2,))
    >>> y = quantize.dequantize(q, size=300, bits=4, bucket_size=256)
    >>> bool(jnp.all(jnp.abs(y - x) <= (q.maximum - q.minimum).repeat(256)[:300] / 30 + 1e-6))
    True

  References:
    Modoranu et al., `MicroAdam <https://arxiv.org/abs/2405.15593>`_, 2024.
  """
  x = jnp.asarray(x)
  _check_bits(bits)
  _check_bucket_size(bucket_size)
  _check_dtype("x", x.dtype, _INPUT_DTYPES)
  stats_dtype = _check_dtype("stats_dtype", stats_dtype, _STATS_DTYPES)
  if x.size == 0:
    return QuantizedArray(jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), stats_dtype), jnp.zeros((0,), stats_dtype))
  return _quantize_xla(x, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype)


def _check_quantized(q: Any, size: int, bits: int, bucket_size: int) -> None:
  expected_codes = (packing.packed_size(size, 8 // bits),)
  expected_stats = (num_buckets(size, bucket_size),)
  if not isinstance(q, QuantizedArray):
    raise ValueError(f"q must be a QuantizedArray; got {type(q).__name__}.")
  if (
    q.codes.shape != expected_codes
    or q.codes.dtype != jnp.uint8
    or q.minimum.shape != expected_stats
    or q.maximum.shape != expected_stats
    or q.minimum.dtype != q.maximum.dtype
    or q.minimum.dtype not in _STATS_DTYPES
  ):
    raise ValueError(
      f"q does not match size={size}, bits={bits}, bucket_size={bucket_size}:"
      f" expected uint8 codes of shape {expected_codes} and float32 or bfloat16"
      f" minimum and maximum of shape {expected_stats}; got codes"
      f" {q.codes.dtype}{q.codes.shape}, minimum {q.minimum.dtype}{q.minimum.shape},"
      f" maximum {q.maximum.dtype}{q.maximum.shape}."
    )


def check_quantized(q: Any, *, size: int, bits: int, bucket_size: int) -> None:
  """Raises ``ValueError`` naming the culprit unless ``q`` is ``quantize``'s output for ``size`` elements."""
  _check_bits(bits)
  _check_size(size)
  _check_bucket_size(bucket_size)
  _check_quantized(q, size, bits, bucket_size)


def _dequantize_flat(
  q: QuantizedArray,
  y: jax.Array | None,
  *,
  size: int,
  bits: int,
  bucket_size: int,
  dtype: np.dtype,
) -> jax.Array:
  """``y + decoded`` (or ``decoded``) as a flat ``dtype`` array, float32 math."""
  check_quantized(q, size=size, bits=bits, bucket_size=bucket_size)
  if size == 0:
    return jnp.zeros((0,), dtype)
  decoded = _decode_xla(q, size=size, bits=bits, bucket_size=bucket_size)
  if y is not None:
    decoded = y.reshape(-1).astype(jnp.float32) + decoded
  return decoded.astype(dtype)


def dequantize(
  q: QuantizedArray,
  *,
  size: int,
  bits: int = 4,
  bucket_size: int,
  dtype: Any = jnp.float32,
) -> jax.Array:
  r"""Decodes ``q`` into a flat array of ``size`` elements.

  .. math::

    \hat{x}_i = \min_b + q_i \, s_b, \qquad
    s_b = (\max_b - \min_b) \cdot \mathrm{fl}(1 / (2^{bits} - 1))

  computed in float32 and cast to ``dtype``.

  Args:
    q: the output of ``quantize`` for ``size`` elements.
    size: number of elements quantized (``x.size``).
    bits: the ``bits`` passed to ``quantize``.
    bucket_size: the ``bucket_size`` passed to ``quantize``.
    dtype: output dtype: bfloat16, float16 or float32.

  Returns:
    The decoded values, shape ``(size,)``, dtype ``dtype``.

  Raises:
    ValueError: for an unsupported ``bits``, ``size``, ``bucket_size`` or
      ``dtype``, or a ``q`` of other shapes.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> q = quantize.quantize(jnp.full((3, 5), 0.25), bits=8, bucket_size=64)
    >>> quantize.dequantize(q, size=15, bits=8, bucket_size=64)[:3]
    Array([0.25, 0.25, 0.25], dtype=float32)
  """
  dtype = _check_dtype("dtype", dtype, _INPUT_DTYPES)
  return _dequantize_flat(q, None, size=size, bits=bits, bucket_size=bucket_size, dtype=dtype)


def dequantize_add(
  q: QuantizedArray,
  y: jax.Array,
  *,
  bits: int = 4,
  bucket_size: int,
) -> jax.Array:
  """``y + dequantize(q)``: XLA fuses the decoding into the addition (and into the sum's readers).

  The sum is computed in float32 and returned in ``y``'s shape and dtype
  (MicroAdam adds its error feedback to the gradient this way).

  Args:
    q: the output of ``quantize`` for ``y.size`` elements.
    y: a float array (bfloat16, float16 or float32) of any shape.
    bits: the ``bits`` passed to ``quantize``.
    bucket_size: the ``bucket_size`` passed to ``quantize``.

  Returns:
    ``(y.astype(float32) + dequantize(q).reshape(y.shape)).astype(y.dtype)``.

  Raises:
    ValueError: for an unsupported ``bits``, ``bucket_size`` or ``y`` dtype,
      or a ``q`` of other shapes.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> q = quantize.quantize(jnp.full((2, 3), 0.5), bits=4, bucket_size=256)
    >>> quantize.dequantize_add(q, jnp.ones((2, 3)), bits=4, bucket_size=256)
    Array([[1.5, 1.5, 1.5],
           [1.5, 1.5, 1.5]], dtype=float32)
  """
  y = jnp.asarray(y)
  dtype = _check_dtype("y", y.dtype, _INPUT_DTYPES)
  flat = _dequantize_flat(q, y, size=y.size, bits=bits, bucket_size=bucket_size, dtype=dtype)
  return flat.reshape(y.shape)


def requantize_unselected(
  q: QuantizedArray,
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
) -> QuantizedArray:
  r"""``quantize`` of ``x = y + dequantize(q)`` with ``block_topk``'s selection of ``x`` set to 0.

  .. math::

    x = y + \hat{q}, \qquad x_i \leftarrow 0 \;\; (i \in \text{block-top-}k(|x|)), \qquad
    q' = \mathrm{quant}(x),

  the selection given by ``(indices, values) = topk.block_topk(x, ...)``
  (MicroAdam's error feedback: what its top-k left out, re-encoded). The
  kernel decodes ``x`` from ``q`` and ``y`` in each pass over a bucket and
  zeroes the selection by its rank bound (``topk.selection_bounds``), so no
  float32 ``x`` is written; it needs buckets of whole rows that do not
  straddle top-k blocks (``block_size`` a multiple of ``bucket_size``).
  The selection is judged on the kernel's own ``x``: it zeroes exactly the
  selected entries where that ``x`` is bit-equal to the one ``block_topk``
  ranked (in the interpreter it is; a GPU compiler that contracted the
  decoding's multiply-add in one program and not the other could judge an
  entry at a block's threshold differently).

  Args:
    q: the output of ``quantize`` for ``y.size`` elements.
    y: a float array (bfloat16, float16 or float32) of any shape.
    indices: the block-local indices ``block_topk`` returned for ``x`` (float32).
    values: the float32 values ``block_topk`` returned for ``x``.
    density: fraction of each block kept, as given to ``block_topk``.
    block_size: elements per top-k block, as given to ``block_topk``.
    bits: 4 or 8, as ``q`` was quantized and the result will be.
    bucket_size: elements per bucket of ``q`` and of the result.
    stats_dtype: dtype of the result's minimum and maximum.
    implementation: None (``pallas_kernels.dispatch``: the kernel on a
      Hopper-or-newer GPU, else XLA), ``"xla"``, ``"pallas"`` or
      ``"interpret"`` (the kernel in the Mosaic GPU interpreter, for tests).

  Returns:
    ``quantize(topk.zero_selected(dequantize_add(q, y as float32), indices,
    values, ...), ...)``, a ``QuantizedArray`` like ``q``.

  Raises:
    ValueError: for arguments ``quantize``, ``dequantize_add`` or
      ``topk.zero_selected`` refuse, or a Pallas implementation asked for
      buckets the kernel does not take.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize, topk
    >>> q = quantize.quantize(jnp.zeros(512), bits=4, bucket_size=256)
    >>> y = jnp.arange(512.0)
    >>> indices, values = topk.block_topk(y, density=0.5, block_size=256)
    >>> e = quantize.requantize_unselected(q, y, indices, values, density=0.5, block_size=256,
    ...                                    bits=4, bucket_size=256)
    >>> e.maximum.tolist()  # the lower half of each block is left
    [127.0, 383.0]
  """
  y = jnp.asarray(y)
  _check_dtype("y", y.dtype, _INPUT_DTYPES)
  stats_dtype = _check_dtype("stats_dtype", stats_dtype, _STATS_DTYPES)
  _check_bits(bits)
  _check_bucket_size(bucket_size)
  _check_quantized(q, y.size, bits, bucket_size)
  dispatch.check(implementation)
  if y.size == 0:
    return QuantizedArray(jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), stats_dtype), jnp.zeros((0,), stats_dtype))
  unsupported = None
  if bucket_size < ROW or block_size % bucket_size:
    unsupported = (
      f"the Pallas kernel needs bucket_size a multiple of {ROW} dividing block_size; got bucket_size={bucket_size},"
      f" block_size={block_size}. Use implementation='xla'."
    )

  def path(resolved: str) -> QuantizedArray:
    if resolved == "xla":
      x = dequantize_add(q, y.reshape(-1).astype(jnp.float32), bits=bits, bucket_size=bucket_size)
      x = topk.zero_selected(x, indices, values, density=density, block_size=block_size)
      return quantize(x, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype)
    return _requantize_pallas(
      q,
      y,
      indices,
      values,
      density=density,
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      stats_dtype=stats_dtype,
      interpret=resolved == "interpret",
    )

  return dispatch.run("requantize_unselected", implementation, path, unsupported=unsupported)


def lowering_examples() -> list[_backend.LoweringExample]:
  """``requantize_unselected``'s kernel at MicroAdam's defaults, with a short top-k block and bucket."""
  size = 2 * 16384 + 1000
  kept = topk.selection_size(size, density=0.01, block_size=16384)
  stats = jax.ShapeDtypeStruct((num_buckets(size, 1024),), jnp.bfloat16)
  return [
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
        QuantizedArray(jax.ShapeDtypeStruct((packing.packed_size(size, 2),), jnp.uint8), stats, stats),
        jax.ShapeDtypeStruct((size,), jnp.float32),
        jax.ShapeDtypeStruct((kept,), jnp.int16),
        jax.ShapeDtypeStruct((kept,), jnp.float32),
      ),
    )
  ]
