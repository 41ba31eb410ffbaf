"""Map-based codes of low-bit AdamW: the shipped maps against the reference's
tables, the nearest-entry rounding and the float8 conversion at every point
where a code changes, round trips, and argument errors."""

from __future__ import annotations

import functools
import pathlib

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import map_codes

finite_float32 = st.floats(-1e6, 1e6, width=32, allow_subnormal=False)
X = jnp.ones((10,), jnp.float32)
GOLDEN_MAPS = pathlib.Path(__file__).parent / "data" / "lowbit_adamw" / "torchao_adamw_lowbit_f32.npz"
MAP_CODES = (*map_codes.CODE_MAPS, map_codes.FLOAT8_CODE)


def golden_maps() -> dict[str, np.ndarray]:
  """The reference's exact tables (torchao 0.18, computed by torch in float32)."""
  assert GOLDEN_MAPS.exists(), f"golden data missing: {GOLDEN_MAPS}"
  with np.load(GOLDEN_MAPS) as data:
    return {
      "dynamic_8bit_signed": data["qmap/8bit_signed"],
      "dynamic_8bit_unsigned": data["qmap/8bit_unsigned"],
      "dynamic_4bit_signed": data["qmap/4bit_signed"],
      "linear_4bit_unsigned": data["qmap/4bit_unsigned"],
    }


def float32_ulps(a, b) -> np.ndarray:
  """Distance in float32 steps (same-sign values, or zeros)."""
  to_int = lambda x: np.asarray(x, np.float32).view(np.int32).astype(np.int64)
  return np.abs(to_int(a) - to_int(b))


def test_shipped_maps_are_the_reference_tables():
  for name, table in golden_maps().items():
    np.testing.assert_array_equal(map_codes.CODE_MAPS[name].view(np.uint32), table.view(np.uint32), err_msg=name)


@pytest.mark.parametrize(
  "name,signed,max_exponent_bits,total_bits",
  [
    ("dynamic_8bit_signed", True, 7, 8),
    ("dynamic_8bit_unsigned", False, 7, 8),
    ("dynamic_4bit_signed", True, 3, 4),
  ],
)
def test_dynamic_map_formula_matches_the_reference_tables(name, signed, max_exponent_bits, total_bits):
  computed = map_codes.dynamic_map(signed=signed, max_exponent_bits=max_exponent_bits, total_bits=total_bits)
  table = golden_maps()[name]
  assert computed.dtype == np.float32 and computed.shape == table.shape
  assert np.all(np.diff(computed) > 0), "the map must be strictly increasing"
  ulps = float32_ulps(computed, table)
  # torch's float32 linspace differs from the exact value in the last bits:
  # 1 ulp on most entries it touches, 2 on three entries of the unsigned map.
  assert ulps.max() <= 2, f"{name}: {ulps.max()} ulps at {np.argmax(ulps)}"
  assert np.mean(ulps <= 1) >= 0.98, name


def all_float8_values() -> np.ndarray:
  values = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
  return np.unique(values[np.isfinite(values)])


def nearest_entry_distance(ratios: np.ndarray, table: np.ndarray) -> np.ndarray:
  return np.abs(ratios[:, None].astype(np.float64) - table[None, :].astype(np.float64)).min(axis=1)


def numpy_nearest_code(x: np.ndarray, table: np.ndarray) -> np.ndarray:
  """torchao's rounding, written out in numpy float32: the last entry <= x, then one up when
  x - entry >= (next - entry) * 0.5 (float32 arithmetic, NaN to 0)."""
  x = np.asarray(x, np.float32)
  with np.errstate(invalid="ignore"):
    below_count = (x[:, None] >= table[None, :]).sum(axis=1)
    code = np.maximum(below_count - 1, 0)
    up = np.minimum(code + 1, table.size - 1)
    gap = (table[up] - table[code]) * np.float32(0.5)
    return np.where((x - table[code]).astype(np.float32) >= gap, up, code)


def float32_neighbourhood(points: np.ndarray, ulps: int) -> np.ndarray:
  """Every float32 within ``ulps`` steps of each of ``points``."""
  bits = np.asarray(points, np.float32).view(np.int32).astype(np.int64)
  steps = np.arange(-ulps, ulps + 1)
  return (bits[:, None] + steps[None, :]).reshape(-1).astype(np.int32).view(np.float32)


