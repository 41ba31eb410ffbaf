"""MicroAdam's window update: the plain-jnp reference against the formulas in
numpy, and the sorted, per-index XLA path against the reference."""

from __future__ import annotations

import math

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import microadam_update


def documented_keep(length: int, density: float) -> int:
  """The top-k's documented rule: ``min(n, max(1, ceil(n * density)))`` of a block of ``n``."""
  if length == 0:
    return 0
  return min(length, max(1, math.ceil(round(length * density, 9))))


def random_ring(rng, *, window, size, density, block_size):
  """A ring of ``window`` rows of distinct, ascending block-local indices and bf16 values."""
  full_blocks, tail = divmod(size, block_size)
  lengths = [block_size] * full_blocks + ([tail] if tail else [])
  keeps = [documented_keep(length, density) for length in lengths]
  indices = np.stack(
    [
      np.concatenate([np.sort(rng.choice(length, keep, replace=False)) for length, keep in zip(lengths, keeps)])
      for _ in range(window)
    ]
  ).astype(np.int16)
  values = rng.normal(size=indices.shape).astype(ml_dtypes.bfloat16)
  return indices, values, lengths, keeps


def numpy_update(indices, values, lengths, keeps, *, count, b1, b2, eps, block_size):
  """The spec's steps 5 and 6, written out per row and per block in float64."""
  window = indices.shape[0]
  size = sum(lengths)
  first, second = np.zeros(size), np.zeros(size)
  for row in range(min(count, window)):
    age = (count - 1 - row) % window
    entry = 0
    for block, keep in enumerate(keeps):
      for _ in range(keep):
        position = block * block_size + int(indices[row, entry])
        value = float(values[row, entry])
        first[position] += b1**age * value
        second[position] += b2**age * value**2
        entry += 1
  c1 = (1 - b1) / (1 - b1**count)
  c2 = (1 - b2) / (1 - b2**count)
  with np.errstate(invalid="ignore", divide="ignore"):
    update = c1 * first / (np.sqrt(c2 * second) + eps)
  return np.where(second == 0, 0.0, update)


CASES = [
  # (size, block_size, density, window, count): full blocks (k = 9) and a
  # shorter tail (keeps 6), before and after the ring wraps; a tensor
  # smaller than one block whose entries (14) are fewer than a full
  # block's k (21); an exact multiple of the block at density 1.
  (3 * 512 + 300, 512, 0.0175, 4, 3),
  (3 * 512 + 300, 512, 0.0175, 4, 9),
  (700, 1024, 0.02, 3, 7),
  (2 * 256, 256, 1.0, 2, 1),
]
B1, B2, EPS = 0.9, 0.99, 1e-3


def case_inputs(seed, size, block_size, density, window):
  rng = np.random.default_rng(seed)
  return random_ring(rng, window=window, size=size, density=density, block_size=block_size)


@pytest.mark.parametrize("size, block_size, density, window, count", CASES)
def test_reference_matches_the_spec_formulas(size, block_size, density, window, count, seed):
  indices, values, lengths, keeps = case_inputs(seed, size, block_size, density, window)
  got = microadam_update.microadam_update_reference(
    jnp.asarray(indices),
    jnp.asarray(values),
    count,
    B1,
    B2,
    EPS,
    size=size,
    density=density,
    block_size=block_size,
  )
  want = numpy_update(
    indices,
    values.astype(np.float64),
    lengths,
    keeps,
    count=count,
    b1=B1,
    b2=B2,
    eps=EPS,
    block_size=block_size,
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-6, err_msg=f"seed={seed}")


@pytest.mark.parametrize("size, block_size, density, window, count", CASES)
def test_update_matches_reference(size, block_size, density, window, count, seed):
  indices, values, _, _ = case_inputs(seed, size, block_size, density, window)
  args = (jnp.asarray(indices), jnp.asarray(values), count, 0.9, 0.999, 1e-8)
  kwargs = dict(size=size, density=density, block_size=block_size)
  want = microadam_update.microadam_update_reference(*args, **kwargs)
  got = microadam_update.microadam_update(*args, **kwargs)
  chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7, custom_message=f"seed={seed}")
  assert got.shape == (size,) and got.dtype == jnp.float32


