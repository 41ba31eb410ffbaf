"""pallas_kernels._backend.one_leaf_at_a_time, zeros_after and sum_after: same values, fewer temporaries alive."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import optax_memopt
from pallas_kernels import _backend

# XLA's scheduling and fusion, which these helpers steer, change between JAX
# versions: the newest JAX's CI run takes these tests too.
pytestmark = pytest.mark.kernels


def fresh_seed():
  return int(np.random.SeedSequence().entropy % (2**31))


def special_values(rng, dtype, size):
  """Random values with -0.0, NaN and infinities (for floats) at random places."""
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=size, endpoint=True, dtype=dtype)
  x = rng.standard_normal(size).astype(dtype)
  specials = np.array([-0.0, np.nan, np.inf, -np.inf], dtype)
  x[rng.choice(size, size=len(specials), replace=False)] = specials
  return x


def temporary_bytes(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


# The next leaf waits for all results, or for some (the others, for instance
# the first, left to fuse into their consumers); in one chain or two.
@pytest.mark.parametrize("awaited, chains", [(None, 1), ((1, 3), 1), ((1, 3), 2)])
def test_values_are_those_of_independent_leaves(awaited, chains):
  rng = np.random.default_rng(fresh_seed())
  dtypes = [np.float32, ml_dtypes.bfloat16, np.float16, np.uint8, np.int16, np.int32]
  leaves = [jnp.asarray(special_values(rng, dtype, 37)) for dtype in dtypes]
  flags = [jnp.asarray(rng.random(5) < 0.5) for _ in dtypes]  # bool: passed as is.
  empty = [jnp.zeros((0, 3), jnp.float32) for _ in dtypes]

  def update_leaf(x, flag, nothing):
    # The arguments back, plus work of their own for the next leaf to wait for.
    return x, flag, nothing, jnp.cumsum(x.astype(jnp.float32))

  chained = jax.jit(
      lambda *columns: _backend.one_leaf_at_a_time(
          update_leaf, *columns, waiting=(0, 1, 2), awaited=awaited, chains=chains
      )
  )(leaves, flags, empty)
  independent = [update_leaf(*args) for args in zip(leaves, flags, empty)]
  # Bit for bit: -0.0 stays -0.0 and NaN stays NaN.
  for got, want in zip(jax.tree.leaves(chained), jax.tree.leaves(independent)):
    chex.assert_type(got, want.dtype)
    np.testing.assert_array_equal(
        np.asarray(got).view(f"u{got.dtype.itemsize}") if got.size else np.asarray(got),
        np.asarray(want).view(f"u{want.dtype.itemsize}") if want.size else np.asarray(want),
    )


@pytest.mark.parametrize("chains", [1, 2])
def test_temporaries_are_those_of_one_leaf_per_chain(chains):
  # Each leaf writes a temporary of its own size; XLA:CPU, scheduling stage by
  # stage, keeps every leaf's alive at once unless the leaves are chained.
  count, size = 8, 1 << 16
  leaves = [jnp.full((size,), float(i)) for i in range(count)]

  def update_leaf(x):
    temporary = _backend.written_out(jnp.sin(x))
    return temporary * 2 + jnp.cumsum(temporary[:8]).sum()

  one_leaf = size * 4
  independent = temporary_bytes(lambda leaves: [update_leaf(x) for x in leaves], leaves)
  chained = temporary_bytes(
      lambda leaves: _backend.one_leaf_at_a_time(update_leaf, leaves, waiting=(0,), chains=chains),
      leaves,
  )
  assert independent >= 4 * one_leaf  # What the chaining is for.
  assert chained <= (chains + 1) * one_leaf


def test_results_not_awaited_fuse_into_their_consumers():
  # An optimizer's direction, applied to the parameters in the same step: read
  # by the next leaf's zero it is written out (one leaf's worth of temporary
  # memory at a time); not awaited, XLA computes it inside the update of the
  # parameters.
  count, size = 8, 1 << 16
  params = [jnp.full((size,), 1.0 + i) for i in range(count)]
  grads = [jnp.full((size,), 2.0 + i) for i in range(count)]
  moments = [jnp.full((size,), 3.0 + i) for i in range(count)]

  def update_leaf(grad, moment):
    moment = 0.9 * moment + 0.1 * grad
    return moment / (jnp.sqrt(jnp.abs(grad)) + 1e-3), moment

  def step(params, grads, moments, awaited):
    results = _backend.one_leaf_at_a_time(
        update_leaf, grads, moments, waiting=(0, 1), awaited=awaited
    )
    return [p - 0.1 * direction for p, (direction, _) in zip(params, results)], [
        moment for _, moment in results
    ]

  def compiled(awaited):
    return jax.jit(lambda *args: step(*args, awaited), donate_argnums=(0, 2)).lower(
        params, grads, moments
    ).compile()

  one_leaf = size * 4
  assert compiled(None).memory_analysis().temp_size_in_bytes >= one_leaf
  assert compiled((1,)).memory_analysis().temp_size_in_bytes <= one_leaf // 16
  expected = step(params, grads, moments, None)
  got = compiled((1,))(*jax.tree.map(jnp.copy, (params, grads, moments)))
  for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(got_leaf, want_leaf)


# At 40M parameters the chaining took ternary Adam's temporary buffer from
# 55.6 to 7.8 MB (JAX 0.10; 48.6 to 19.0 MB on JAX 0.12; 6.4 and 18.1 MB
# now, with its two chains), and MicroAdam's, with zeros_after for its window's
# scatter target, from 94.8 to 14.0 MB at 10M: under glibc's 32 MiB
# threshold for fresh pages at every call. Here, sixteen leaves alike:
# ternary Adam's 4.5x less on JAX 0.10 and 2.1x on JAX 0.12, MicroAdam's
# 11x on both.
@pytest.mark.parametrize(
    "build, shape, at_most",
    [
        (optax_memopt.scale_by_ternary_adam, (256, 1024), 0.7),
        (optax_memopt.scale_by_microadam, (64, 16384), 0.5),
    ],
)
def test_optimizer_step_keeps_fewer_temporaries_alive(monkeypatch, build, shape, at_most):
  params = {f"w{i}": jnp.zeros(shape) for i in range(16)}

  def step_temporary_bytes():
    opt = build()
    return temporary_bytes(opt.update, params, opt.init(params))

  chained = step_temporary_bytes()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # Independent leaves.
  independent = step_temporary_bytes()
  assert chained <= at_most * independent


@pytest.mark.parametrize("shape, dtype", [((5, 3), jnp.float32), ((0,), jnp.bfloat16), ((4,), jnp.int32)])
def test_zeros_after_are_positive_zeros(shape, dtype):
  after = jnp.asarray([-0.0, np.nan, 1.0])
  zeros = jax.jit(lambda after: _backend.zeros_after(shape, dtype, after))(after)
  chex.assert_shape(zeros, shape)
  chex.assert_type(zeros, dtype)
  np.testing.assert_array_equal(
      np.asarray(zeros).view(f"u{zeros.dtype.itemsize}"), np.zeros(shape, f"u{zeros.dtype.itemsize}")
  )


def test_zeros_after_wait_for_their_argument():
  after = jnp.ones((3,))
  jaxpr = jax.make_jaxpr(lambda after: _backend.zeros_after((4,), jnp.float32, after))(after)
  assert "bitcast_convert_type" in str(jaxpr)  # Read from `after`, not a constant.


@pytest.mark.parametrize("shape, axis", [((6, 33), -1), ((6, 33), 0), ((3, 5, 17), (0, 2))])
def test_sum_after_is_the_sum(shape, axis):
  rng = np.random.default_rng(fresh_seed())
  x = jnp.asarray(special_values(rng, np.float32, int(np.prod(shape))).reshape(shape))
  after = jnp.asarray(special_values(rng, np.float32, 4))
  got = jax.jit(lambda x, after: _backend.sum_after(x, axis, after=after))(x, after)
  want = jax.jit(lambda x: jnp.sum(x, axis=axis))(x)
  chex.assert_shape(got, want.shape)
  chex.assert_type(got, jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # NaN where the sum has one.


def test_sum_after_waits_for_its_argument():
  jaxpr = jax.make_jaxpr(lambda x, after: _backend.sum_after(x, -1, after=after))(
      jnp.ones((4, 3)), jnp.ones((2,))
  )
  assert "bitcast_convert_type" in str(jaxpr)  # The starting zero is read from `after`.


def test_sums_after_read_their_argument_as_given():
  # Two reductions and a loop read each leaf's argument: offset by the zero
  # that makes it wait, XLA:CPU writes a copy of it out for the reductions
  # (one leaf's worth of temporary memory); read as given, with the
  # reductions waiting through their starting zero, it copies nothing.
  count, shape = 8, (256, 256)
  xs = [jnp.full(shape, 1.0 + i) for i in range(count)]
  states = [jnp.full(shape[:1], 2.0 + i) for i in range(count)]

  def update_leaf(x, state, x_as_given, reads_as_given):
    read = x_as_given if reads_as_given else x
    # Each reduction squares the argument itself (as ternary Adam's statistics do).
    read_again = jax.lax.optimization_barrier(read)
    if reads_as_given:
      rows = _backend.sum_after(jnp.square(read), -1, after=state)
      columns = _backend.sum_after(jnp.square(read_again), -2, after=state)
    else:
      rows = jnp.sum(jnp.square(read), axis=-1)
      columns = jnp.sum(jnp.square(read_again), axis=-2)
    return x * rows[:, None] * columns, 0.9 * state + rows

  def step(xs, states, reads_as_given):
    return _backend.one_leaf_at_a_time(
        lambda *args: update_leaf(*args, reads_as_given), xs, states, xs, waiting=(0, 1), awaited=(1,)
    )

  one_leaf = 4 * np.prod(shape)
  assert temporary_bytes(lambda *args: step(*args, False), xs, states) >= one_leaf
  assert temporary_bytes(lambda *args: step(*args, True), xs, states) <= one_leaf // 64
  as_given = jax.jit(lambda *args: step(*args, True))(xs, states)
  offset = jax.jit(lambda *args: step(*args, False))(xs, states)
  for got, want in zip(jax.tree.leaves(as_given), jax.tree.leaves(offset)):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_other_backends_get_independent_leaves(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  leaves = [jnp.ones((4,)), jnp.ones((3,))]
  chained = jax.make_jaxpr(
      lambda leaves: _backend.one_leaf_at_a_time(jnp.sin, leaves, waiting=(0,))
  )(leaves)
  independent = jax.make_jaxpr(lambda leaves: [jnp.sin(x) for x in leaves])(leaves)
  assert str(chained) == str(independent)
  zeros = jax.make_jaxpr(lambda x: _backend.zeros_after((4,), jnp.float32, x))(leaves[0])
  assert str(zeros) == str(jax.make_jaxpr(lambda x: jnp.zeros((4,), jnp.float32))(leaves[0]))
  total = jax.make_jaxpr(lambda x: _backend.sum_after(x, 0, after=x))(leaves[0])
  assert str(total) == str(jax.make_jaxpr(lambda x: jnp.sum(x, axis=0))(leaves[0]))


def test_waiting_must_name_columns():
  with pytest.raises(ValueError, match="waiting"):
    _backend.one_leaf_at_a_time(jnp.sin, [jnp.ones(3)], waiting=(1,))


@pytest.mark.parametrize("chains", [0, 1.0, True])
def test_chains_must_be_a_positive_int(chains):
  with pytest.raises(ValueError, match="chains"):
    _backend.one_leaf_at_a_time(jnp.sin, [jnp.ones(3)], waiting=(0,), chains=chains)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize(
    "update_leaf, awaited",
    [(jnp.sin, (0,)), (lambda x: (x, jnp.sin(x)), (2,)), (lambda x: (x, jnp.sin(x)), (-1,))],
)
def test_awaited_must_name_results(monkeypatch, backend, update_leaf, awaited):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  with pytest.raises(ValueError, match="awaited"):
    _backend.one_leaf_at_a_time(update_leaf, [jnp.ones(3)] * 2, waiting=(0,), awaited=awaited)
