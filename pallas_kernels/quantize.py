r"""Blockwise quantization: asymmetric 4-bit and 8-bit codes (with Mosaic GPU kernels) and map-based codes.

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
them out keeps XLA, the interpreter and the GPU kernels bit-identical in codes.

``bucket_size`` is a positive multiple of 256, so that a bucket is whole
kernel rows, or 32, 64 or 128, so that buckets tile a 128-element plane.

Kernels (Mosaic GPU, ``plgpu.kernel``): one program per bucket when a bucket
spans whole rows of 256 elements (statistics, codes and packing fused: two
passes over the bucket's rows), or per block of ``_SMALL_BUCKET_ROWS`` rows
when several buckets share a row; and one for decoding, optionally fused with
an addition (``y + dequantize(q)``, as MicroAdam adds its error feedback to
the gradient). The wrappers pad the input to whole programs by repeating its
last element (which keeps the last bucket's statistics) and repack a short
last row with the packing module's tail rule, so every implementation gives
the same bytes; that padding and repacking are XLA copies outside the kernels
when the size is not a whole number of programs or rows.

Map-based codes (:func:`map_quantize`, :func:`map_dequantize`, and the
blockwise :func:`map_scales`, :func:`map_encode`, :func:`map_decode` they share with the fused
low-bit AdamW step): each block of ``block_size`` elements keeps its absmax
``s`` (at least ``1e-12``) and each element the index of the entry of a
sorted map nearest to ``x / s`` (bitsandbytes' dynamic maps, a linear map,
:data:`CODE_MAPS`), or ``x / (s / 448)`` as float8 e4m3fn; the nearest
entry costs one table read per element (:func:`nearest_map_code`), and so
does decoding, float8 included (:data:`FLOAT8_VALUES`). These are XLA
ops; their GPU kernel is the fused optimizer step
(``pallas_kernels.lowbit_adamw_update``).

References:
  Modoranu et al., `MicroAdam: Accurate Adaptive Optimization with Low Space
  Overhead and Provable Convergence <https://arxiv.org/abs/2405.15593>`_, 2024
  (``asymm_block_quant`` in IST-DASLab/ISTA-DASLab-Optimizers-CUDA).
  Dettmers et al., `8-bit Optimizers via Block-wise Quantization
  <https://arxiv.org/abs/2110.02861>`_, ICLR 2022 (the map-based codes).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, dispatch, packing, static_args, xla_cpu

SUPPORTED_BITS = (4, 8)
# Elements per kernel row: two planes of ``packing.PLANE_WIDTH``, which is one
# packed 4-bit row or two packed 8-bit rows.
ROW = 2 * packing.PLANE_WIDTH
# Bucket sizes below a row: segments of a 128-element half row, selected by
# masks (Mosaic GPU slices only multiples of 128 elements).
SMALL_BUCKET_SIZES = (32, 64, 128)
# Rows of 256 elements one program handles when buckets are smaller than a row.
_SMALL_BUCKET_ROWS = 8
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


def _encode(values: jax.Array, minimum: jax.Array, inverse_step: jax.Array, bits: int) -> jax.Array:
  """Codes as float32 integers in ``[0, 2**bits - 1]``."""
  return jnp.clip(jnp.round((values - minimum) * inverse_step), 0, _levels(bits))


def _decode(codes: jax.Array, minimum: jax.Array, step: jax.Array) -> jax.Array:
  return minimum + codes.astype(jnp.float32) * step


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
  minimum = minimum.astype(jnp.float32)
  step = _step(minimum, maximum.astype(jnp.float32), bits)
  return _decode(codes, minimum[bucket_of], step[bucket_of])


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
  # Read twice (statistics, then codes): computed once.
  flat = xla_cpu.written_out(x.reshape(-1).astype(jnp.float32))
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


@functools.partial(jax.jit, static_argnames=("size", "bits", "bucket_size"))
def _decode_xla(q: QuantizedArray, *, size: int, bits: int, bucket_size: int) -> jax.Array:
  n_buckets = q.minimum.shape[0]
  codes = packing.unpack(q.codes, size, **_packing_args(bits))
  codes = jnp.pad(codes, (0, n_buckets * bucket_size - size)).reshape(n_buckets, bucket_size)
  minimum = q.minimum.astype(jnp.float32)[:, None]
  step = _step(minimum, q.maximum.astype(jnp.float32)[:, None], bits)
  return _decode(codes, minimum, step).reshape(-1)[:size]


# -- Mosaic GPU kernels ---------------------------------------------------------


class _Blocks(NamedTuple):
  """How the kernels cut a flat array: ``count`` programs of ``rows`` rows of ``ROW``."""

  count: int
  rows: int
  stats_shape: tuple[int, int, int]  # (count, rows or 1, buckets per row or 1)

  @property
  def elements(self) -> int:
    return self.count * self.rows * ROW


def _blocks(size: int, bucket_size: int) -> _Blocks:
  if bucket_size >= ROW:
    rows = bucket_size // ROW
    count = -(-size // bucket_size)
    return _Blocks(count, rows, (count, 1, 1))
  count = -(-size // (_SMALL_BUCKET_ROWS * ROW))
  return _Blocks(count, _SMALL_BUCKET_ROWS, (count, _SMALL_BUCKET_ROWS, ROW // bucket_size))


def _half(h: int) -> pl.Slice:
  return pl.ds(h * packing.PLANE_WIDTH, packing.PLANE_WIDTH)


def _by_segment(segment: jax.Array, per_segment: list[jax.Array]) -> jax.Array:
  """Spreads one scalar per segment over the lanes of a half row."""
  spread = per_segment[-1]
  for s in reversed(range(len(per_segment) - 1)):
    spread = jnp.where(segment == s, per_segment[s], spread)
  return spread


def _store_codes(codes_ref: Any, b: jax.Array, r: jax.Array, half_codes: list[jax.Array], bits: int) -> None:
  """Writes the codes of a row's two halves as that row's packed bytes."""
  planes = 8 // bits
  for group in range(2 // planes):
    codes_ref[b, r, _half(group)] = packing.combine_planes(
        half_codes[group * planes : (group + 1) * planes], 2**bits
    )


def _load_codes(codes_ref: Any, b: jax.Array, r: jax.Array, bits: int) -> list[jax.Array]:
  """The codes of a row's two halves, from that row's packed bytes."""
  planes = 8 // bits
  half_codes = []
  for group in range(2 // planes):
    half_codes += packing.split_planes(codes_ref[b, r, _half(group)], 2**bits, planes)
  return half_codes


def _quantize_kernel(*refs: Any, bits: int, bucket_size: int, rows: int, stats_dtype: np.dtype) -> None:
  """One program: a bucket of ``rows`` rows, or ``rows`` rows of small buckets.

  refs: x ``[blocks, rows, ROW]``, lanes ``[128]`` (small buckets only), then
  the outputs codes ``[blocks, rows, ROW * bits / 8]``, minimum and maximum.
  """
  b = lax.axis_index(_GRID_AXIS)
  if bucket_size >= ROW:
    x_ref, codes_ref, min_ref, max_ref = refs
    first = x_ref[b, 0].astype(jnp.float32)

    def widen(r, bounds):
      row = x_ref[b, r].astype(jnp.float32)
      return jnp.minimum(bounds[0], row), jnp.maximum(bounds[1], row)

    # Elementwise bounds over the rows, then one reduction per bucket.
    lowest, highest = lax.fori_loop(1, rows, widen, (first, first))
    minimum = jnp.min(_round_outward(lowest, stats_dtype, upward=False))
    maximum = jnp.max(_round_outward(highest, stats_dtype, upward=True))
    min_ref[b, 0, 0] = minimum.astype(stats_dtype)
    max_ref[b, 0, 0] = maximum.astype(stats_dtype)
    inverse_step = _inverse_step(_step(minimum, maximum, bits))

    def write_row(r, carry):
      halves = [x_ref[b, r, _half(h)].astype(jnp.float32) for h in range(2)]
      _store_codes(codes_ref, b, r, [_encode(v, minimum, inverse_step, bits) for v in halves], bits)
      return carry

  else:
    x_ref, lanes_ref, codes_ref, min_ref, max_ref = refs
    segment = lanes_ref[...] // bucket_size
    per_half = packing.PLANE_WIDTH // bucket_size

    def write_row(r, carry):
      half_codes = []
      for h in range(2):
        values = x_ref[b, r, _half(h)].astype(jnp.float32)
        lower = _round_outward(values, stats_dtype, upward=False)
        upper = _round_outward(values, stats_dtype, upward=True)
        minima, inverse_steps = [], []
        for s in range(per_half):
          in_segment = segment == s
          minimum = jnp.min(jnp.where(in_segment, lower, jnp.inf))
          maximum = jnp.max(jnp.where(in_segment, upper, -jnp.inf))
          min_ref[b, r, h * per_half + s] = minimum.astype(stats_dtype)
          max_ref[b, r, h * per_half + s] = maximum.astype(stats_dtype)
          minima.append(minimum)
          inverse_steps.append(_inverse_step(_step(minimum, maximum, bits)))
        half_codes.append(
            _encode(values, _by_segment(segment, minima), _by_segment(segment, inverse_steps), bits)
        )
      _store_codes(codes_ref, b, r, half_codes, bits)
      return carry

  lax.fori_loop(0, rows, write_row, 0)


def _decode_kernel(*refs: Any, bits: int, bucket_size: int, rows: int, add: bool) -> None:
  """One program decodes the rows of one block, adding ``y`` when ``add``.

  refs: codes ``[blocks, rows, ROW * bits / 8]``, minimum, maximum, lanes
  ``[128]`` (small buckets only), y ``[blocks, rows, ROW]`` (when ``add``),
  then the output ``[blocks, rows, ROW]``.
  """
  codes_ref, min_ref, max_ref, *refs = refs
  lanes_ref = refs.pop(0) if bucket_size < ROW else None
  y_ref = refs.pop(0) if add else None
  (out_ref,) = refs
  b = lax.axis_index(_GRID_AXIS)
  if bucket_size < ROW:
    segment = lanes_ref[...] // bucket_size
    per_half = packing.PLANE_WIDTH // bucket_size

  def stats(r, h):
    """Minimum and step for the lanes of half ``h`` of row ``r``."""
    if bucket_size >= ROW:
      minimum = min_ref[b, 0, 0].astype(jnp.float32)
      return minimum, _step(minimum, max_ref[b, 0, 0].astype(jnp.float32), bits)
    minima, steps = [], []
    for s in range(per_half):
      minimum = min_ref[b, r, h * per_half + s].astype(jnp.float32)
      minima.append(minimum)
      steps.append(_step(minimum, max_ref[b, r, h * per_half + s].astype(jnp.float32), bits))
    return _by_segment(segment, minima), _by_segment(segment, steps)

  def write_row(r, carry):
    for h, codes in enumerate(_load_codes(codes_ref, b, r, bits)):
      decoded = _decode(codes, *stats(r, h))
      if add:
        decoded = y_ref[b, r, _half(h)].astype(jnp.float32) + decoded
      out_ref[b, r, _half(h)] = decoded.astype(out_ref.dtype)
    return carry

  lax.fori_loop(0, rows, write_row, 0)


def _lanes(bucket_size: int) -> tuple[jax.Array, ...]:
  """Lane indices of a half row, for kernels that split it into buckets.

  An input rather than an iota: Mosaic GPU cannot infer an iota's layout on
  JAX 0.10, and its interpreter does not run ``layout_cast``.
  """
  if bucket_size >= ROW:
    return ()
  return (jnp.arange(packing.PLANE_WIDTH, dtype=jnp.int32),)


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
    jax.jit, static_argnames=("bits", "bucket_size", "stats_dtype", "interpret")
)
def _quantize_pallas(
    x: jax.Array, *, bits: int, bucket_size: int, stats_dtype: np.dtype, interpret: bool
) -> QuantizedArray:
  size = x.size
  blocks = _blocks(size, bucket_size)
  # Repeating the last element keeps the last bucket's min and max; the codes
  # of the padding are dropped.
  rows = jnp.pad(x.reshape(-1), (0, blocks.elements - size), mode="edge")
  rows = rows.reshape(blocks.count, blocks.rows, ROW)
  stats_type = jax.ShapeDtypeStruct(blocks.stats_shape, stats_dtype)
  kernel = _backend.mosaic_gpu_kernel(
      functools.partial(
          _quantize_kernel, bits=bits, bucket_size=bucket_size, rows=blocks.rows, stats_dtype=stats_dtype
      ),
      out_type=(
          jax.ShapeDtypeStruct((blocks.count, blocks.rows, ROW * bits // 8), jnp.uint8),
          stats_type,
          stats_type,
      ),
      grid=(blocks.count,),
      grid_names=(_GRID_AXIS,),
      interpret=interpret,
  )
  codes, minimum, maximum = kernel(rows, *_lanes(bucket_size))
  n_buckets = num_buckets(size, bucket_size)
  return QuantizedArray(
      _kernel_rows_to_packed(codes.reshape(-1), size, bits),
      minimum.reshape(-1)[:n_buckets],
      maximum.reshape(-1)[:n_buckets],
  )


@functools.partial(
    jax.jit, static_argnames=("size", "bits", "bucket_size", "dtype", "interpret")
)
def _decode_pallas(
    q: QuantizedArray,
    y: jax.Array | None,
    *,
    size: int,
    bits: int,
    bucket_size: int,
    dtype: np.dtype,
    interpret: bool,
) -> jax.Array:
  blocks = _blocks(size, bucket_size)
  codes = _packed_to_kernel_rows(q.codes, size, bits, blocks.elements * bits // 8)
  codes = codes.reshape(blocks.count, blocks.rows, ROW * bits // 8)
  n_stats = math.prod(blocks.stats_shape)
  minimum, maximum = (
      jnp.pad(s, (0, n_stats - s.size)).reshape(blocks.stats_shape) for s in (q.minimum, q.maximum)
  )
  addend = ()
  if y is not None:
    addend = (jnp.pad(y.reshape(-1), (0, blocks.elements - size)).reshape(blocks.count, blocks.rows, ROW),)
  kernel = _backend.mosaic_gpu_kernel(
      functools.partial(
          _decode_kernel, bits=bits, bucket_size=bucket_size, rows=blocks.rows, add=y is not None
      ),
      out_type=jax.ShapeDtypeStruct((blocks.count, blocks.rows, ROW), dtype),
      grid=(blocks.count,),
      grid_names=(_GRID_AXIS,),
      interpret=interpret,
  )
  return kernel(codes, minimum, maximum, *_lanes(bucket_size), *addend).reshape(-1)[:size]


# -- public entry points -------------------------------------------------------


def quantize(
    x: jax.Array,
    *,
    bits: int = 4,
    bucket_size: int,
    stats_dtype: Any = jnp.float32,
    implementation: dispatch.Implementation = None,
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
    implementation: None (Pallas on a Hopper-or-newer GPU, else XLA),
      ``"xla"``, ``"pallas"`` or ``"interpret"`` (the Pallas kernel in the
      Mosaic GPU interpreter, for tests).

  Returns:
    A ``QuantizedArray``: ``codes`` (uint8, ``ceil(x.size * bits / 8)``
    bytes, the planar layout of ``pallas_kernels.packing``), ``minimum`` and
    ``maximum`` (``num_buckets(x.size, bucket_size)`` each, ``stats_dtype``).

  Raises:
    ValueError: for an unsupported ``bits``, ``bucket_size``, ``x`` dtype,
      ``stats_dtype`` or ``implementation``.

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
  dispatch.check(implementation)
  if x.size == 0:
    return QuantizedArray(
        jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), stats_dtype), jnp.zeros((0,), stats_dtype)
    )

  def path(resolved: str) -> QuantizedArray:
    if resolved == "xla":
      return _quantize_xla(x, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype)
    return _quantize_pallas(
        x,
        bits=bits,
        bucket_size=bucket_size,
        stats_dtype=stats_dtype,
        interpret=resolved == "interpret",
    )

  return dispatch.run("quantize", implementation, path)


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


def _dequantize_flat(
    q: QuantizedArray,
    y: jax.Array | None,
    *,
    size: int,
    bits: int,
    bucket_size: int,
    dtype: np.dtype,
    implementation: dispatch.Implementation,
) -> jax.Array:
  """``y + decoded`` (or ``decoded``) as a flat ``dtype`` array, float32 math."""
  _check_bits(bits)
  _check_size(size)
  _check_bucket_size(bucket_size)
  _check_quantized(q, size, bits, bucket_size)
  dispatch.check(implementation)
  if size == 0:
    return jnp.zeros((0,), dtype)

  def path(resolved: str) -> jax.Array:
    if resolved == "xla":
      decoded = _decode_xla(q, size=size, bits=bits, bucket_size=bucket_size)
      if y is not None:
        decoded = y.reshape(-1).astype(jnp.float32) + decoded
      return decoded.astype(dtype)
    return _decode_pallas(
        q,
        y,
        size=size,
        bits=bits,
        bucket_size=bucket_size,
        dtype=dtype,
        interpret=resolved == "interpret",
    )

  return dispatch.run("quantize", implementation, path)


def dequantize(
    q: QuantizedArray,
    *,
    size: int,
    bits: int = 4,
    bucket_size: int,
    dtype: Any = jnp.float32,
    implementation: dispatch.Implementation = None,
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
    implementation: None, ``"xla"``, ``"pallas"`` or ``"interpret"`` (see
      ``quantize``).

  Returns:
    The decoded values, shape ``(size,)``, dtype ``dtype``.

  Raises:
    ValueError: for an unsupported ``bits``, ``size``, ``bucket_size``,
      ``dtype`` or ``implementation``, or a ``q`` of other shapes.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> q = quantize.quantize(jnp.full((3, 5), 0.25), bits=8, bucket_size=64)
    >>> quantize.dequantize(q, size=15, bits=8, bucket_size=64)[:3]
    Array([0.25, 0.25, 0.25], dtype=float32)
  """
  dtype = _check_dtype("dtype", dtype, _INPUT_DTYPES)
  return _dequantize_flat(
      q, None, size=size, bits=bits, bucket_size=bucket_size, dtype=dtype, implementation=implementation
  )


