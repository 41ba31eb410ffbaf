r"""Blockwise min/max quantization: asymmetric 4-bit and 8-bit codes (MicroAdam's error feedback format).

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
them out keeps XLA, the interpreter and the GPU kernel that re-encodes
MicroAdam's error feedback (``pallas_kernels.error_feedback``, built from
this module's arithmetic: ``round_outward``, ``step_size``, ``inverse_step``,
``encode``, ``decode``) bit-identical in codes.

``bucket_size`` is a positive multiple of 256, so that a bucket is whole
packed rows, or 32, 64 or 128, so that buckets tile a 128-element plane.

``quantize``, ``dequantize`` and ``dequantize_add`` are XLA only: XLA fuses
the decoding into its readers (``pallas_kernels/dispatch.py`` says why no
kernel is kept).

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

from pallas_kernels import packing, static_args

SUPPORTED_BITS = (4, 8)
# Elements per kernel row: two planes of ``packing.PLANE_WIDTH``, which is one
# packed 4-bit row or two packed 8-bit rows.
ROW = 2 * packing.PLANE_WIDTH
# Bucket sizes below a row: segments of a 128-element plane.
SMALL_BUCKET_SIZES = (32, 64, 128)
VALUE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
STATS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SMALLEST_NORMAL_STEP = float(np.finfo(np.float32).tiny)


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


def round_outward(values: jax.Array, stats_dtype: np.dtype, *, upward: bool) -> jax.Array:
  """Rounds float32 ``values`` to ``stats_dtype`` toward +inf (or -inf), kept in float32.

  A bfloat16 is the upper half of a float32: clearing the low 16 bits rounds
  toward zero, and one bfloat16 step away from zero fixes the values for which
  that went the wrong way. The rounding is monotonic, so rounding the
  elements before reducing them gives what rounding the reduced value does.
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


def step_size(minimum: jax.Array, maximum: jax.Array, bits: int) -> jax.Array:
  """``s = (max - min) * fl(1 / (2**bits - 1))`` in float32."""
  return (maximum - minimum) * np.float32(1 / _levels(bits))


def inverse_step(step: jax.Array) -> jax.Array:
  """``1 / step``, or 0 (every code 0) for a step that is zero or subnormal."""
  safe_step = jnp.where(step >= _SMALLEST_NORMAL_STEP, step, 1.0)
  return jnp.where(step >= _SMALLEST_NORMAL_STEP, 1.0 / safe_step, 0.0)


def round_half_to_even(x: jax.Array) -> jax.Array:
  """``jnp.round`` of float32 ``x`` (ties to even) from floors, which Triton lowers and rounding it does not."""
  floor = jnp.floor(x)
  fraction = x - floor
  odd = floor - 2 * jnp.floor(floor * 0.5) == 1
  return jnp.where((fraction > 0.5) | ((fraction == 0.5) & odd), floor + 1, floor)


def encode(values: jax.Array, minimum: jax.Array, inverse_step: jax.Array, bits: int) -> jax.Array:
  """Codes as float32 integers in ``[0, 2**bits - 1]``."""
  return jnp.clip(round_half_to_even((values - minimum) * inverse_step), 0, _levels(bits))


def decode(codes: jax.Array, minimum: jax.Array, step: jax.Array) -> jax.Array:
  """``min + q * s`` in float32, from the bucket's float32 minimum and step."""
  return minimum + codes.astype(jnp.float32) * step


def decode_values(codes: jax.Array, minimum: jax.Array, maximum: jax.Array, *, bits: int) -> jax.Array:
  """``min + q * s`` in float32, each code with its bucket's statistics, as every implementation decodes."""
  minimum = minimum.astype(jnp.float32)
  return decode(codes, minimum, step_size(minimum, maximum.astype(jnp.float32), bits))


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
  minimum = round_outward(minimum, np.dtype(stats_dtype), upward=False)
  maximum = round_outward(maximum, np.dtype(stats_dtype), upward=True)
  inverse = inverse_step(step_size(minimum, maximum, bits))
  codes = encode(flat, minimum[bucket_of], inverse[bucket_of], bits)
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
  minimum = round_outward(buckets.min(axis=1), stats_dtype, upward=False)
  maximum = round_outward(buckets.max(axis=1), stats_dtype, upward=True)
  inverse = inverse_step(step_size(minimum, maximum, bits))
  planes = [
    encode(plane, low, inverse, bits)
    for plane, (low, inverse) in _row_planes(padded, (minimum, inverse), bucket_size, bits)
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
  step = step_size(minimum, q.maximum.astype(jnp.float32)[:, None], bits)
  return decode(codes, minimum, step).reshape(-1)[:size]


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
  static_args.check_dtype("x", x.dtype, VALUE_DTYPES)
  stats_dtype = static_args.check_dtype("stats_dtype", stats_dtype, STATS_DTYPES)
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
    or q.minimum.dtype not in STATS_DTYPES
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
  dtype = static_args.check_dtype("dtype", dtype, VALUE_DTYPES)
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
  dtype = static_args.check_dtype("y", y.dtype, VALUE_DTYPES)
  flat = _dequantize_flat(q, y, size=y.size, bits=bits, bucket_size=bucket_size, dtype=dtype)
  return flat.reshape(y.shape)


def __getattr__(name: str) -> Any:
  """``requantize_unselected``, moved to ``pallas_kernels.error_feedback``, still read here (with a warning)."""
  if name == "requantize_unselected":
    import importlib
    import warnings

    # Imported by name: error_feedback imports this module, which stays below it.
    error_feedback = importlib.import_module("pallas_kernels.error_feedback")
    warnings.warn(
      "pallas_kernels.quantize.requantize_unselected moved to pallas_kernels.error_feedback.requantize_unselected.",
      DeprecationWarning,
      stacklevel=2,
    )
    return error_feedback.requantize_unselected
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
