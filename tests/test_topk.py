"""Block top-k: the XLA reference against a numpy re-derivation and the
selection's defining properties, and the Pallas threshold kernel (Mosaic GPU
interpreter) against the XLA reference, exactly."""

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


def fresh_seed() -> int:
  return int(np.random.SeedSequence().entropy % 2**32)


def numpy_block_topk(x, k: int, block_size: int):
  """Independent re-derivation: per block a stable ranking by (NaN, |x|, -index)."""
  flat = np.asarray(jnp.asarray(x).astype(jnp.float32)).reshape(-1)
  indices, values = [], []
  for start in range(0, flat.size, block_size):
    block = flat[start : start + block_size]
    if block.size == block_size:
      keep = k
    else:
      keep = min(block.size, max(1, math.ceil(k * block.size / block_size)))
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


# (shape, k, block_size): whole blocks, a tail that is not whole rows of 256,
# a 2-element tail, only a tail, k = 1 and k = block_size.
KERNEL_CASES = [
    ((3, 512), 5, 512),
    ((1300,), 9, 512),
    ((2, 5, 77), 4, 256),
    ((100,), 3, 256),
    ((2, 256), 1, 256),
    ((700,), 256, 256),
]


@pytest.mark.parametrize("kind", ["normal", "integers", "sparse", "special"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, k, block_size", KERNEL_CASES)
def test_interpret_equals_xla(shape, k, block_size, dtype, kind):
  seed = fresh_seed()
  x = draw_input(kind, shape, dtype, seed)
  expected = topk.block_topk(x, k=k, block_size=block_size, implementation="xla")
  actual = topk.block_topk(x, k=k, block_size=block_size, implementation="interpret")
  assert_same_selection(actual, expected, f"seed={seed}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["normal", "integers", "sparse", "special"])
def test_xla_equals_numpy(kind, dtype):
  seed = fresh_seed()
  x = draw_input(kind, (5, 301), dtype, seed)
  indices, values = topk.block_topk(x, k=7, block_size=200, implementation="xla")
  expected_indices, expected_values = numpy_block_topk(x, 7, 200)
  np.testing.assert_array_equal(indices, expected_indices, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(
      np.asarray(values.astype(jnp.float32)), expected_values, err_msg=f"seed={seed}"
  )


TIE_HEAVY = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, np.inf, -np.inf])
ANY_FLOAT = st.floats(width=32, allow_nan=False)


@hypothesis.given(
    data=st.data(),
    block_size=st.integers(1, 24),
    size=st.integers(0, 80),
    bfloat16=st.booleans(),
)
def test_selection_properties(data, block_size, size, bfloat16):
  k = data.draw(st.integers(1, block_size), label="k")
  elements = data.draw(
      st.lists(st.one_of(TIE_HEAVY, ANY_FLOAT), min_size=size, max_size=size),
      label="x",
  )
  x = jnp.asarray(np.array(elements, np.float32), jnp.bfloat16 if bfloat16 else jnp.float32)
  indices, values = topk.block_topk(x, k=k, block_size=block_size, implementation="xla")

  expected_size = topk.selection_size(size, k=k, block_size=block_size)
  assert indices.shape == values.shape == (expected_size,)
  assert indices.dtype == jnp.int16 and values.dtype == x.dtype
  magnitudes = np.abs(np.asarray(x.astype(jnp.float32)))
  indices = np.asarray(indices, np.int64)
  offset = 0
  for start in range(0, size, block_size):
    width = min(block_size, size - start)
    keep = k if width == block_size else min(width, max(1, math.ceil(k * width / block_size)))
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
    np.testing.assert_array_equal(
        np.asarray(values[offset - keep : offset]), np.asarray(x[start + chosen])
    )
  assert offset == expected_size


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_all_equal_magnitudes_take_the_lowest_indices(implementation):
  x = jnp.array([1.0, -1.0] * 384)  # 768 = three blocks of 256
  indices, values = topk.block_topk(x, k=3, block_size=256, implementation=implementation)
  np.testing.assert_array_equal(indices, np.tile([0, 1, 2], 3))
  np.testing.assert_array_equal(values, np.tile([1.0, -1.0, 1.0], 3))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_nans_rank_above_infinities(implementation):
  x = jnp.zeros(256).at[jnp.array([3, 50, 90, 200])].set(
      jnp.array([-jnp.inf, jnp.nan, jnp.inf, -jnp.nan])
  )
  indices, _ = topk.block_topk(x, k=3, block_size=256, implementation=implementation)
  np.testing.assert_array_equal(indices, [3, 50, 200])


@pytest.mark.parametrize("shape", [(0,), (0, 3)])
@pytest.mark.parametrize("implementation", [None, "xla", "interpret"])
def test_zero_size(shape, implementation):
  indices, values = topk.block_topk(
      jnp.zeros(shape, jnp.bfloat16), k=2, block_size=256, implementation=implementation
  )
  assert indices.shape == values.shape == (0,)
  assert indices.dtype == jnp.int16 and values.dtype == jnp.bfloat16


@pytest.mark.parametrize("block_size, index_dtype", [(2**15, jnp.int16), (2**15 + 1, jnp.int32)])
def test_index_dtype(block_size, index_dtype):
  x = jnp.arange(10.0)  # only a tail block
  indices, _ = topk.block_topk(x, k=block_size, block_size=block_size)
  assert indices.dtype == index_dtype
  np.testing.assert_array_equal(indices, np.arange(10))


def test_odd_length_and_jit():
  x = draw_input("integers", (3, 333), jnp.float32, fresh_seed())
  jitted = jax.jit(lambda x: topk.block_topk(x, k=np.int64(4), block_size=128))
  expected = topk.block_topk(x, k=4, block_size=128, implementation="xla")
  assert_same_selection(jitted(x), expected, "jit")
  assert expected[0].shape == (topk.selection_size(999, k=4, block_size=128),)


@hypothesis.given(
    size=st.integers(0, 10**6), block_size=st.integers(1, 5000), data=st.data()
)
def test_selection_size_counts_every_block(size, block_size, data):
  k = data.draw(st.integers(1, block_size), label="k")
  full_blocks, tail = divmod(size, block_size)
  tail_keep = min(tail, max(1, math.ceil(k * tail / block_size))) if tail else 0
  assert topk.selection_size(size, k=k, block_size=block_size) == full_blocks * k + tail_keep


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(k=0, block_size=256), "k"),
        (dict(k=257, block_size=256), "k"),
        (dict(k=1.5, block_size=256), "k"),
        (dict(k=True, block_size=256), "k"),
        (dict(k=1, block_size=0), "block_size"),
        (dict(k=1, block_size=2**31 + 1), "block_size"),
        (dict(k=1, block_size=256, implementation="cuda"), "implementation"),
        (dict(k=1, block_size=100, implementation="interpret"), "block_size"),
        (dict(k=1, block_size=100, implementation="pallas"), "block_size"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, argument):
  with pytest.raises(ValueError, match=f"^{argument} must"):
    topk.block_topk(jnp.ones(300), **kwargs)


def test_bad_x_and_size_name_themselves():
  with pytest.raises(ValueError, match="^x must"):
    topk.block_topk(jnp.ones(300, jnp.int32), k=1, block_size=256)
  with jax.enable_x64(True):
    with pytest.raises(ValueError, match="^x must"):
      topk.block_topk(jnp.ones(300, jnp.float64), k=1, block_size=256, implementation="interpret")
  with pytest.raises(ValueError, match="^size must"):
    topk.selection_size(-1, k=1, block_size=256)
  with pytest.raises(ValueError, match="^k must"):
    topk.selection_size(10, k=5, block_size=4)


def test_auto_takes_xla_for_block_sizes_the_kernel_lacks():
  x = draw_input("normal", (450,), jnp.float32, fresh_seed())
  expected = topk.block_topk(x, k=3, block_size=100, implementation="xla")
  assert_same_selection(topk.block_topk(x, k=3, block_size=100), expected, "auto")


def numpy_zero_selected(x, k: int, block_size: int) -> np.ndarray:
  """Zeros at the positions numpy_block_topk selects: the scatter that zero_selected avoids."""
  flat = np.asarray(x).reshape(-1).copy()
  indices, _ = numpy_block_topk(x, k, block_size)
  offset = 0
  for start in range(0, flat.size, block_size):
    width = min(block_size, flat.size - start)
    keep = k if width == block_size else min(width, max(1, math.ceil(k * width / block_size)))
    flat[start + indices[offset : offset + keep]] = 0
    offset += keep
  return flat.reshape(np.shape(x))


@pytest.mark.parametrize("kind", ["normal", "integers", "sparse", "special"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, k, block_size", KERNEL_CASES + [((0,), 3, 8), ((10,), 3, 4)])
def test_zero_selected_equals_zeroing_the_selected_positions(shape, k, block_size, dtype, kind):
  seed = fresh_seed()
  x = draw_input(kind, shape, dtype, seed)
  indices, values = topk.block_topk(x, k=k, block_size=block_size)
  zeroed = topk.zero_selected(x, indices, values, k=k, block_size=block_size)
  chex.assert_shape(zeroed, shape)
  chex.assert_type(zeroed, dtype)
  expected = numpy_zero_selected(np.asarray(x.astype(jnp.float32)), k, block_size)
  # Bitwise, so a -0.0 left in place or a NaN payload would show.
  np.testing.assert_array_equal(
      np.asarray(zeroed.astype(jnp.float32)).view(np.uint32),
      expected.astype(np.float32).view(np.uint32),
      err_msg=f"seed={seed}",
  )


def test_zero_selected_rejects_a_selection_it_cannot_have_come_from():
  x = jnp.ones((300,))
  indices, values = topk.block_topk(x, k=4, block_size=128)
  with pytest.raises(ValueError, match="indices and values must have shape"):
    topk.zero_selected(x, indices[:-1], values[:-1], k=4, block_size=128)
  with pytest.raises(ValueError, match="block_size"):
    topk.zero_selected(x, indices, values, k=4, block_size=0)
  with pytest.raises(ValueError, match="values must have x's dtype"):
    topk.zero_selected(x, indices, values.astype(jnp.bfloat16), k=4, block_size=128)
  with pytest.raises(ValueError, match="floating dtype"):
    topk.zero_selected(x.astype(jnp.int32), indices, values, k=4, block_size=128)
