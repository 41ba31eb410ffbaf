"""Blockwise 4-bit and 8-bit quantization: the XLA path and the plain reference
against a numpy re-derivation of the documented formulas, the half-step bound
as a property, and the planar byte layout (MicroAdam's re-encoding kernel:
``tests/test_error_feedback.py``)."""

from __future__ import annotations

import math

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import packing, quantize

pytestmark = pytest.mark.kernels

F32_TINY = np.finfo(np.float32).tiny
F32_EPS = np.finfo(np.float32).eps


def bf16_outward(value: np.float32, *, upward: bool) -> np.float32:
  """The nearest bfloat16 at or above (or below) ``value``, from round-to-nearest."""
  nearest = np.asarray(value, np.float32).astype(jnp.bfloat16)
  if upward and np.float32(nearest) < value:
    nearest = np.nextafter(nearest, np.asarray(np.inf, jnp.bfloat16))
  if not upward and np.float32(nearest) > value:
    nearest = np.nextafter(nearest, np.asarray(-np.inf, jnp.bfloat16))
  return np.float32(nearest)


def numpy_quantize(x, bits: int, bucket_size: int, stats_dtype):
  """Codes (unpacked), minimum and maximum from the documented formulas, in numpy float32."""
  flat = np.asarray(jnp.asarray(x).astype(jnp.float32)).reshape(-1)
  levels = 2**bits - 1
  codes, minima, maxima = [], [], []
  for start in range(0, flat.size, bucket_size):
    bucket = flat[start : start + bucket_size]
    low, high = bucket.min(), bucket.max()
    if jnp.dtype(stats_dtype) == jnp.bfloat16:
      low, high = bf16_outward(low, upward=False), bf16_outward(high, upward=True)
    step = np.float32(high - low) * np.float32(1 / levels)
    inverse_step = np.float32(1) / step if step >= F32_TINY else np.float32(0)
    codes.append(np.clip(np.rint((bucket - low) * inverse_step), 0, levels).astype(np.uint8))
    minima.append(low)
    maxima.append(high)
  if not codes:
    return np.zeros(0, np.uint8), np.zeros(0, np.float32), np.zeros(0, np.float32)
  return np.concatenate(codes), np.array(minima, np.float32), np.array(maxima, np.float32)


def half_step_bound(minimum, maximum, bits: int, bucket_size: int, size: int) -> np.ndarray:
  """Per element: half a step of its bucket, float32 rounding, and the
  documented exception (a step below the smallest normal float32 decodes to
  the minimum, within the bucket's range)."""
  low = np.asarray(jnp.asarray(minimum).astype(jnp.float32), np.float64)
  high = np.asarray(jnp.asarray(maximum).astype(jnp.float32), np.float64)
  span = high - low
  levels = 2**bits - 1
  bound = span / (2 * levels) + 4 * F32_EPS * (span + np.maximum(abs(low), abs(high)))
  bound = np.where(span / levels < F32_TINY, np.maximum(bound, span), bound)
  return np.repeat(bound, bucket_size)[:size]


