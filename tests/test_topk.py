"""Block top-k: the plain-jnp reference against a numpy re-derivation and the
selection's defining properties; the tuned XLA path against the reference,
exactly."""

from __future__ import annotations

import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import topk

pytestmark = pytest.mark.kernels


def documented_keep(length: int, density: float) -> int:
  """The documented rule: ``min(n, max(1, ceil(n * density)))``, the product rounded to 9 decimals."""
  if length == 0:
    return 0
  return min(length, max(1, math.ceil(round(length * density, 9))))


def numpy_block_topk(x, density: float, block_size: int):
  """Independent re-derivation: per block a stable ranking by (NaN, |x|, -index)."""
  flat = np.asarray(jnp.asarray(x).astype(jnp.float32)).reshape(-1)
  indices, values = [], []
  for start in range(0, flat.size, block_size):
    block = flat[start : start + block_size]
    keep = documented_keep(block.size, density)
    is_nan = np.isnan(block)
    magnitude = np.where(is_nan, 0.0, np.abs(block))
    # np.lexsort sorts by its last key first: NaNs, then larger |x|, then lower index.
    order = np.lexsort((np.arange(block.size), -magnitude, ~is_nan))
    chosen = np.sort(order[:keep])
    indices.append(chosen)
    values.append(block[chosen])
  if not indices:
    return np.zeros(0, np.int64), np.zeros(0, np.float32)
  return np.concatenate(indices), np.concatenate(values)


def draw_input(kind: str, shape, dtype, seed: int) -> jax.Array:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "integers":  # many ties, zeros included
    x = np.round(2 * x)
  elif kind == "sparse":  # most blocks hold fewer nonzeros than k: ties at 0
    x = np.where(rng.random(shape) < 0.01, x, 0.0) * rng.choice([1.0, -1.0], shape)
  elif kind == "special":
    flat = x.reshape(-1)
    spots = rng.choice(flat.size, size=min(flat.size, 12), replace=False)
    flat[spots] = np.resize([np.nan, np.inf, -np.inf, -0.0, 0.0, -np.nan], spots.size)
  return jnp.asarray(x, dtype)


def assert_same_selection(actual, expected, message: str):
  (actual_indices, actual_values), (expected_indices, expected_values) = actual, expected
  chex.assert_trees_all_equal_dtypes(actual_indices, expected_indices)
  chex.assert_trees_all_equal_dtypes(actual_values, expected_values)
  np.testing.assert_array_equal(actual_indices, expected_indices, err_msg=message)
  # Bitwise, so -0.0 against 0.0 or NaN payloads would show.
  np.testing.assert_array_equal(
    np.asarray(actual_values.astype(jnp.float32)).view(np.uint32),
    np.asarray(expected_values.astype(jnp.float32)).view(np.uint32),
    err_msg=message,
  )


# (shape, density, block_size): whole blocks (k = 6), full blocks and a tail
# (k = 9, tail 5), a 2-element tail (keeps 1),
# only a tail, k = 1, k = block_size, and tails of 456 at density 0.05
# (keep 23, where ceil(k r / D) would keep 24).
CASES = [
  ((3, 512), 0.01, 512),
  ((1300,), 0.0175, 512),
  ((2, 5, 77), 0.015, 256),
  ((100,), 0.03, 256),
  ((2, 256), 0.001, 256),
  ((700,), 1.0, 256),
  ((456,), 0.05, 512),
  ((2 * 512 + 456,), 0.05, 512),
]
KINDS = ["normal", "integers", "sparse", "special"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
  "shape, density, block_size",
  CASES + [((5, 301), 0.035, 200), ((3, 4096), 0.01, 4096)],  # one stage; two stages (k = 41, groups of 8)
)
def test_xla_equals_reference(shape, density, block_size, dtype, kind, seed):
  x = draw_input(kind, shape, dtype, seed)
  expected = topk.block_topk_reference(x, density=density, block_size=block_size)
  actual = topk.block_topk(x, density=density, block_size=block_size)
  assert_same_selection(actual, expected, f"seed={seed}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_reference_equals_numpy(kind, dtype, seed):
  x = draw_input(kind, (5, 301), dtype, seed)
  indices, values = topk.block_topk_reference(x, density=0.035, block_size=200)
  expected_indices, expected_values = numpy_block_topk(x, 0.035, 200)
  np.testing.assert_array_equal(indices, expected_indices, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), expected_values, err_msg=f"seed={seed}")


TIE_HEAVY = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, np.inf, -np.inf])
ANY_FLOAT = st.floats(width=32, allow_nan=False)


@hypothesis.given(
  data=st.data(),
  block_size=st.integers(1, 24),
  size=st.integers(0, 80),
  density=st.sampled_from([0.01, 0.05, 0.07, 0.1, 0.3, 0.5, 1.0]),
  bfloat16=st.booleans(),
)
def test_selection_properties(data, block_size, size, density, bfloat16):
  elements = data.draw(
    st.lists(st.one_of(TIE_HEAVY, ANY_FLOAT), min_size=size, max_size=size),
    label="x",
  )
  x = jnp.asarray(np.array(elements, np.float32), jnp.bfloat16 if bfloat16 else jnp.float32)
  indices, values = topk.block_topk(x, density=density, block_size=block_size)

  assert indices.dtype == jnp.int16 and values.dtype == x.dtype
  magnitudes = np.abs(np.asarray(x.astype(jnp.float32)))
  indices = np.asarray(indices, np.int64)
  offset = 0
  for start in range(0, size, block_size):
    width = min(block_size, size - start)
    keep = documented_keep(width, density)
    chosen = indices[offset : offset + keep]
    offset += keep
    assert np.all((chosen >= 0) & (chosen < width))
    assert np.all(np.diff(chosen) > 0)  # distinct, ascending
    block = magnitudes[start : start + width]
    selected = np.zeros(width, bool)
    selected[chosen] = True
    if selected.all():
      continue
    assert block[selected].min() >= block[~selected].max()
    # A tie between a selected and an unselected magnitude goes to the lower index.
    for i in np.flatnonzero(selected):
      equal_unselected = np.flatnonzero(~selected & (block == block[i]))
      assert np.all(equal_unselected > i)
    np.testing.assert_array_equal(np.asarray(values[offset - keep : offset]), np.asarray(x[start + chosen]))
  assert indices.shape == values.shape == (offset,)