def dequantize_add(
    q: QuantizedArray,
    y: jax.Array,
    *,
    bits: int = 4,
    bucket_size: int,
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """``y + dequantize(q)``, fused: one pass reads codes and ``y``, writes the sum.

  The sum is computed in float32 and returned in ``y``'s shape and dtype
  (MicroAdam adds its error feedback to the gradient this way).

  Args:
    q: the output of ``quantize`` for ``y.size`` elements.
    y: a float array (bfloat16, float16 or float32) of any shape.
    bits: the ``bits`` passed to ``quantize``.
    bucket_size: the ``bucket_size`` passed to ``quantize``.
    implementation: None, ``"xla"``, ``"pallas"`` or ``"interpret"`` (see
      ``quantize``).

  Returns:
    ``(y.astype(float32) + dequantize(q).reshape(y.shape)).astype(y.dtype)``.

  Raises:
    ValueError: for an unsupported ``bits``, ``bucket_size``, ``y`` dtype or
      ``implementation``, or a ``q`` of other shapes.

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
  flat = _dequantize_flat(
      q, y, size=y.size, bits=bits, bucket_size=bucket_size, dtype=dtype, implementation=implementation
  )
  return flat.reshape(y.shape)


# -- map-based codes with absmax scales ------------------------------------------
#
# A second family of codes, for optimizer moments (8-bit and 4-bit AdamW):
# each block of ``block_size`` consecutive elements keeps ``scale =
# max(max |x|, 1e-12)`` and each element the index of the entry of a sorted
# map (a table of at most 256 float32 values in [-1, 1]) nearest to
# ``x / scale``; it decodes to ``map[code] * scale``. ``"float8_e4m3fn"``
# instead stores ``x / (scale / 448)`` as a float8 e4m3fn number.

MAP_ZERO_BLOCK_SCALE = 1e-12
FLOAT8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448.
FLOAT8_CODE = "float8_e4m3fn"


def dynamic_map(*, signed: bool, max_exponent_bits: int, total_bits: int) -> np.ndarray:
  r"""The dynamic (tree) quantization map of Dettmers et al., in float64 rounded to float32.

  For each decade ``i = 0, ..., max_exponent_bits - 1`` the map holds
  ``10^{i - max_exponent_bits + 1}`` times the midpoints of ``n_i + 1``
  points spaced evenly over ``[0.1, 1]``, with ``n_i = 2^{i + r}`` (signed,
  with their negatives) or ``2^{i + r + 1}`` (unsigned), ``r = total_bits - 1
  - max_exponent_bits``, plus 0 and 1, sorted. Without a sign bit every
  entry is non-negative and the small ones finer.

  bitsandbytes (``create_dynamic_map``) computes the map in float32 with
  torch's ``linspace``, whose last bit differs from the exact value for some
  entries: the shipped tables (:data:`CODE_MAPS`) are that computation's
  values; this formula is within 2 float32 ulps of them.

  Args:
    signed: whether the map holds negative entries.
    max_exponent_bits: number of decades (7 for 8 bits, 3 for 4 bits).
    total_bits: bits per code; the map has ``2**total_bits`` entries.

  Returns:
    The sorted map, float32, shape ``(2**total_bits,)``.

  Examples:
    >>> from pallas_kernels import quantize
    >>> quantize.dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)[7:10]
    array([0.    , 0.0055, 0.0325], dtype=float32)

  References:
    Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
    2022 (https://arxiv.org/abs/2110.02861).
  """
  precision_bits = total_bits - 1 - max_exponent_bits
  if precision_bits != 0:
    raise ValueError(
        "dynamic_map needs total_bits == max_exponent_bits + 1; got"
        f" total_bits={total_bits}, max_exponent_bits={max_exponent_bits}."
    )
  entries = [0.0, 1.0]
  for i in range(max_exponent_bits):
    items = 2 ** (i + precision_bits + (0 if signed else 1))
    boundaries = np.linspace(0.1, 1.0, items + 1)
    means = 10.0 ** (i - max_exponent_bits + 1) * (boundaries[:-1] + boundaries[1:]) / 2
    entries += list(means) + (list(-means) if signed else [])
  return np.sort(np.array(entries, np.float64)).astype(np.float32)


def _table(hex_bits: str) -> np.ndarray:
  table = np.array([int(word, 16) for word in hex_bits.split()], np.uint32).view(np.float32)
  table.flags.writeable = False
  return table


# The maps bitsandbytes and torchao use, bit for bit (their float32 values as
# hex bits): dynamic_map(signed=True, 7, 8), dynamic_map(signed=False, 7, 8)
# and dynamic_map(signed=True, 3, 4) as computed in float32 by torch.
_DYNAMIC_8BIT_SIGNED_BITS = """
bf7e3333 bf7a999a bf770000 bf736666 bf6fcccd bf6c3333 bf68999a bf650000 bf616666 bf5dcccd
bf5a3333 bf56999a bf530000 bf4f6666 bf4bcccd bf483333 bf44999a bf410000 bf3d6666 bf39cccd
bf363334 bf32999a bf2f0000 bf2b6666 bf27cccd bf243334 bf20999a bf1d0000 bf196666 bf15cccd
bf123334 bf0e999a bf0b0000 bf076666 bf03cccc bf003333 bef93332 bef20000 beeacccc bee3999a
bedc6666 bed53333 bece0000 bec6cccc bebf999a beb86666 beb13333 beaa0000 bea2cccc be9b999a
be946666 be8d3334 be860000 be7d9999 be6f3333 be60cccd be526666 be440000 be35999a be273333
be18cccd be0a6666 bdf80000 bddb3334 bdc9eb85 bdc428f7 bdbe6667 bdb8a3d7 bdb2e148 bdad1eb8
bda75c2a bda1999a bd9bd70a bd96147b bd9051eb bd8a8f5d bd84cccd bd7e147b bd728f5d bd670a3d
bd5b851f bd500000 bd447ae1 bd38f5c3 bd2d70a3 bd21eb85 bd166667 bd0ae148 bcfeb852 bce7ae15
bcd0a3d7 bcb9999a bca28f5d bc8b851f bc68f5c3 bc3ae148 bc1f3b64 bc160418 bc0ccccd bc039581
bbf4bc6a bbe24dd3 bbcfdf3b bbbd70a4 bbab020d bb989374 bb8624dd bb676c8a bb428f5c bb1db22d
baf1a9fc baa7ef9d ba7765ff ba59e83e ba3c6a80 ba1eecc1 ba016f01 b9c7e283 b98ce705 b923d70b
b8ba1f4b b88aefb3 b8378034 b7b24206 b70205ff b65a1a94 b513a3b7 00000000 3513a3b7 365a1a94
370205ff 37b24206 38378034 388aefb3 38ba1f4b 3923d70b 398ce705 39c7e283 3a016f01 3a1eecc1
3a3c6a80 3a59e83e 3a7765ff 3aa7ef9d 3af1a9fc 3b1db22d 3b428f5c 3b676c8a 3b8624dd 3b989374
3bab020d 3bbd70a4 3bcfdf3b 3be24dd3 3bf4bc6a 3c039581 3c0ccccd 3c160418 3c1f3b64 3c3ae148
3c68f5c3 3c8b851f 3ca28f5d 3cb9999a 3cd0a3d7 3ce7ae15 3cfeb852 3d0ae148 3d166667 3d21eb85
3d2d70a3 3d38f5c3 3d447ae1 3d500000 3d5b851f 3d670a3d 3d728f5d 3d7e147b 3d84cccd 3d8a8f5d
3d9051eb 3d96147b 3d9bd70a 3da1999a 3da75c2a 3dad1eb8 3db2e148 3db8a3d7 3dbe6667 3dc428f7
3dc9eb85 3ddb3334 3df80000 3e0a6666 3e18cccd 3e273333 3e35999a 3e440000 3e526666 3e60cccd
3e6f3333 3e7d9999 3e860000 3e8d3334 3e946666 3e9b999a 3ea2cccc 3eaa0000 3eb13333 3eb86666
3ebf999a 3ec6cccc 3ece0000 3ed53333 3edc6666 3ee3999a 3eeacccc 3ef20000 3ef93332 3f003333
3f03cccc 3f076666 3f0b0000 3f0e999a 3f123334 3f15cccd 3f196666 3f1d0000 3f20999a 3f243334
3f27cccd 3f2b6666 3f2f0000 3f32999a 3f363334 3f39cccd 3f3d6666 3f410000 3f44999a 3f483333
3f4bcccd 3f4f6666 3f530000 3f56999a 3f5a3333 3f5dcccd 3f616666 3f650000 3f68999a 3f6c3333
3f6fcccd 3f736666 3f770000 3f7a999a 3f7e3333 3f800000
"""
_DYNAMIC_8BIT_UNSIGNED_BITS = """
00000000 34ae7baa 35500998 360e9b38 3692ccf6 36de4c51 3714e5d5 3783126e 37e171a0 381fe868
384f1800 387e479a 3896bb99 38ae5364 38c5eb31 3906594b 394154ca 397c5049 399ba5e4 39b923a2
39d6a163 39f41f22 3a08ce71 3a178d50 3a264c30 3a350b10 3a43c9ef 3a5288d0 3a6147af 3a70068e
3a7ec56e 3a958106 3aba5e35 3adf3b64 3b020c4a 3b147ae1 3b26e978 3b395810 3b4bc6a7 3b5e3540
3b70a3d7 3b818937 3b8ac082 3b93f7cf 3b9d2f1a 3ba66666 3baf9db2 3bb8d4fd 3bc20c4a 3bcb4395
3bd47ae1 3bddb22e 3be6e978 3bf020c5 3bf9580f 3c0147ae 3c05e354 3c0a7ef9 3c0f1aa0 3c13b645
3c1851eb 3c1ced92 3c218937 3c2f5c2a 3c466667 3c5d70a3 3c747ae2 3c85c28f 3c9147af 3c9ccccd
3ca851eb 3cb3d70b 3cbf5c29 3ccae147 3cd66667 3ce1eb87 3ced70a3 3cf8f5c3 3d023d70 3d080000
3d0dc28f 3d13851f 3d1947af 3d1f0a3d 3d24cccd 3d2a8f5c 3d3051eb 3d36147b 3d3bd70a 3d41999a
3d475c28 3d4d1eb8 3d52e147 3d58a3d7 3d5e6667 3d6428f7 3d69eb87 3d6fae15 3d7570a3 3d7b3333
3d807ae2 3d835c2a 3d863d71 3d891eb8 3d8c0000 3d8ee148 3d91c290 3d94a3d7 3d97851f 3d9a6667
3d9d47af 3da028f6 3da30a3e 3da5eb85 3da8cccd 3dabae15 3dae8f5c 3db170a4 3db451eb 3db73333
3dba147b 3dbcf5c3 3dbfd70b 3dc2b852 3dc5999a 3dc87ae2 3dcb5c29 3dd40000 3de26666 3df0cccd
3dff3333 3e06cccc 3e0e0000 3e153334 3e1c6666 3e23999a 3e2acccc 3e320000 3e393334 3e406666
3e47999a 3e4ecccc 3e560000 3e5d3334 3e646666 3e6b999a 3e72cccc 3e7a0000 3e809999 3e843333
3e87cccd 3e8b6666 3e8f0000 3e92999a 3e963333 3e99cccc 3e9d6666 3ea10000 3ea4999a 3ea83333
3eabcccc 3eaf6666 3eb30000 3eb6999a 3eba3333 3ebdcccc 3ec16666 3ec50000 3ec8999a 3ecc3333
3ecfcccc 3ed36666 3ed70000 3eda999a 3ede3333 3ee1cccc 3ee56666 3ee90000 3eec999a 3ef03333
3ef3cccc 3ef76666 3efb0000 3efe9999 3f01199a 3f02e666 3f04b333 3f068000 3f084ccc 3f0a199a
3f0be666 3f0db334 3f0f8000 3f114ccd 3f13199a 3f14e666 3f16b334 3f188000 3f1a4ccd 3f1c199a
3f1de666 3f1fb334 3f218000 3f234ccd 3f25199a 3f26e666 3f28b334 3f2a8000 3f2c4ccd 3f2e199a
3f2fe666 3f31b334 3f338000 3f354ccd 3f37199a 3f38e666 3f3ab334 3f3c8000 3f3e4ccd 3f40199a
3f41e666 3f43b334 3f458000 3f474ccc 3f49199a 3f4ae666 3f4cb334 3f4e8000 3f504ccc 3f52199a
3f53e666 3f55b334 3f578000 3f594ccc 3f5b199a 3f5ce666 3f5eb334 3f608000 3f624ccc 3f64199a
3f65e666 3f67b334 3f698000 3f6b4ccc 3f6d199a 3f6ee666 3f70b334 3f728000 3f744ccc 3f76199a
3f77e666 3f79b334 3f7b8000 3f7d4ccc 3f7f199a 3f800000
"""
_DYNAMIC_4BIT_SIGNED_BITS = """
bf633333 bf29999a bee00000 be599999 bd9eb852 bd051eb9 bbb43958 00000000 3bb43958 3d051eb9
3d9eb852 3e599999 3ee00000 3f29999a 3f633333 3f800000
"""
CODE_MAPS: dict[str, np.ndarray] = {
    "dynamic_8bit_signed": _table(_DYNAMIC_8BIT_SIGNED_BITS),
    "dynamic_8bit_unsigned": _table(_DYNAMIC_8BIT_UNSIGNED_BITS),
    "dynamic_4bit_signed": _table(_DYNAMIC_4BIT_SIGNED_BITS),
    # Li et al.'s map for the second moment: linear, without zero, so that a
    # small v never decodes to 0 under a square root in a denominator.
    "linear_4bit_unsigned": np.arange(1, 17, dtype=np.float32) / np.float32(16),
}
CODE_MAPS["linear_4bit_unsigned"].flags.writeable = False


class MapQuantized(NamedTuple):
  """Map codes and per-block scales of a flat array."""

  codes: jax.Array  # shape=(size,), dtype=uint8 (a map's index) or float8_e4m3fn.
  scales: jax.Array  # shape=(ceil(size / block_size),), dtype=float32.


def _check_code(code: Any) -> None:
  if code != FLOAT8_CODE and code not in CODE_MAPS:
    names = ", ".join(repr(name) for name in (*CODE_MAPS, FLOAT8_CODE))
    raise ValueError(f"code must be one of {names}; got {code!r}.")


def code_dtype(code: str) -> np.dtype:
  """The dtype of ``code``'s codes: float8_e4m3fn, or uint8 for a map."""
  _check_code(code)
  return jnp.dtype(jnp.float8_e4m3fn if code == FLOAT8_CODE else jnp.uint8)


def map_code_bits(code: str) -> int:
  """Bits a code of ``code`` needs: 4 for a 16-entry map, else 8."""
  _check_code(code)
  return 8 if code == FLOAT8_CODE else int(CODE_MAPS[code].size).bit_length() - 1


def nearest_map_code_reference(values: jax.Array, table: Any) -> jax.Array:
  """Index of the entry of the sorted ``table`` nearest to each of ``values``.

  The reference's branchless binary search, then its rounding: ``code`` is
  the last entry ``<= x`` (0 below the first), then ``code + 1`` when
  ``x - table[code] >= (table[code + 1] - table[code]) * 0.5``. Ties go up,
  and the comparison is made in float32 as written, so the codes are those
  of bitsandbytes and torchao bit for bit. NaN gets 0. Returns integer
  codes: computed in numpy for float32 numpy ``values`` (how
  :func:`nearest_map_code` builds its tables, outside any trace), else in jnp.
  """
  xp = np if isinstance(values, np.ndarray) else jnp
  table = xp.asarray(table, xp.float32)
  size = table.shape[0]
  code = xp.zeros(xp.shape(values), xp.int32)
  step = size // 2
  while step:
    code = code + xp.where(values >= table[code + step], step, 0)
    step //= 2
  up = xp.minimum(code + 1, size - 1)
  below, above = table[code], table[up]
  return xp.where(values - below >= (above - below) * xp.float32(0.5), up, code)


class _BucketLookup(NamedTuple):
  """:func:`nearest_map_code`'s table for one map (see there)."""

  shift: int  # An ordered key >> shift = its bucket.
  entries: np.ndarray  # uint32 per bucket: its first code << 24, plus 2**24 - its code change's offset.


def _ordered_key(bits: Any) -> Any:
  """float32 bits (uint32, numpy or jnp) as uint32 keys in the order of their values.

  Flips every bit of a negative number and the sign bit of a positive one.
  This maps each aligned run of ``2**k`` bit patterns to an aligned run of
  keys.
  """
  xp = np if isinstance(bits, np.ndarray) else jnp
  return bits ^ xp.where(bits >> 31 == 1, xp.uint32(0xFFFFFFFF), xp.uint32(0x80000000))


def _key_value(keys: np.ndarray) -> np.ndarray:
  """The float32 values of ordered keys (the inverse of :func:`_ordered_key`)."""
  keys = keys.astype(np.uint32)
  positive = keys >> np.uint32(31) == 1
  return np.where(positive, keys ^ np.uint32(0x80000000), ~keys).astype(np.uint32).view(np.float32)


# Every float8 e4m3fn number, as float32, indexed by its bits.
FLOAT8_VALUES = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
FLOAT8_VALUES.flags.writeable = False


def _sorted_entries(code: str) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
  """The sorted entries that :func:`nearest_map_code` indexes for ``code``, and
  the rounding that defines the index of a float32 (in numpy).

  For float8, the magnitudes 0 to 448, whose index is their float8 bits, under
  round to nearest even (a float8 code's sign is a bit of its own).
  """
  if code == FLOAT8_CODE:
    magnitudes = FLOAT8_VALUES[:0x7F]  # Bits 0x00 (0) to 0x7E (448); 0x7F is NaN.
    return magnitudes, lambda v: v.astype(jnp.float8_e4m3fn).view(np.uint8)
  table = CODE_MAPS[code]
  return table, lambda v: nearest_map_code_reference(v, table)


@functools.cache
def _bucket_lookup(code: str) -> _BucketLookup:
  """The widest buckets of ordered keys that each hold at most one code change.

  ``thresholds[c]``, the key of the smallest float32 whose code (per
  :func:`_sorted_entries`' rounding) exceeds ``c``, is found by bisection
  between entries ``c`` and ``c + 1`` (codes grow with the value). A bucket
  is the keys sharing their top ``32 - shift`` bits; ``shift`` is the
  largest under which no bucket holds two thresholds, at most 23 so that
  an offset in a bucket plus ``2**24`` cannot carry twice. A bucket without a
  threshold gets the offset ``2**shift``, which no key reaches; NaN keys
  (beyond infinity) get code 0.
  """
  table, rounding = _sorted_entries(code)
  low, high = (_ordered_key(t.view(np.uint32)).astype(np.int64) for t in (table[:-1], table[1:]))
  codes = np.arange(table.size - 1)
  while np.any(high - low > 1):  # Invariant: code(low) <= c < code(high).
    middle = (low + high) // 2
    above = rounding(_key_value(middle)) > codes
    high, low = np.where(above, middle, high), np.where(above, low, middle)
  thresholds = np.append(high, 2**32)  # No code change above the last code.
  for shift in range(23, -1, -1):
    starts = np.arange(2 ** (32 - shift), dtype=np.int64) << shift
    first = np.minimum(np.searchsorted(thresholds, starts, side="right"), table.size - 1)
    nan = np.isnan(_key_value(starts))
    first = np.where(nan, 0, first)
    offsets = np.where(nan, 1 << shift, np.minimum(thresholds[first] - starts, 1 << shift))
    if np.all(nan | (thresholds[np.minimum(first + 1, table.size - 1)] >= starts + (1 << shift))):
      return _BucketLookup(shift, ((first << 24) + (1 << 24) - offsets).astype(np.uint32))
  raise AssertionError(f"no bucketing separates the thresholds of {code}")


def nearest_map_code(values: jax.Array, code: str) -> jax.Array:
  """:func:`nearest_map_code_reference` for a map of :data:`CODE_MAPS`, by one table read.

  For ``code="float8_e4m3fn"``, the float8 bits of non-negative values up to
  448 under round to nearest even (:func:`_sorted_entries`).

  The codes grow with the value, so each code change is a threshold. The
  float32 bits as keys in value order (:func:`_ordered_key`) fall in buckets
  of ``2**shift`` keys that hold at most one threshold each
  (:func:`_bucket_lookup`). A bucket's entry is its first code times
  ``2**24`` plus ``2**24`` minus the offset of its threshold, so adding a
  key's offset in the bucket carries into the code exactly at and above the
  threshold: the code is ``(entry + offset) >> 24``. Equal to the
  reference's for every float32 (tests compare every float32 near each code
  change), for one table read instead of a binary search's ``log2(size) +
  2``. Returns int32 codes.
  """
  table, _ = _sorted_entries(code)
  lookup = _bucket_lookup(code)
  # Outside the map the code is its first or last entry's; NaN gets code 0.
  values = jnp.clip(values, table[0], table[-1])
  keys = _ordered_key(lax.bitcast_convert_type(values, jnp.uint32))
  entry = jnp.asarray(lookup.entries)[(keys >> lookup.shift).astype(jnp.int32)]
  offset = keys & jnp.uint32((1 << lookup.shift) - 1)
  return ((entry + offset) >> 24).astype(jnp.int32)


def _divide(x: jax.Array, divisor: Any) -> jax.Array:
  """``x / divisor`` as a true division, for every element.

  XLA rewrites a division by a broadcast value into a multiplication by its
  reciprocal, which differs from the division in the last bit for about a
  quarter of float32 inputs, and the reference divides. An OR of the
  divisor's bits with a zero computed from each element of ``x`` (``min(bits
  of |x|, 0)``) makes the divisor an array of its own that XLA cannot
  broadcast, and leaves its value unchanged.
  """
  zero = jnp.minimum(lax.bitcast_convert_type(jnp.abs(x), jnp.int32), 0)
  bits = lax.bitcast_convert_type(jnp.broadcast_to(divisor, x.shape).astype(jnp.float32), jnp.int32)
  return x / lax.bitcast_convert_type(bits | zero, jnp.float32)


def map_scales(blocks: jax.Array, *, code: str) -> jax.Array:
  """The scales of float32 ``blocks`` (a block per row of the last axis), shape ``(..., 1)``.

  ``max(max |x|, 1e-12)``; divided by 448 for ``"float8_e4m3fn"``.
  """
  scales = jnp.maximum(xla_cpu.reduce_row(jnp.abs(blocks), jnp.max, jnp.maximum), MAP_ZERO_BLOCK_SCALE)
  return _divide(scales, FLOAT8_MAX) if code == FLOAT8_CODE else scales


def _float8_magnitude_code(magnitudes: jax.Array) -> jax.Array:
  """The float8 bits (int32) of non-negative float32 ``magnitudes``: :func:`nearest_map_code`'s.

  The conversion, after saturating at 448 (NaN gets 0); on XLA:CPU, which
  converts to float8 in software, the table read of :func:`nearest_map_code`
  (equal for every float32). The conversion is elementwise, so a GPU
  program can write the codes into the buffer of the codes they replace.
  """

  def converted(magnitudes):
    saturated = jnp.where(jnp.isnan(magnitudes), 0.0, jnp.minimum(magnitudes, FLOAT8_MAX))
    return lax.bitcast_convert_type(saturated.astype(jnp.float8_e4m3fn), jnp.uint8).astype(jnp.int32)

  return lax.platform_dependent(
      magnitudes, cpu=functools.partial(nearest_map_code, code=FLOAT8_CODE), default=converted
  )


def _float8_values(codes: jax.Array) -> jax.Array:
  """float8 e4m3fn ``codes`` as float32: converted, or on XLA:CPU (software float8) read from :data:`FLOAT8_VALUES`."""

  def by_table(codes):
    return jnp.asarray(FLOAT8_VALUES)[lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)]

  return lax.platform_dependent(codes, cpu=by_table, default=lambda codes: codes.astype(jnp.float32))