def draw_input(shape, dtype, bucket_size: int, seed: int) -> jax.Array:
  """Buckets of different scales and offsets, zeros, and a constant first bucket."""
  rng = np.random.default_rng(seed)
  size = math.prod(shape)
  n_buckets = -(-size // bucket_size)
  scale = np.repeat(10.0 ** rng.uniform(-3, 3, n_buckets), bucket_size)[:size]
  offset = np.repeat(rng.normal(size=n_buckets), bucket_size)[:size]
  x = rng.standard_normal(size) * scale + offset * scale
  x[rng.random(size) < 0.1] = 0.0
  # A bfloat16 value, so that the bucket is constant in every stats dtype.
  x[:bucket_size] = np.float32(np.asarray(rng.normal(), np.float32).astype(jnp.bfloat16))
  return jnp.asarray(x.reshape(shape), dtype)


# (shape, x dtype, bits, bucket_size, stats dtype, dequantize dtype): short last
# rows and buckets at both widths, odd lengths, buckets within a row (32, 64,
# 128) and spanning rows, a size that is whole buckets, each input dtype.
CASES = [
  ((1000,), jnp.float32, 4, 256, jnp.float32, jnp.float32),
  ((3, 700), jnp.bfloat16, 8, 64, jnp.bfloat16, jnp.bfloat16),
  ((517,), jnp.float32, 4, 32, jnp.bfloat16, jnp.float32),
  ((2, 1300), jnp.float16, 8, 512, jnp.float32, jnp.float16),
  ((2, 3, 91), jnp.float32, 4, 128, jnp.bfloat16, jnp.float32),
  ((2, 2048), jnp.bfloat16, 4, 1024, jnp.bfloat16, jnp.float32),
]


def close_within_rounding(actual, expected, dtype, message: str):
  """Float rounding of ``dtype`` relative to the largest magnitude involved."""
  actual = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
  expected = np.asarray(jnp.asarray(expected).astype(jnp.float32), np.float64)
  eps = float(jnp.finfo(dtype).eps)
  scale = max(np.abs(expected).max(initial=0.0), 1.0)
  np.testing.assert_allclose(actual, expected, rtol=eps, atol=eps * scale, err_msg=message)


@pytest.mark.parametrize("shape,dtype,bits,bucket_size,stats_dtype,out_dtype", CASES)
def test_quantize_and_dequantize_match_numpy_and_the_reference(
  shape, dtype, bits, bucket_size, stats_dtype, out_dtype, seed
):
  message = f"seed={seed}"
  x = draw_input(shape, dtype, bucket_size, seed)
  size = x.size
  kwargs = dict(bits=bits, bucket_size=bucket_size)

  reference = quantize.quantize(x, stats_dtype=stats_dtype, **kwargs)
  chex.assert_shape(reference.codes, (math.ceil(size * bits / 8),))
  chex.assert_shape(reference.minimum, (quantize.num_buckets(size, bucket_size),))
  assert reference.minimum.dtype == jnp.dtype(stats_dtype), message

  codes, minimum, maximum = numpy_quantize(x, bits, bucket_size, stats_dtype)
  # The module's plain reference states the same formula, unpacked.
  for actual, expected in zip(
    quantize.quantize_reference(x, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype),
    (codes, minimum, maximum),
    strict=True,
  ):
    np.testing.assert_array_equal(actual, expected, err_msg=message)
  np.testing.assert_array_equal(reference.minimum.astype(jnp.float32), minimum, err_msg=message)
  np.testing.assert_array_equal(reference.maximum.astype(jnp.float32), maximum, err_msg=message)
  expected_bytes = packing.pack(jnp.asarray(codes), base=2**bits, planes=8 // bits)
  np.testing.assert_array_equal(reference.codes, expected_bytes, err_msg=message)

  decoded = quantize.dequantize(reference, size=size, dtype=out_dtype, **kwargs)
  chex.assert_shape(decoded, (size,))
  assert decoded.dtype == jnp.dtype(out_dtype), message
  close_within_rounding(
    decoded,
    quantize.dequantize_reference(jnp.asarray(codes), minimum, maximum, **kwargs).astype(out_dtype),
    out_dtype,
    message,
  )
  # The first bucket is constant.
  first = np.asarray(x.reshape(-1)[:bucket_size].astype(out_dtype))
  np.testing.assert_array_equal(decoded[:bucket_size], first, err_msg=message)


@pytest.mark.parametrize("bits", quantize.SUPPORTED_BITS)
def test_codes_follow_the_planar_byte_order(bits, seed):
  """Byte j of a full row holds codes j and j + 128 (4-bit), or code j (8-bit);
  a short last row of r codes pairs j with j + ceil(r / 2)."""
  tail = 37
  size = 2 * 256 + tail
  x = jnp.asarray(np.random.default_rng(seed).standard_normal(size), jnp.float32)
  codes, _, _ = numpy_quantize(x, bits, 256, jnp.float32)
  codes = codes.astype(np.int64)
  packed = np.asarray(quantize.quantize(x, bits=bits, bucket_size=256).codes)
  if bits == 8:
    np.testing.assert_array_equal(packed, codes, err_msg=f"seed={seed}")
    return
  full_rows = [codes[r * 256 + np.arange(128)] + 16 * codes[r * 256 + 128 + np.arange(128)] for r in range(2)]
  width = math.ceil(tail / 2)
  last = np.append(codes[512 + width :], 0)
  expected = np.concatenate(full_rows + [codes[512 : 512 + width] + 16 * last])
  np.testing.assert_array_equal(packed, expected, err_msg=f"seed={seed}")


finite_float32 = st.floats(-1e6, 1e6, width=32, allow_subnormal=False)


@hypothesis.given(
  x=hnp.arrays(np.float32, st.integers(0, 1100), elements=finite_float32),
  bits=st.sampled_from(quantize.SUPPORTED_BITS),
  bucket_size=st.sampled_from([32, 64, 128, 256, 512]),
  stats_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_round_trip_within_half_a_step(x, bits, bucket_size, stats_dtype):
  q = quantize.quantize(x, bits=bits, bucket_size=bucket_size, stats_dtype=stats_dtype)
  decoded = quantize.dequantize(q, size=x.size, bits=bits, bucket_size=bucket_size)
  padded = np.pad(x, (0, q.minimum.size * bucket_size - x.size), mode="edge").reshape(-1, bucket_size)
  # The stored statistics enclose each bucket.
  assert np.all(np.asarray(q.minimum.astype(jnp.float32)) <= padded.min(axis=1, initial=np.inf))
  assert np.all(np.asarray(q.maximum.astype(jnp.float32)) >= padded.max(axis=1, initial=-np.inf))
  error = np.abs(np.asarray(decoded, np.float64) - x.astype(np.float64))
  assert np.all(error <= half_step_bound(q.minimum, q.maximum, bits, bucket_size, x.size))


@pytest.mark.parametrize("stats_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bits", quantize.SUPPORTED_BITS)
def test_constant_buckets_decode_exactly(bits, stats_dtype, seed):
  rng = np.random.default_rng(seed)
  values = rng.normal(size=3).astype(np.float32)
  if stats_dtype == jnp.bfloat16:
    values = values.astype(jnp.bfloat16).astype(np.float32)
  x = np.repeat(values, 64)[:150]  # the last bucket is short
  q = quantize.quantize(x, bits=bits, bucket_size=64, stats_dtype=stats_dtype)
  np.testing.assert_array_equal(packing.unpack(q.codes, x.size, base=2**bits, planes=8 // bits), 0)
  decoded = quantize.dequantize(q, size=x.size, bits=bits, bucket_size=64)
  np.testing.assert_array_equal(decoded, x, err_msg=f"seed={seed}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_add_is_y_plus_dequantize(dtype, seed):
  rng = np.random.default_rng(seed)
  shape = (5, 77)
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  y = jnp.asarray(rng.standard_normal(shape), dtype)
  q = quantize.quantize(x, bits=4, bucket_size=256, stats_dtype=jnp.bfloat16)
  decoded = quantize.dequantize(q, size=x.size, bits=4, bucket_size=256)
  expected = (y.astype(jnp.float32) + decoded.reshape(shape)).astype(dtype)
  summed = quantize.dequantize_add(q, y, bits=4, bucket_size=256)
  chex.assert_trees_all_equal_shapes_and_dtypes(summed, y)
  np.testing.assert_array_equal(summed, expected, err_msg=f"seed={seed}")


def test_quantize_under_jit_equals_eager(seed):
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((3, 300)), jnp.bfloat16)
  quantized = lambda x: quantize.quantize(x, bits=4, bucket_size=256, stats_dtype=jnp.bfloat16)
  chex.assert_trees_all_equal(jax.jit(quantized)(x), quantized(x))


@pytest.mark.parametrize("shape", [(0,), (4, 0)])
def test_zero_size(shape):
  x = jnp.zeros(shape, jnp.bfloat16)
  q = quantize.quantize(x, bits=4, bucket_size=64, stats_dtype=jnp.bfloat16)
  chex.assert_trees_all_equal_shapes_and_dtypes(
    q,
    quantize.QuantizedArray(jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.bfloat16), jnp.zeros((0,), jnp.bfloat16)),
  )
  decoded = quantize.dequantize(q, size=0, bits=4, bucket_size=64)
  chex.assert_shape(decoded, (0,))
  summed = quantize.dequantize_add(q, x, bits=4, bucket_size=64)
  chex.assert_trees_all_equal_shapes_and_dtypes(summed, x)


def test_num_buckets():
  assert [quantize.num_buckets(n, 256) for n in (0, 1, 256, 257, 1000)] == [0, 1, 1, 2, 4]
  assert quantize.num_buckets(100, 32) == 4


X = jnp.ones((10,), jnp.float32)
Q = quantize.quantize(X, bits=4, bucket_size=64)


@pytest.mark.parametrize(
  "call,argument",
  [
    (lambda: quantize.quantize(X, bits=3, bucket_size=64), "bits"),
    (lambda: quantize.quantize(X, bits=True, bucket_size=64), "bits"),
    (lambda: quantize.quantize(X, bits=4, bucket_size=100), "bucket_size"),
    (lambda: quantize.quantize(X, bits=4, bucket_size=16), "bucket_size"),
    (lambda: quantize.quantize(X, bits=4, bucket_size=0), "bucket_size"),
    (lambda: quantize.quantize(X, bits=4, bucket_size=-256), "bucket_size"),
    (lambda: quantize.quantize(X, bits=4, bucket_size=256.0), "bucket_size"),
    (lambda: quantize.quantize(jnp.ones(10, jnp.int32), bits=4, bucket_size=64), "x"),
    (lambda: quantize.quantize(X, bits=4, bucket_size=64, stats_dtype=jnp.float16), "stats_dtype"),
    (lambda: quantize.num_buckets(-1, 64), "size"),
    (lambda: quantize.num_buckets(10, 300), "bucket_size"),
    (lambda: quantize.dequantize(Q, size=10, bits=4, bucket_size=64, dtype=jnp.int8), "dtype"),
    (lambda: quantize.dequantize(Q, size=-1, bits=4, bucket_size=64), "size"),
    (lambda: quantize.dequantize(Q, size=10, bits=5, bucket_size=64), "bits"),
    (lambda: quantize.dequantize(Q, size=10, bits=4, bucket_size=96), "bucket_size"),
    (lambda: quantize.dequantize(Q, size=11, bits=4, bucket_size=64), "q"),
    (lambda: quantize.dequantize(Q, size=10, bits=8, bucket_size=64), "q"),
    (lambda: quantize.dequantize_add(Q, jnp.ones(10, jnp.int32), bits=4, bucket_size=64), "y"),
    (lambda: quantize.dequantize_add(Q, jnp.ones(12), bits=4, bucket_size=64), "q"),
  ],
)
def test_invalid_arguments_raise_naming_them(call, argument):
  with pytest.raises(ValueError, match=rf"^{argument} "):
    call()
