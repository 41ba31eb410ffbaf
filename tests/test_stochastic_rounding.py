"""Stochastic rounding of the updates of bfloat16 and float16 parameters.

The rounded values are checked against their two neighbours in the
parameter's format, found here with numpy and ``ml_dtypes`` (round to
nearest, then ``nextafter``), and their mean against the float32 sum within
the standard error that the rounding's definition gives:
``(hi - lo) sqrt(f (1 - f) / n)`` for a remainder ``f = (x - lo) / (hi - lo)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import optax_memopt
from optax_memopt import stochastic_rounding, with_stochastic_rounding
from tests.test_checkpoint import bitwise

DTYPES = [jnp.bfloat16, jnp.float16]


def neighbours(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
  """The largest ``dtype`` number ``<= x`` and the smallest ``>= x`` (both ``x`` where it is one), as float64."""
  dtype = np.dtype(dtype)
  with np.errstate(over="ignore"):
    nearest = x.astype(dtype)
    above = nearest.astype(np.float32) > x
    below = nearest.astype(np.float32) < x
    lo = np.where(above, np.nextafter(nearest, np.array(-np.inf, dtype)), nearest)
    hi = np.where(below, np.nextafter(nearest, np.array(np.inf, dtype)), nearest)
  return lo.astype(np.float64), hi.astype(np.float64)


@jax.jit
def rounded_step(params, updates, state):
  """One update of ``stochastic_rounding`` (seed in ``state``) and the parameters it lands on."""
  rounded, state = stochastic_rounding().update(updates, state, params)
  return optax.apply_updates(params, rounded), rounded, state


def land(params, updates, seed):
  return rounded_step(params, updates, stochastic_rounding(seed).init(params))[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_mean_of_rounded_values_is_the_float32_sum(dtype, seed):
  """64 sums ``p + u`` over several binades and both signs, each rounded in 2048 entries."""
  rng = np.random.default_rng(seed)
  rows, draws = 64, 2048
  p = (rng.choice([-1, 1], rows) * rng.uniform(1, 2, rows) * 2.0 ** rng.integers(-8, 8, rows)).astype(dtype)
  spacing = np.abs(np.nextafter(p, np.array(np.inf, p.dtype)).astype(np.float32) - p.astype(np.float32))
  # Updates of up to three spacings; the first rows' are whole spacings, which land exactly.
  u = (spacing * rng.uniform(-3, 3, rows)).astype(np.float32)
  u[:4] = spacing[:4] * np.array([0, 1, -2, 3], np.float32)
  x = p.astype(np.float32) + u
  lo, hi = neighbours(x, dtype)

  params = {"w": jnp.broadcast_to(jnp.asarray(p)[:, None], (rows, draws))}
  landed = np.asarray(land(params, {"w": jnp.broadcast_to(jnp.asarray(u)[:, None], (rows, draws))}, seed)["w"])
  landed = landed.astype(np.float64)

  assert landed.dtype == np.float64 and np.all((landed == lo[:, None]) | (landed == hi[:, None]))
  remainder = np.where(hi > lo, (x - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
  standard_error = (hi - lo) * np.sqrt(remainder * (1 - remainder) / draws)
  error = np.abs(landed.mean(axis=1) - x.astype(np.float64))
  # Five standard errors: a false alarm in one of 64 rows about once in 25000 runs;
  # rounding to nearest misses by up to half a spacing, 22 standard errors.
  assert np.all(error <= 5 * standard_error), (error / np.maximum(standard_error, 1e-300)).max()
  assert np.all(error[:4] == 0)


def update_families(p: np.ndarray, rng) -> np.ndarray:
  """Updates of every size against ``p``: relative, absolute, cancelling ``p`` down to its last bits."""
  pf = p.astype(np.float64)
  magnitude = np.where(pf == 0, 1.0, np.abs(pf))
  with np.errstate(over="ignore", invalid="ignore"):
    families = [
      rng.standard_normal(p.shape) * magnitude * 2.0 ** rng.integers(-40, 40, p.shape),
      rng.standard_normal(p.shape) * 2.0 ** rng.integers(-140, 120, p.shape),
      -pf * (1 - 2.0 ** -rng.integers(1, 30, p.shape)) + rng.standard_normal(p.shape) * magnitude * 2.0**-24,
      -pf + rng.standard_normal(p.shape) * magnitude * 2.0 ** rng.integers(-40, 0, p.shape),
    ]
    u = np.stack(families, axis=1).astype(np.float32)
  return np.where(np.isfinite(u), u, 0).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_apply_updates_lands_exactly_on_a_neighbour_for_every_parameter(dtype, seed):
  """Every finite ``dtype`` number as ``p``, against updates from tiny to beyond ``p``'s binade.

  ``optax.apply_updates`` adds the float32 update and casts back: the result
  is one of the two neighbours of the float32 sum, never a value that a
  rounding of the update itself or of the sum to ``dtype`` would give.
  """
  rng = np.random.default_rng(seed)
  p = np.arange(2**16, dtype=np.uint16).view(np.dtype(dtype))
  p = p[np.isfinite(p.astype(np.float32))]
  u = update_families(p, rng)
  p = np.broadcast_to(p[:, None], u.shape)
  with np.errstate(over="ignore"):
    x = p.astype(np.float32) + u
  lo, hi = neighbours(x, dtype)

  params = {"w": jnp.asarray(p)}
  landed = land(params, {"w": jnp.asarray(u)}, seed)["w"]
  assert landed.dtype == dtype
  landed = np.asarray(landed).astype(np.float64)
  # XLA:CPU flushes float32 subnormals to zero (module docstring of optax_memopt.stochastic_rounding).
  normal = lambda v: (v == 0) | (np.abs(v) >= 2.0**-100)
  wrong = ~((landed == lo) | (landed == hi)) & normal(p.astype(np.float32)) & normal(x)
  assert not wrong.any(), (p[wrong][:5], u[wrong][:5], landed[wrong][:5], lo[wrong][:5], hi[wrong][:5])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_non_finite_values_stay_non_finite(dtype):
  p = jnp.asarray([np.inf, -np.inf, np.nan, 1.0, 1.0, -1.0, 0.0], dtype)
  u = jnp.asarray([1.0, 1.0, 1.0, np.nan, np.inf, -np.inf, 0.0], jnp.float32)
  landed = np.asarray(land({"w": p}, {"w": u}, 0)["w"]).astype(np.float32)
  np.testing.assert_array_equal(landed, [np.inf, -np.inf, np.nan, np.nan, np.inf, -np.inf, 0.0])


def test_float32_updates_pass_through_bit_for_bit():
  params = {"float32": jnp.ones((6,), jnp.float32), "bfloat16": jnp.ones((6,), jnp.bfloat16)}
  bits = np.array([0x80000000, 0x7FC01234, 0x7F800000, 0x00000001, 0x3F800001, 0xBDCCCCCD], np.uint32)
  updates = {"float32": jnp.asarray(bits.view(np.float32)), "bfloat16": jnp.full((6,), 0.1, jnp.float32)}
  optimizer = stochastic_rounding(0)
  state = optimizer.init(params)

  eager, _ = optimizer.update(updates, state, params)
  assert eager["float32"] is updates["float32"]
  jitted, _ = rounded_step(params, updates, state)[1:]
  np.testing.assert_array_equal(np.asarray(jitted["float32"]).view(np.uint32), bits)


def test_same_seed_replays_and_each_step_draws_anew(seed):
  """The key is in the state: same seed, same run; each step and each leaf its own bits."""
  # A quarter of the spacing above 1 (2**-7): about a quarter of the entries round up.
  params = {"a": jnp.ones((512,), jnp.bfloat16), "b": jnp.ones((512,), jnp.bfloat16)}
  updates = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-9, jnp.float32), params)

  def run(key, steps=3):
    state, landed = stochastic_rounding(key).init(params), []
    for _ in range(steps):
      new_params, _, state = rounded_step(params, updates, state)
      landed.append(new_params)
    return landed, state

  landed, state = run(seed)
  assert bitwise(run(seed)) == bitwise((landed, state))
  assert bitwise(run(jax.random.key(seed))) == bitwise((landed, state))
  assert bitwise(run(jax.random.key_data(jax.random.key(seed)))) == bitwise((landed, state))
  assert int(state.count) == 3 and state.key.dtype == jnp.uint32
  patterns = [np.asarray(step[leaf]).tobytes() for step in landed for leaf in ("a", "b")]
  assert len(set(patterns)) == len(patterns), "a step or a leaf reused another's random bits"
  assert bitwise(run(seed + 1)[0]) != bitwise(landed)


def test_bad_arguments_raise_errors_naming_them():
  with pytest.raises(ValueError, match="seed"):
    stochastic_rounding(1.5)
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  optimizer = stochastic_rounding(0)
  with pytest.raises(ValueError, match="params"):
    optimizer.update(params, optimizer.init(params))


def test_small_updates_move_bfloat16_parameters_in_expectation():
  """AdamW steps of 1e-3 at weights near 1 (spacing 2**-7): lost to rounding to nearest, kept in expectation by SR."""
  n, steps = 4096, 16
  start = jnp.ones((n,), jnp.bfloat16)
  grads = {"w": jnp.ones((n,), jnp.float32)}
  adamw = optax.adamw(1e-3, weight_decay=0.0)

  def run(optimizer, params):
    step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*optimizer.update(grads, s, p)))
    state = optimizer.init(params)
    for _ in range(steps):
      params, state = step(params, state)
    return np.asarray(params["w"]).astype(np.float64)

  float32 = run(adamw, {"w": start.astype(jnp.float32)})
  nearest = run(adamw, {"w": start})
  rounded = run(with_stochastic_rounding(adamw, seed=0), {"w": start})
  # Each step moves float32 by about 1e-3 (Adam's first steps are sign steps).
  assert abs(float32.mean() - (1 - steps * 1e-3)) < 1e-4
  assert np.all(nearest == 1.0)
  # Each entry ends on the grid around float32's value; the mean within 5 standard errors of it.
  assert abs(rounded.mean() - float32.mean()) < 5 * 2.0**-8 * 0.5 / np.sqrt(n)


def test_inside_inject_hyperparams_after_optax_adamw():
  """A seed that ``inject_hyperparams`` turns into an array draws the bits of the plain seed."""
  params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16), "b": jnp.zeros((8,), jnp.float32)}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3, jnp.float32), params)
  adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)

  def run(rounding):
    optimizer = optax.chain(adamw, rounding)
    updates, state = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates), state[1]

  injected_params, injected_state = run(optax.inject_hyperparams(stochastic_rounding)(seed=3))
  plain_params, plain_state = run(stochastic_rounding(3))
  assert bitwise(injected_params) == bitwise(plain_params)
  assert bitwise(injected_state.inner_state) == bitwise(plain_state)


class BFloat16Classifier(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(32, 16, param_dtype=jnp.bfloat16, rngs=rngs)
    self.out = nnx.Linear(16, 4, param_dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, tokens):
    return self.out(self.embed(tokens)).astype(jnp.float32)


@nnx.jit
def nnx_step(model, optimizer, tokens, labels):
  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def assert_resumes_bitwise_from_orbax(tx: optax.GradientTransformation, tmp_path, seed: int) -> None:
  """``tx`` trains a bfloat16 model under ``nnx.Optimizer``, and a run restored from an orbax checkpoint
  midway steps as the uninterrupted one, bit for bit."""
  tokens = jnp.arange(32)
  labels = jax.random.randint(jax.random.key(seed), (32,), 0, 4)

  def build(model_seed):
    model = BFloat16Classifier(nnx.Rngs(model_seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  model, optimizer = build(seed)
  losses = [float(nnx_step(model, optimizer, tokens, labels)) for _ in range(2)]
  ocp_dir = tmp_path / "checkpoint"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(ocp_dir, nnx.state((model, optimizer)))
  checkpointer.wait_until_finished()
  losses += [float(nnx_step(model, optimizer, tokens, labels)) for _ in range(2)]

  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(seed + 1)))
  resumed_model, resumed_optimizer = nnx.merge(graphdef, ocp.StandardCheckpointer().restore(ocp_dir, abstract))
  resumed = [float(nnx_step(resumed_model, resumed_optimizer, tokens, labels)) for _ in range(2)]

  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  assert resumed == losses[2:]
  assert bitwise(nnx.to_pure_dict(nnx.state((resumed_model, resumed_optimizer)))) == bitwise(
    nnx.to_pure_dict(nnx.state((model, optimizer)))
  )


def test_nnx_optimizer_with_bfloat16_parameters_resumes_bitwise_from_orbax(tmp_path, seed):
  tx = with_stochastic_rounding(optax_memopt.adamw_8bit(1e-2, block_size=16, min_quantized_size=32), seed=seed)
  assert_resumes_bitwise_from_orbax(tx, tmp_path, seed)