def map_encode(values: jax.Array, scales: jax.Array, *, code: str) -> jax.Array:
  """Codes of float32 ``values`` under ``scales`` (broadcast to ``values``), in ``code_dtype(code)``.

  The division is a true division, as in the reference (:func:`_divide`).
  float8 codes are the float8 conversion of the ratios (round to nearest
  even), which never exceed 448 under a block's scale; beyond it they
  saturate at +-448 where the conversion gives NaN. Elementwise, so the
  codes keep the layout (and sharding) of ``values``.
  """
  ratios = _divide(values, scales)
  if code == FLOAT8_CODE:
    # The sign of x / s is x's (s > 0).
    sign = (lax.bitcast_convert_type(values, jnp.uint32) >> 31).astype(jnp.int32) << 7
    codes = (_float8_magnitude_code(jnp.abs(ratios)) | sign).astype(jnp.uint8)
    return lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
  return nearest_map_code(ratios, code).astype(jnp.uint8)


def map_decode(codes: jax.Array, scales: jax.Array, *, code: str) -> jax.Array:
  """``map[codes] * scales``, float32; float8 codes converted (:func:`_float8_values`)."""
  if code == FLOAT8_CODE:
    return _float8_values(codes) * scales
  return jnp.asarray(CODE_MAPS[code])[codes.astype(jnp.int32)] * scales