@pytest.mark.parametrize(
  "size, density, block_size, expected",
  [
    (456, 0.05, 512, 23),  # a tail only: ceil(22.8)
    (512 + 456, 0.05, 512, 26 + 23),  # ceil(25.6) per full block
    (3 * 16384 + 1000, 0.01, 16384, 3 * 164 + 10),
    (100, 0.07, 256, 7),  # 100 * 0.07 = 7.000000000000001 keeps 7
    (4 * 256, 0.001, 256, 4),  # at least one per block
    (256 + 3, 0.001, 256, 1 + 1),  # and per tail
    (10, 1.0, 4, 10),
    (0, 0.5, 4, 0),
  ],
)
def test_selection_size_follows_the_documented_formula(size, density, block_size, expected):
  assert topk.selection_size(size, density=density, block_size=block_size) == expected
  assert topk.block_topk(jnp.ones(size), density=density, block_size=block_size)[0].shape == (expected,)


@hypothesis.given(
  size=st.integers(0, 10**6),
  block_size=st.integers(1, 5000),
  density=st.floats(1e-4, 1.0),
)
def test_selection_size_counts_every_block(size, block_size, density):
  full_blocks, tail = divmod(size, block_size)
  expected = full_blocks * documented_keep(block_size, density) + documented_keep(tail, density)
  assert topk.selection_size(size, density=density, block_size=block_size) == expected


def test_all_equal_magnitudes_take_the_lowest_indices():
  x = jnp.array([1.0, -1.0] * 384)  # 768 = three blocks of 256
  indices, values = topk.block_topk(x, density=0.01, block_size=256)
  np.testing.assert_array_equal(indices, np.tile([0, 1, 2], 3))
  np.testing.assert_array_equal(values, np.tile([1.0, -1.0, 1.0], 3))


def test_nans_rank_above_infinities():
  x = jnp.zeros(256).at[jnp.array([3, 50, 90, 200])].set(jnp.array([-jnp.inf, jnp.nan, jnp.inf, -jnp.nan]))
  indices, _ = topk.block_topk(x, density=0.01, block_size=256)
  np.testing.assert_array_equal(indices, [3, 50, 200])


@pytest.mark.parametrize("shape", [(0,), (0, 3)])
def test_empty_input_gives_an_empty_selection(shape):
  indices, values = topk.block_topk(jnp.zeros(shape, jnp.bfloat16), density=0.01, block_size=256)
  assert indices.shape == values.shape == (0,)
  assert indices.dtype == jnp.int16 and values.dtype == jnp.bfloat16


@pytest.mark.parametrize("block_size, index_dtype", [(2**15, jnp.int16), (2**15 + 1, jnp.int32)])
def test_index_dtype(block_size, index_dtype):
  x = jnp.arange(10.0)  # only a tail block
  indices, _ = topk.block_topk(x, density=1.0, block_size=block_size)
  assert indices.dtype == index_dtype
  np.testing.assert_array_equal(indices, np.arange(10))


def test_numpy_scalar_arguments_and_jit(seed):
  x = draw_input("integers", (3, 333), jnp.float32, seed)
  jitted = jax.jit(lambda x: topk.block_topk(x, density=np.float64(0.03), block_size=np.int64(128)))
  expected = topk.block_topk_reference(x, density=0.03, block_size=128)
  assert_same_selection(jitted(x), expected, f"seed={seed}")


@pytest.mark.parametrize(
  "kwargs, argument",
  [
    (dict(density=0.0, block_size=256), "density"),
    (dict(density=1.5, block_size=256), "density"),
    (dict(density=True, block_size=256), "density"),
    (dict(density="0.1", block_size=256), "density"),
    (dict(density=0.1, block_size=0), "block_size"),
    (dict(density=0.1, block_size=2**31 + 1), "block_size"),
    (dict(density=0.1, block_size=256.0), "block_size"),
  ],
)
def test_bad_arguments_name_themselves(kwargs, argument):
  with pytest.raises(ValueError, match=f"^{argument} must"):
    topk.block_topk(jnp.ones(300), **kwargs)


@pytest.mark.parametrize("argument", ["density", "block_size"])
def test_traced_shape_arguments_say_to_make_them_static(argument):
  arguments = dict(density=0.1, block_size=256)
  with pytest.raises(ValueError, match=f"^{argument} fixes .* static_args"):
    jax.jit(lambda value: topk.block_topk(jnp.ones(300), **(arguments | {argument: value})))(arguments[argument])


def test_bad_x_and_size_name_themselves():
  with pytest.raises(ValueError, match="^x must"):
    topk.block_topk(jnp.ones(300, jnp.int32), density=0.1, block_size=256)
  with pytest.raises(ValueError, match="^size must"):
    topk.selection_size(-1, density=0.1, block_size=256)