@pytest.mark.parametrize("code", list(map_codes.CODE_MAPS))
def test_nearest_map_code_is_the_references_rounding_at_every_code_change(code, seed):
  table = map_codes.CODE_MAPS[code]
  # Codes change at the midpoints of neighbouring entries, up to float32 rounding:
  # every float32 a few steps either side of each, of each entry, and random values.
  midpoints = ((table[:-1].astype(np.float64) + table[1:]) / 2).astype(np.float32)
  rng = np.random.default_rng(seed)
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-45, -1e-45], np.float32)
  x = np.concatenate(
    [
      float32_neighbourhood(midpoints, 8),
      float32_neighbourhood(table, 2),
      special,
      rng.uniform(-1.5, 1.5, 4096).astype(np.float32),
      (rng.standard_normal(4096) * 10.0 ** rng.uniform(-9, 0, 4096)).astype(np.float32),
    ]
  )
  expected = numpy_nearest_code(x, table)
  np.testing.assert_array_equal(jax.jit(map_codes.nearest_map_code, static_argnums=1)(x, code), expected)
  np.testing.assert_array_equal(jax.jit(map_codes.nearest_map_code_reference)(x, table), expected)
  np.testing.assert_array_equal(map_codes.nearest_map_code_reference(x, table), expected)  # In numpy.
  # The GPU's path, also across the dynamic maps' decades, where its guess changes formula.
  decades = float32_neighbourhood(10.0 ** np.arange(-7, 1), 64)
  x = np.concatenate([x, decades, -decades])
  elementwise = jax.jit(map_codes.nearest_map_code_elementwise, static_argnums=1)
  np.testing.assert_array_equal(elementwise(x, code), numpy_nearest_code(x, table))


def test_float8_encode_is_the_float8_conversion_at_every_rounding_change(seed):
  magnitudes = all_float8_values()
  magnitudes = magnitudes[magnitudes >= 0]
  # Rounding changes at the midpoints of neighbouring float8 numbers (ties to
  # even): every float32 a few steps either side of each, of each number, and
  # random values, with both signs, within the +-448 a block's ratios span.
  midpoints = ((magnitudes[:-1].astype(np.float64) + magnitudes[1:]) / 2).astype(np.float32)
  rng = np.random.default_rng(seed)
  x = np.concatenate(
    [
      float32_neighbourhood(midpoints, 8),
      float32_neighbourhood(magnitudes, 2),
      np.float32([0.0, 1e-45, 3e-39, 448.0]),
      rng.uniform(0, 448, 4096).astype(np.float32),
      (448 * 10.0 ** rng.uniform(-12, 0, 4096)).astype(np.float32),
    ]
  )
  x = np.concatenate([x, -x])
  x = x[np.abs(x) <= 448]  # Also drops the NaN bit patterns next to zero.
  encode = jax.jit(lambda v: map_codes.map_encode(v, np.float32(1.0), code=map_codes.FLOAT8_CODE))
  np.testing.assert_array_equal(np.asarray(encode(x)).view(np.uint8), x.astype(jnp.float8_e4m3fn).view(np.uint8))


@functools.partial(jax.jit, static_argnames=("code", "block_size"))
def map_round_trip(x, *, code, block_size):
  q = map_codes.map_quantize(x, code=code, block_size=block_size)
  return q, map_codes.map_dequantize(q, size=x.size, code=code, block_size=block_size)