def _map_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """Flat ``x`` as ``(n_blocks, block_size)``, the last block zero padded.

  Zeros leave a block's absmax, hence the short last block's scale, unchanged.
  """
  flat = x.reshape(-1)
  padding = -flat.size % block_size
  return jnp.pad(flat, (0, padding)).reshape(-1, block_size)


def map_quantize(x: jax.Array, *, code: str, block_size: int) -> MapQuantized:
  r"""Quantizes flattened ``x`` to codes of a map (or float8), one absmax scale per block.

  .. math::

    s_b = \max(\max_{i \in b} |x_i|, 10^{-12}), \qquad
    q_i = \arg\min_j |\mathrm{map}_j - x_i / s_b|, \qquad
    \hat{x}_i = \mathrm{map}_{q_i} s_b,

  with the reference's tie-breaking (:func:`nearest_map_code_reference`). For
  ``code="float8_e4m3fn"``: ``s_b`` divided by 448 and ``q_i = e4m3(x_i /
  s_b)``. The last block may be shorter. An XLA (jnp) op: the GPU kernel
  that uses these codes is the fused optimizer step
  (``pallas_kernels.lowbit_adamw_update``).

  Args:
    x: a float array of any shape (computed in float32).
    code: a name in :data:`CODE_MAPS` or ``"float8_e4m3fn"``.
    block_size: elements per scale, ``>= 1``.

  Returns:
    A ``MapQuantized``: ``codes`` shape ``(x.size,)``, ``scales`` shape
    ``(ceil(x.size / block_size),)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> q = quantize.map_quantize(jnp.array([1.0, -0.5, 0.0, 4.0]), code="dynamic_8bit_signed", block_size=2)
    >>> q.scales
    Array([1., 4.], dtype=float32)
    >>> quantize.map_dequantize(q, size=4, code="dynamic_8bit_signed", block_size=2)
    Array([ 1.        , -0.50078124,  0.        ,  4.        ], dtype=float32)

  References:
    Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
    2022 (https://arxiv.org/abs/2110.02861).
  """
  _check_code(code)
  block_size = static_args.check_int("block_size", block_size, 1)
  x = jnp.asarray(x)
  size = x.size
  blocks = _map_blocks(x.astype(jnp.float32), block_size)
  scales = map_scales(blocks, code=code)
  return MapQuantized(map_encode(blocks, scales, code=code).reshape(-1)[:size], scales.reshape(-1))


