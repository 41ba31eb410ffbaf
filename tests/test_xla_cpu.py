"""The XLA:CPU scheduling aids: the same bits as the plain computation, and only in CPU programs."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import _backend, lowbit_adamw_update, xla_cpu


def assert_same_bits(actual, expected, err_msg=""):
  """Equal bit patterns: -0.0 is not +0.0, and one NaN is not another."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape
  np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8), err_msg=err_msg)


def lowered(fn, *args, platform):
  with _backend.cuda_lowering_context():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text(debug_info=True)


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


def test_equals_tree_map_bit_for_bit(seed):
  g, m = trees(seed)
  expected = jax.jit(lambda g, m: jax.tree.map(step, g, m))(g, m)
  actual = jax.jit(lambda g, m: xla_cpu.tree_map(step, g, m))(g, m)
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert_same_bits(a, e, err_msg=f"seed={seed}")


def test_each_leaf_waits_for_the_previous_leafs_state_in_cpu_programs_only():
  g, m = trees(0)
  fn = lambda g, m: xla_cpu.tree_map(step, g, m)
  on_cpu, on_cuda = (lowered(fn, g, m, platform=p) for p in ("cpu", "cuda"))
  # The waits are subtractions of a zero computed from the previous state.
  assert on_cpu.count("subtract") > on_cuda.count("subtract")
  assert xla_cpu.SCOPE in on_cpu and xla_cpu.SCOPE not in on_cuda
  assert lowered(lambda g, m: jax.tree.map(step, g, m), g, m, platform="cuda").count("subtract") == on_cuda.count(
    "subtract"
  )


def test_waits_on_float8_state_are_integer_operations(seed):
  g, _ = trees(seed)
  codes = jax.tree.map(lambda x: x.astype(jnp.float8_e4m3fn), g)
  hlo = jax.jit(lambda g, c: xla_cpu.tree_map(lambda g, c: (g, c), g, c)).lower(g, codes).as_text()
  waits = [line for line in hlo.splitlines() if "subtract" in line]
  assert waits and not [line for line in waits if "f8E4M3FN" in line]  # XLA:CPU's float8 math is software.
  got = jax.jit(lambda g, c: xla_cpu.tree_map(lambda g, c: (g, c), g, c))(g, codes)
  expected = jax.tree.map(lambda g, c: (g, c), g, codes)
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    assert_same_bits(a, e)


class Moments(NamedTuple):
  """An op's state that names what the next leaf waits for."""

  m: jax.Array
  codes: jax.Array
  scales: jax.Array | None

  awaited_fields = ("scales",)


@pytest.mark.parametrize("with_scales", [True, False])
def test_a_state_naming_awaited_fields_is_waited_for_by_those_fields(monkeypatch, seed, with_scales):
  g, m = trees(seed)
  returned, waited = [], []
  zero_after = xla_cpu._zero_after
  monkeypatch.setattr(
    xla_cpu, "_zero_after", lambda values: waited.append(jax.tree.leaves(values)) or zero_after(values)
  )

  def moments_step(g, m):
    direction, m, codes, _ = step(g, m)
    moments = Moments(m, codes, jnp.sum(jnp.abs(m), keepdims=True) if with_scales else None)
    returned.append(moments)
    return direction, moments

  expected = jax.jit(lambda g, m: jax.tree.map(moments_step, g, m))(g, m)
  returned.clear()
  actual = jax.jit(lambda g, m: xla_cpu.tree_map(moments_step, g, m))(g, m)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert_same_bits(a, e)
  # Between leaves, the previous leaf's scales; its arrays where it has none.
  assert len(waited) == len(jax.tree.leaves(g)) - 1
  for values, moments in zip(waited, returned):
    expected_values = [moments.scales] if with_scales else [moments.m, moments.codes]
    assert len(values) == len(expected_values) and all(v is e for v, e in zip(values, expected_values))


def test_lowbit_adamws_next_leaf_waits_for_the_scales_not_the_codes():
  moments = lowbit_adamw_update.zero_moments((4, 256), state_format="8bit", block_size=256)
  assert xla_cpu._awaited((moments,)) == [[moments.mu_scales, moments.nu_scales]]


def test_written_out_is_the_value_and_only_in_cpu_programs(seed):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=(4, 6)), jnp.float32).at[0, 0].set(-0.0)
  for value in (x, x[:0], x.astype(jnp.bfloat16)):
    got = jax.jit(lambda v: xla_cpu.written_out(v * 2))(value)
    assert_same_bits(got, value * 2)
  fn = lambda v: xla_cpu.written_out(v * 2)
  assert "dynamic_update_slice" in lowered(fn, x, platform="cpu")
  assert "dynamic_update_slice" not in lowered(fn, x, platform="cuda")


@pytest.mark.parametrize("width", [1, 7, 32, 48, 64, 96, 1000, 1024])
@pytest.mark.parametrize(
  "reduce,init,combine", [(jnp.max, np.iinfo(np.int32).min, lax.max), (jnp.min, np.iinfo(np.int32).max, lax.min)]
)
def test_reduce_row_of_wide_rows_is_the_reduction(width, reduce, init, combine, seed):
  x = jnp.asarray(np.random.default_rng(seed).integers(-1000, 1000, size=(3, 2, width)), jnp.int32)
  fn = lambda v: xla_cpu.reduce_row(v, np.int32(init), combine, fold_to=xla_cpu.FUSED_REDUCTION)
  got = jax.jit(fn)(x)
  np.testing.assert_array_equal(got, np.asarray(reduce(np.asarray(x), axis=-1)))
  in_cuda_program = lowered(fn, x, platform="cuda")
  assert xla_cpu.SCOPE not in in_cuda_program and in_cuda_program.count("stablehlo.reduce") == 1


@pytest.mark.parametrize("width", [1, 3, 32, 128, 96, 1000, 1024])
def test_reduce_row_of_a_tuple_gives_the_reductions_values_and_only_folds_in_cpu_programs(width, seed):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=(3, 2, width)), jnp.float32).at[0, 0, 0].set(-0.0)
  combine = lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1]))
  fn = lambda x: xla_cpu.reduce_row((x * x, jnp.abs(x)), (np.float32(0), np.float32(-np.inf)), combine)
  squares, maxima = jax.jit(fn)(x)
  assert_same_bits(maxima, np.abs(np.asarray(x)).max(axis=-1))
  np.testing.assert_allclose(squares, (np.asarray(x, np.float64) ** 2).sum(axis=-1), rtol=1e-5)
  in_cuda_program = lowered(fn, x, platform="cuda")
  assert xla_cpu.SCOPE not in in_cuda_program and in_cuda_program.count("stablehlo.reduce") == 1
  assert xla_cpu.SCOPE in lowered(fn, x, platform="cpu")