@hypothesis.given(
  # A few sizes, so that the jitted round trip compiles a few times only.
  x=hnp.arrays(np.float32, st.sampled_from([5, 300, 700]), elements=finite_float32),
  code=st.sampled_from(MAP_CODES),
  block_size=st.sampled_from([7, 64, 256]),
  zero_blocks=st.booleans(),
)
def test_map_round_trip_is_the_nearest_entry_times_the_scale(x, code, block_size, zero_blocks):
  if zero_blocks:
    x = x.copy()
    x[: 2 * block_size] = 0.0
  q, decoded = map_round_trip(x, code=code, block_size=block_size)
  n_blocks = -(-x.size // block_size)
  assert q.codes.shape == x.shape and q.codes.dtype == map_codes.code_dtype(code)
  assert q.scales.shape == (n_blocks,) and q.scales.dtype == jnp.float32
  # Scales: the absmax of each block (the last one shorter), at least 1e-12.
  padded = np.pad(np.abs(x), (0, n_blocks * block_size - x.size)).reshape(n_blocks, block_size)
  absmax = np.maximum(padded.max(axis=1), np.float32(1e-12))
  divisor = absmax / np.float32(448) if code == map_codes.FLOAT8_CODE else absmax
  np.testing.assert_array_equal(q.scales, divisor)
  scale = np.repeat(divisor, block_size)[: x.size]
  if code == map_codes.FLOAT8_CODE:
    table, entries = all_float8_values(), np.asarray(q.codes).astype(np.float32)
  else:
    table = map_codes.CODE_MAPS[code]
    entries = table[np.asarray(q.codes)]
  np.testing.assert_array_equal(decoded, entries * scale)
  ratios = x / scale  # float32 division, as the reference.
  distance = np.abs(ratios.astype(np.float64) - entries)
  # Nearest, up to the reference's float32 tie test (x - low >= (high - low) / 2).
  slack = 2 * np.finfo(np.float32).eps * np.maximum(np.abs(ratios), 1.0)
  assert np.all(distance <= nearest_entry_distance(ratios, table) + slack)
  # Blocks of zeros: scale 1e-12, decoded to at most 1e-12 (the linear map has no zero).
  if zero_blocks:
    zero = slice(0, min(2 * block_size, x.size))
    assert np.all(absmax[: -(-zero.stop // block_size)] == np.float32(1e-12))
    assert np.all(np.abs(np.asarray(decoded)[zero]) <= 1e-12)


@pytest.mark.parametrize("code", MAP_CODES)
def test_map_codes_of_every_entry_decode_to_the_entry(code):
  table = all_float8_values() if code == map_codes.FLOAT8_CODE else map_codes.CODE_MAPS[code]
  # One block, of absmax 1 (448 for float8): the scale is exactly 1.
  x = np.concatenate([table, [1.0]]).astype(np.float32)
  q = map_codes.map_quantize(x, code=code, block_size=x.size)
  np.testing.assert_array_equal(map_codes.map_dequantize(q, size=x.size, code=code, block_size=x.size), x)


@pytest.mark.parametrize("code", list(map_codes.CODE_MAPS))
def test_elementwise_entries_are_the_table_for_every_code(code):
  """The GPU's decoding (selects, or a dynamic map's formula): every code's entry, bit for bit."""
  table = map_codes.CODE_MAPS[code]
  codes = jnp.arange(table.size, dtype=jnp.uint8).reshape(2, -1)
  entries = jax.jit(map_codes.map_entries_elementwise, static_argnums=1)(codes, code)
  np.testing.assert_array_equal(np.asarray(entries).reshape(-1).view(np.uint32), table.view(np.uint32))


@pytest.mark.parametrize("code", list(map_codes.CODE_MAPS))
def test_maps_are_decoded_and_encoded_without_table_reads_on_a_gpu(code):
  """Elementwise on CUDA, so XLA:GPU writes new codes over the old; table reads on the CPU, where they are faster."""
  from pallas_kernels import _backend

  def round_trip(codes, scales):
    values = map_codes.map_decode(codes, scales, code=code, elementwise=True) * 0.5
    return map_codes.map_encode(values, scales, code=code)

  args = (jnp.zeros((4, 128), jnp.uint8), jnp.ones((4, 1), jnp.float32))
  assert "gather" not in _backend.lower_for_cuda(round_trip, *args)
  assert "gather" in jax.jit(round_trip).lower(*args).as_text()


def test_float8_codes_decode_as_their_float8_value_for_every_bit_pattern(seed):
  codes = jnp.arange(256, dtype=jnp.uint8).view(jnp.float8_e4m3fn)
  scale = np.float32(np.random.default_rng(seed).uniform(0.5, 2.0))
  decoded = map_codes.map_decode(codes, scale, code=map_codes.FLOAT8_CODE)
  np.testing.assert_array_equal(decoded, np.asarray(codes).astype(np.float32) * scale)  # NaN where NaN.


@pytest.mark.parametrize(
  "call,argument",
  [
    (lambda: map_codes.map_quantize(X, code="dynamic_3bit", block_size=4), "code"),
    (lambda: map_codes.map_quantize(X, code="dynamic_8bit_signed", block_size=0), "block_size"),
    (lambda: map_codes.map_quantize(X, code="dynamic_8bit_signed", block_size=jnp.int32(4)), "block_size"),
    (
      lambda: map_codes.map_dequantize(
        map_codes.map_quantize(X, code="dynamic_8bit_signed", block_size=4),
        size=11,
        code="dynamic_8bit_signed",
        block_size=4,
      ),
      "q",
    ),
    (lambda: map_codes.dynamic_map(signed=True, max_exponent_bits=5, total_bits=8), "dynamic_map"),
  ],
)
def test_invalid_map_arguments_raise_naming_them(call, argument):
  with pytest.raises(ValueError, match=rf"^{argument} "):
    call()