def map_dequantize(q: MapQuantized, *, size: int, code: str, block_size: int) -> jax.Array:
  """Decodes ``map_quantize``'s output into a flat float32 array of ``size`` elements."""
  _check_code(code)
  block_size = static_args.check_int("block_size", block_size, 1)
  size = static_args.check_int("size", size, 0)
  expected = ((size,), (-(-size // block_size),))
  if (q.codes.shape, q.scales.shape) != expected or q.codes.dtype != code_dtype(code):
    raise ValueError(
        f"q does not match size={size}, code={code!r}, block_size={block_size}: expected"
        f" {code_dtype(code)} codes of shape {expected[0]} and scales of shape {expected[1]};"
        f" got {q.codes.dtype}{q.codes.shape} and {q.scales.shape}."
    )
  codes = _map_blocks(q.codes, block_size)
  return map_decode(codes, q.scales[:, None], code=code).reshape(-1)[:size]


def lowering_examples() -> list[_backend.LoweringExample]:
  """Each kernel at 4 and 8 bits, with buckets spanning rows and within a row.

  Sizes leave a short last row and bucket, so the tail handling is lowered too.
  """
  examples = []
  shape = (3, 700)
  size = math.prod(shape)
  for bits in SUPPORTED_BITS:
    for bucket_size in (64, 512):
      stats = jax.ShapeDtypeStruct((num_buckets(size, bucket_size),), jnp.bfloat16)
      q = QuantizedArray(
          jax.ShapeDtypeStruct((packing.packed_size(size, 8 // bits),), jnp.uint8), stats, stats
      )
      x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
      suffix = f"{bits}bit_bucket{bucket_size}"
      examples += [
          _backend.LoweringExample(
              f"quantize_{suffix}",
              _backend.MOSAIC_GPU_CALL,
              functools.partial(
                  quantize,
                  bits=bits,
                  bucket_size=bucket_size,
                  stats_dtype=jnp.bfloat16,
                  implementation="pallas",
              ),
              (x,),
          ),
          _backend.LoweringExample(
              f"dequantize_{suffix}",
              _backend.MOSAIC_GPU_CALL,
              functools.partial(
                  dequantize, size=size, bits=bits, bucket_size=bucket_size, implementation="pallas"
              ),
              (q,),
          ),
          _backend.LoweringExample(
              f"dequantize_add_{suffix}",
              _backend.MOSAIC_GPU_CALL,
              functools.partial(dequantize_add, bits=bits, bucket_size=bucket_size, implementation="pallas"),
              (q, x),
          ),
      ]
  return examples