@pytest.mark.parametrize("count", [3, 9])
def test_chunked_blocks_match_reference(count, seed, monkeypatch):
  # Seven full blocks in chunks of two: three chunks through the loop, then
  # the seventh block, then the tail block.
  size, block_size, density, window = 7 * 256 + 100, 256, 0.04, 4
  k = documented_keep(block_size, density)
  monkeypatch.setattr(microadam_update, "WINDOW_ENTRIES_AT_ONCE", 2 * window * k)
  microadam_update._microadam_update.clear_cache()
  indices, values, _, _ = case_inputs(seed, size, block_size, density, window)
  args = (jnp.asarray(indices), jnp.asarray(values), count, 0.9, 0.999, 1e-8)
  kwargs = dict(size=size, density=density, block_size=block_size)
  program = microadam_update._microadam_update.lower(*args, **kwargs).as_text()
  got = microadam_update.microadam_update(*args, **kwargs)
  microadam_update._microadam_update.clear_cache()
  assert "stablehlo.while" in program
  want = microadam_update.microadam_update_reference(*args, **kwargs)
  chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7, custom_message=f"seed={seed}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("entries_at_once", [None, 2 * 4 * 11])
def test_a_narrower_dtype_gives_the_float32_update_rounded(dtype, entries_at_once, seed):
  # Without and with the loop over chunks of blocks (two blocks of 11 entries per row, 4 rows).
  size, block_size, density, window = 5 * 512 + 300, 512, 0.02, 4
  indices, values, _, _ = case_inputs(seed, size, block_size, density, window)
  args = (jnp.asarray(indices), jnp.asarray(values), 6, 0.9, 0.999, 1e-8)
  kwargs = dict(size=size, density=density, block_size=block_size, entries_at_once=entries_at_once)
  got = microadam_update.microadam_update(*args, dtype=dtype, **kwargs)
  float32 = microadam_update.microadam_update(*args, **kwargs)
  assert got.dtype == dtype and got.shape == (size,)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(float32.astype(dtype)), err_msg=f"seed={seed}")


def test_window_weights_wrap_ages_and_skip_unwritten_rows():
  window, b1, b2 = 3, 0.5, 0.25
  for count in range(1, 8):
    weights = np.asarray(microadam_update.window_weights(count, b1, b2, window=window))
    c1 = (1 - b1) / (1 - b1**count)
    c2 = (1 - b2) / (1 - b2**count)
    # Independent bookkeeping: step s (1-based) wrote row (s - 1) % window,
    # and a row holds the newest step that wrote it.
    newest = {}
    for step in range(1, count + 1):
      newest[(step - 1) % window] = step
    for row in range(window):
      if row in newest:
        age = count - newest[row]
        want = [c1 * b1**age, c2 * b2**age]
      else:
        want = [0.0, 0.0]
      np.testing.assert_allclose(weights[:, row], want, rtol=1e-6, err_msg=f"t={count} r={row}")


def test_untouched_entries_get_zero_even_with_zero_eps():
  indices = jnp.array([[3], [3]], jnp.int16)  # density 0.001 keeps 1 of a tail of 300
  values = jnp.array([[2.0], [0.0]], jnp.bfloat16)
  update = microadam_update.microadam_update(
    indices, values, 1, 0.9, 0.999, 0.0, size=300, density=0.001, block_size=512
  )
  want = np.zeros(300, np.float32)
  want[3] = 1.0  # Step 1 of Adam: sign(g).
  np.testing.assert_array_equal(np.asarray(update), want)


def test_flat_positions_follow_block_major_layout():
  # Blocks of 128 keep k = 5 entries each, the tail of 104 keeps 4.
  indices = jnp.array([0, 7, 9, 100, 127] * 7 + [1, 2, 50, 103], jnp.int16)
  positions = np.asarray(microadam_update.flat_positions(indices, k=5, block_size=128))
  blocks = np.repeat(np.arange(8), [5] * 7 + [4])
  np.testing.assert_array_equal(positions, blocks * 128 + np.asarray(indices))


def test_rejects_bad_shapes():
  ring = jnp.zeros((2, 4), jnp.int16)
  with pytest.raises(ValueError, match="indices must have shape"):
    microadam_update.microadam_update(ring, ring, 1, 0.9, 0.999, 1e-8, size=100, density=0.06, block_size=50)
  with pytest.raises(ValueError, match="values must have the shape"):
    microadam_update.microadam_update(ring, ring[:1], 1, 0.9, 0.999, 1e-8, size=100, density=0.04, block_size=50)
  with pytest.raises(ValueError, match="^density must"):
    microadam_update.microadam_update(ring, ring, 1, 0.9, 0.999, 1e-8, size=100, density=0.0, block_size=50)
  for dtype in (jnp.float64, jnp.int32, jnp.float8_e4m3fn, "float", None):
    with pytest.raises(ValueError, match="^dtype must have one of the dtypes bfloat16, float16, float32"):
      microadam_update.microadam_update(
        ring, ring, 1, 0.9, 0.999, 1e-8, size=100, density=0.04, block_size=50, dtype=dtype
      )
