"""Properties every optimizer of the library shares with optax's own.

The checklist of optax's contrib test harness: jit, dtype preservation,
state stability through ``lax.cond``, ``inject_hyperparams``, schedules,
``MultiSteps``, chains, masking, no retracing, convergence on a small problem.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_memopt import state_nbytes
from tests.optimizer_cases import CASES

NAMES = sorted(CASES)


def make_params(dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return {
      "dense": {
          "kernel": jax.random.normal(keys[0], (24, 40), dtype) * 0.2,
          "bias": jnp.zeros((40,), dtype),
      },
      "embed": {"embedding": jax.random.normal(keys[1], (50, 24), dtype) * 0.2},
      "norm": {"scale": jnp.ones((24,), dtype)},
  }


def quadratic_loss(params, target):
  return sum(
      jnp.sum((p.astype(jnp.float32) - t) ** 2)
      for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target))
  )


def make_target(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
      treedef,
      [jax.random.normal(k, p.shape, jnp.float32) * 0.5 for k, p in zip(keys, leaves)],
  )


def fresh_seed():
  return int(np.random.SeedSequence().entropy % (2**31))


def build(name, **overrides):
  case = CASES[name]
  return case.factory(**{**case.kwargs, **overrides})


def shapes_and_dtypes(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jitted_updates_preserve_param_dtype_and_state_layout(name, dtype):
  opt = build(name)
  params = make_params(dtype)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
  state = jax.jit(opt.init)(params)
  updates, new_state = jax.jit(opt.update)(grads, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
  assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
  chex.assert_tree_all_finite(updates)


@pytest.mark.parametrize("name", NAMES)
def test_state_is_stable_through_lax_cond(name):
  opt = build(name)
  params = make_params()
  target = make_target(params, fresh_seed())

  @jax.jit
  def step(params, state, take_step):
    grads = jax.grad(quadratic_loss)(params, target)
    updates, new_state = jax.lax.cond(
        take_step,
        lambda: opt.update(grads, state, params),
        lambda: (jax.tree.map(jnp.zeros_like, params), state),
    )
    return optax.apply_updates(params, updates), new_state

  state = opt.init(params)
  for take_step in (True, False, True):
    params, new_state = step(params, state, take_step)
    assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
    state = new_state


@pytest.mark.parametrize("name", NAMES)
def test_update_does_not_retrace_across_steps(name):
  opt = build(name)
  params = make_params()
  target = make_target(params, fresh_seed())
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(None)
    grads = jax.grad(quadratic_loss)(params, target)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  for _ in range(4):
    params, state = step(params, state)
  assert len(traces) == 1


@pytest.mark.parametrize("name", NAMES)
def test_reduces_a_quadratic_loss(name):
  opt = build(name)
  params = make_params()
  target = make_target(params, fresh_seed())
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(quadratic_loss)(params, target)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  initial = quadratic_loss(params, target)
  for _ in range(150):
    params, state, _ = step(params, state)
  # Every method here moves each tracked coordinate by about the learning
  # rate per step; 150 steps of 1e-2 cover the targets' spread, so the loss
  # must fall well below its start. A diverging or frozen optimizer cannot.
  assert quadratic_loss(params, target) < 0.5 * initial


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams_matches_plain(name):
  case = CASES[name]
  injected = optax.inject_hyperparams(case.factory, static_args=case.static_args)(
      **case.kwargs
  )
  plain = build(name)
  params = make_params()
  target = make_target(params, fresh_seed())
  plain_state, injected_state = plain.init(params), injected.init(params)
  for _ in range(3):
    grads = jax.grad(quadratic_loss)(params, target)
    plain_updates, plain_state = jax.jit(plain.update)(grads, plain_state, params)
    injected_updates, injected_state = jax.jit(injected.update)(
        grads, injected_state, params
    )
    chex.assert_trees_all_close(injected_updates, plain_updates, rtol=1e-5, atol=1e-7)
    params = optax.apply_updates(params, plain_updates)


@pytest.mark.parametrize("name", NAMES)
def test_constant_schedule_equals_constant_learning_rate(name):
  learning_rate = CASES[name].kwargs["learning_rate"]
  with_schedule = build(name, learning_rate=optax.constant_schedule(learning_rate))
  with_float = build(name)
  params = make_params()
  target = make_target(params, fresh_seed())
  states = [with_schedule.init(params), with_float.init(params)]
  for _ in range(3):
    grads = jax.grad(quadratic_loss)(params, target)
    (u_schedule, states[0]), (u_float, states[1]) = (
        jax.jit(with_schedule.update)(grads, states[0], params),
        jax.jit(with_float.update)(grads, states[1], params),
    )
    chex.assert_trees_all_close(u_schedule, u_float, rtol=1e-6)
    params = optax.apply_updates(params, u_float)


@pytest.mark.parametrize("name", NAMES)
def test_multi_steps_accumulates_before_updating(name):
  opt = optax.MultiSteps(build(name), every_k_schedule=3)
  params = make_params()
  target = make_target(params, fresh_seed())
  state = opt.init(params)
  update = jax.jit(opt.update)
  for micro_step in range(3):
    grads = jax.grad(quadratic_loss)(params, target)
    updates, state = update(grads, state, params)
    if micro_step < 2:
      chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  assert any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", NAMES)
def test_chains_after_clipping_and_under_a_mask(name):
  params = make_params()
  only_dense = {k: k == "dense" for k in params}
  opt = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.masked(build(name), only_dense),
  )
  target = make_target(params, fresh_seed())
  state = opt.init(params)
  grads = jax.grad(quadratic_loss)(params, target)
  updates, state = jax.jit(opt.update)(grads, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
  # Masked-out leaves pass through as the clipped gradients.
  clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  chex.assert_trees_all_close(updates["embed"], clipped["embed"])
  assert state_nbytes(state) > 0


@pytest.mark.parametrize("name", NAMES)
def test_skipped_non_finite_step_leaves_state_unchanged(name):
  opt = optax.apply_if_finite(build(name), max_consecutive_errors=5)
  params = make_params()
  target = make_target(params, fresh_seed())
  state = opt.init(params)
  grads = jax.grad(quadratic_loss)(params, target)
  _, state = jax.jit(opt.update)(grads, state, params)
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  updates, after = jax.jit(opt.update)(bad, state, params)
  chex.assert_trees_all_equal(after.inner_state, state.inner_state)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
