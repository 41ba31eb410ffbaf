"""MicroAdam's window update: XLA against the spec's formulas, the Mosaic GPU kernel against XLA."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import microadam_update as mu
from pallas_kernels import topk

pytestmark = pytest.mark.kernels


def fresh_seed():
  return int(np.random.SeedSequence().entropy % (2**31))


def random_ring(rng, *, window, size, k, block_size):
  """A ring of ``window`` rows of distinct, ascending block-local indices and bf16 values."""
  full_blocks, tail = divmod(size, block_size)
  lengths = [block_size] * full_blocks + ([tail] if tail else [])
  tail_k = topk.selection_size(size, k=k, block_size=block_size) - full_blocks * k
  keeps = [k] * full_blocks + ([tail_k] if tail else [])
  indices = np.stack([
      np.concatenate([
          np.sort(rng.choice(length, keep, replace=False))
          for length, keep in zip(lengths, keeps)
      ])
      for _ in range(window)
  ]).astype(np.int16)
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
    # (size, block_size, k, window, count): full blocks and a shorter tail,
    # a tensor smaller than one block, an exact multiple of the block.
    (3 * 512 + 300, 512, 9, 4, 3),
    (3 * 512 + 300, 512, 9, 4, 9),
    (700, 1024, 20, 3, 7),
    (2 * 256, 256, 256, 2, 1),
]


@pytest.mark.parametrize("size, block_size, k, window, count", CASES)
def test_xla_matches_the_spec_formulas(size, block_size, k, window, count):
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  indices, values, lengths, keeps = random_ring(
      rng, window=window, size=size, k=k, block_size=block_size
  )
  b1, b2, eps = 0.9, 0.99, 1e-3
  got = mu.microadam_update(
      jnp.asarray(indices), jnp.asarray(values), count, b1, b2, eps,
      size=size, k=k, block_size=block_size, implementation="xla",
  )
  want = numpy_update(
      indices, values.astype(np.float64), lengths, keeps,
      count=count, b1=b1, b2=b2, eps=eps, block_size=block_size,
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-6, err_msg=f"seed={seed}")


@pytest.mark.parametrize("size, block_size, k, window, count", CASES)
def test_kernel_in_interpreter_matches_xla(size, block_size, k, window, count):
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  indices, values, _, _ = random_ring(
      rng, window=window, size=size, k=k, block_size=block_size
  )
  args = (jnp.asarray(indices), jnp.asarray(values), count, 0.9, 0.999, 1e-8)
  kwargs = dict(size=size, k=k, block_size=block_size)
  want = mu.microadam_update(*args, **kwargs, implementation="xla")
  got = mu.microadam_update(*args, **kwargs, implementation="interpret")
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7, custom_message=f"seed={seed}")
  assert got.shape == (size,) and got.dtype == jnp.float32


def test_window_weights_wrap_ages_and_skip_unwritten_rows():
  window, b1, b2 = 3, 0.5, 0.25
  for count in range(1, 8):
    weights = np.asarray(mu.window_weights(count, b1, b2, window=window))
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


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_untouched_entries_get_zero_even_with_zero_eps(implementation):
  indices = jnp.array([[3], [3]], jnp.int16)
  values = jnp.array([[2.0], [0.0]], jnp.bfloat16)
  update = mu.microadam_update(
      indices, values, 1, 0.9, 0.999, 0.0, size=300, k=1, block_size=512,
      implementation=implementation,
  )
  want = np.zeros(300, np.float32)
  want[3] = 1.0  # Step 1 of Adam: sign(g).
  np.testing.assert_array_equal(np.asarray(update), want)


def test_flat_positions_follow_block_major_layout():
  x = jnp.asarray(np.random.default_rng(fresh_seed()).normal(size=1000), jnp.float32)
  indices, values = topk.block_topk(x, k=5, block_size=128, implementation="xla")
  positions = mu.flat_positions(indices, k=5, block_size=128)
  np.testing.assert_array_equal(np.asarray(x[positions]), np.asarray(values))


def test_rejects_bad_shapes_and_kernel_block_sizes():
  ring = jnp.zeros((2, 4), jnp.int16)
  with pytest.raises(ValueError, match="indices must have shape"):
    mu.microadam_update(ring, ring, 1, 0.9, 0.999, 1e-8, size=100, k=3, block_size=50)
  with pytest.raises(ValueError, match="values must have the shape"):
    mu.microadam_update(
        ring, ring[:1], 1, 0.9, 0.999, 1e-8, size=100, k=2, block_size=50
    )
  for block_size in (100, mu.MAX_KERNEL_BLOCK_SIZE + 256):
    size = 2 * block_size
    ring = jnp.zeros((1, topk.selection_size(size, k=1, block_size=block_size)), jnp.int16)
    with pytest.raises(ValueError, match="block_size must be a multiple of 256"):
      mu.microadam_update(
          ring, ring, 1, 0.9, 0.999, 1e-8, size=size, k=1, block_size=block_size,
          implementation="pallas",
      )
  with pytest.raises(ValueError, match="implementation"):
    mu.microadam_update(
        ring, ring, 1, 0.9, 0.999, 1e-8, size=size, k=1, block_size=block_size,
        implementation="triton",
    )
