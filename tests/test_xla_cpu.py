"""The XLA:CPU scheduling aids: the same values as the plain computation, on "cpu" and elsewhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import xla_cpu


def step(g, m):
  """A leaf's (direction, state) with every kind of value the chain passes through."""
  m = 0.5 * m + g
  return jnp.sign(m) * jnp.abs(g), m, (m > 0).astype(jnp.uint8), m.astype(jnp.float8_e4m3fn)


def trees(seed):
  rng = np.random.default_rng(seed)
  g = {
      "a": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
      "b": [jnp.asarray(rng.normal(size=(7,)), jnp.bfloat16), jnp.asarray([-0.0, np.nan, np.inf], jnp.float32)],
      "c": jnp.zeros((0, 4), jnp.float32),
  }
  m = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), g)
  return g, m


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_equals_tree_map_bit_for_bit(monkeypatch, backend, seed):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  g, m = trees(seed)
  expected = jax.jit(lambda g, m: jax.tree.map(step, g, m))(g, m)
  actual = jax.jit(lambda g, m: xla_cpu.tree_map(step, g, m))(g, m)
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32), err_msg=f"seed={seed}")
    assert a.dtype == e.dtype


def test_each_leaf_waits_for_the_previous_leafs_state_on_cpu_only(monkeypatch):
  g, m = trees(0)
  hlo = lambda: jax.jit(lambda g, m: xla_cpu.tree_map(step, g, m)).lower(g, m).as_text()
  chained = hlo()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  independent = hlo()
  # The waits are subtractions of a zero computed from the previous state.
  assert chained.count("subtract") > independent.count("subtract")


def test_waits_on_float8_state_are_integer_operations(seed):
  g, _ = trees(seed)
  codes = jax.tree.map(lambda x: x.astype(jnp.float8_e4m3fn), g)
  hlo = jax.jit(lambda g, c: xla_cpu.tree_map(lambda g, c: (g, c), g, c)).lower(g, codes).as_text()
  waits = [line for line in hlo.splitlines() if "subtract" in line]
  assert waits and not [line for line in waits if "f8E4M3FN" in line]  # XLA:CPU's float8 math is software.
  got = jax.jit(lambda g, c: xla_cpu.tree_map(lambda g, c: (g, c), g, c))(g, codes)
  expected = jax.tree.map(lambda g, c: (g, c), g, codes)
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(e).view(np.uint8))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_waits_for_chooses_what_the_next_leaf_waits_for(monkeypatch, backend, seed):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  g, m = trees(seed)
  waited = []

  def codes_only(direction, m, positive, low_precision):
    waited.append(positive)
    return positive

  expected = jax.jit(lambda g, m: jax.tree.map(step, g, m))(g, m)
  actual = jax.jit(lambda g, m: xla_cpu.tree_map(step, g, m, waits_for=codes_only))(g, m)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))
  # Called between leaves on XLA:CPU only.
  assert len(waited) == (len(jax.tree.leaves(g)) - 1 if backend == "cpu" else 0)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_written_out_is_the_value(monkeypatch, backend, seed):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  x = jnp.asarray(np.random.default_rng(seed).normal(size=(4, 6)), jnp.float32).at[0, 0].set(-0.0)
  for value in (x, x[:0], x.astype(jnp.bfloat16)):
    got = jax.jit(lambda v: xla_cpu.written_out(v * 2))(value)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(value * 2).view(np.uint8))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("width", [1, 7, 32, 48, 64, 96, 1000, 1024])
@pytest.mark.parametrize("reduce,combine", [(jnp.max, jnp.maximum), (jnp.min, jnp.minimum)])
def test_reduce_row_is_the_reduction(monkeypatch, backend, width, reduce, combine, seed):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  x = jnp.asarray(np.random.default_rng(seed).integers(-1000, 1000, size=(3, 2, width)), jnp.int32)
  got = jax.jit(lambda v: xla_cpu.reduce_row(v, reduce, combine))(x)
  np.testing.assert_array_equal(got, np.asarray(reduce(np.asarray(x), axis=-1, keepdims=True)))
