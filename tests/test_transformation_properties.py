"""Properties every optimizer of the library shares with optax's own.

The checklist of optax's contrib test harness: jit, dtype preservation,
state stability through ``lax.cond``, ``inject_hyperparams``, schedules,
``MultiSteps``, chains, masking, no retracing, bias-corrected steps that descend.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
    jnp.sum((p.astype(jnp.float32) - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target))
  )


def make_target(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    treedef,
    [jax.random.normal(k, p.shape, jnp.float32) * 0.5 for k, p in zip(keys, leaves)],
  )


def build(name, **overrides):
  case = CASES[name]
  return case.factory(**{**case.kwargs, **overrides})


def shapes_and_dtypes(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_jitted_updates_preserve_param_dtype_and_state_layout(name, dtype):
  # float64 needs jax_enable_x64, as in optax's contrib harness, which runs
  # every optimizer on float64 parameters.
  with jax.enable_x64(dtype == jnp.float64):
    opt = build(name)
    params = make_params(dtype)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
    state = jax.jit(opt.init)(params)
    updates, new_state = jax.jit(opt.update)(grads, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
  assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
  chex.assert_tree_all_finite(updates)


@pytest.mark.parametrize("name", NAMES)
def test_state_is_stable_through_lax_cond(name, seed):
  opt = build(name)
  params = make_params()
  target = make_target(params, seed)

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
def test_update_does_not_retrace_across_steps(name, seed):
  opt = build(name)
  params = make_params()
  target = make_target(params, seed)
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


def norm(tree) -> float:
  return float(jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(tree))))


# The second step over the first, in norm, on a constant gradient. Bias
# correction makes Adam's moment estimates exact there from the first step,
# so steps keep their size, up to what the stored state's rounding explains:
# float32 (a few ulps); 8-bit and fp8 codes, MicroAdam's 4-bit error feedback
# (under 1%; measured 0.1-0.3%); 4-bit AdamW's v, whose linear code has no
# zero and rounds small entries up to 1/16 of their block's largest, which
# shrinks the second step (measured 0.87-0.89 over 40 seeds); ternary Adam's
# m, stochastically rounded trits whose variance lengthens it (measured
# 1.04-1.31). A wrong bias correction moves the ratio by a factor: 1.9 or
# 0.71 with the first or second moment's correction left out, 1.33 or 0.87
# with either taken one step late. Ternary Adam's noise hides the late ones.
STEP_RATIO_RANGE = {
  "optax_adamw": (1 - 1e-5, 1 + 1e-5),
  "adam_mini": (1 - 1e-5, 1 + 1e-5),
  "taco": (1 - 1e-5, 1 + 1e-5),
  "adamw_8bit": (0.99, 1.01),
  "adamw_fp8": (0.99, 1.01),
  "microadam": (0.99, 1.01),
  "adamw_4bit": (0.8, 1.0),
  "ternary_adam": (1.0, 1.45),
}


@pytest.mark.parametrize("name", NAMES)
def test_steps_on_a_constant_gradient_keep_their_size_and_descend(name, seed):
  opt = build(name)
  params = make_params()
  grads = jax.grad(quadratic_loss)(params, make_target(params, seed))
  update = jax.jit(opt.update)
  state = opt.init(params)
  steps = []
  for _ in range(2):
    updates, state = update(grads, state, params)
    steps.append(updates)
  low, high = STEP_RATIO_RANGE[name]
  ratio = norm(steps[1]) / norm(steps[0])
  assert low <= ratio <= high, f"{name}, seed {seed}: second step {ratio:.4f} of the first"
  for updates in steps:
    along_gradient = sum(
      jnp.vdot(u.astype(jnp.float32), g) for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads))
    )
    assert along_gradient < 0, f"{name}, seed {seed}: a step up the gradient"


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams_matches_plain(name, seed):
  case = CASES[name]
  injected = optax.inject_hyperparams(case.factory, static_args=case.static_args)(**case.kwargs)
  params = make_params()
  target = make_target(params, seed)
  injected_state = injected.init(params)
  # The plain optimizer gets the float32 numbers inject_hyperparams holds:
  # 1 - 0.9 rounds differently in float64 and float32, and a last-bit
  # difference in a moment can flip a quantized state's code.
  held = {k: np.float32(v) for k, v in injected_state.hyperparams.items()}
  plain = build(name, **held)
  plain_state = plain.init(params)
  for _ in range(3):
    grads = jax.grad(quadratic_loss)(params, target)
    plain_updates, plain_state = jax.jit(plain.update)(grads, plain_state, params)
    injected_updates, injected_state = jax.jit(injected.update)(grads, injected_state, params)
    chex.assert_trees_all_close(injected_updates, plain_updates, rtol=1e-5, atol=1e-7)
    params = optax.apply_updates(params, plain_updates)


@pytest.mark.parametrize("name", NAMES)
def test_constant_schedule_equals_constant_learning_rate(name, seed):
  learning_rate = CASES[name].kwargs["learning_rate"]
  with_schedule = build(name, learning_rate=optax.constant_schedule(learning_rate))
  with_float = build(name)
  params = make_params()
  target = make_target(params, seed)
  states = [with_schedule.init(params), with_float.init(params)]
  for _ in range(3):
    grads = jax.grad(quadratic_loss)(params, target)
    (u_schedule, states[0]), (u_float, states[1]) = (
      jax.jit(with_schedule.update)(grads, states[0], params),
      jax.jit(with_float.update)(grads, states[1], params),
    )
    chex.assert_trees_all_close(u_schedule, u_float, rtol=1e-6)
    params = optax.apply_updates(params, u_float)


# Micro-batches per optimizer step and optimizer steps compared.
MICRO_STEPS = 2
CYCLES = 3


def on_dyadic_grid(tree, rng):
  """Random gradients whose means over ``MICRO_STEPS`` are exact in float32.

  Multiples of 2**-12 (of magnitude far below 2**11): a sum of two has at most
  24 significant bits, so it is exact in float32, and halving is exact; optax's
  running mean ``a + (g - a) / 2`` and the plain mean are then the same
  float32 numbers, and the runs compared see identical gradients.
  """
  return jax.tree.map(lambda p: jnp.asarray(np.round(rng.normal(0.0, 0.1, p.shape) * 4096) / 4096, p.dtype), tree)


def assert_same_values(actual, expected, what: str) -> None:
  """Same structure; codes (integers, narrow floats) equal, float32 within a few ulps."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True):
    where = f"{what}{jax.tree_util.keystr(path)}"
    got, want = np.asarray(got), np.asarray(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), where
    if jnp.issubdtype(got.dtype, jnp.floating) and jnp.finfo(got.dtype).bits >= 32:
      # Same inputs, same program, compiled inside and outside lax.cond: XLA
      # may fuse differently, which moves a float32 result by an ulp or two
      # (rtol 1e-6 is 8 ulps).
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=where)
    else:
      unsigned = f"u{got.itemsize}"
      np.testing.assert_array_equal(got.view(unsigned), want.view(unsigned), err_msg=where)


@pytest.mark.parametrize("name", NAMES)
def test_multi_steps_equal_steps_on_the_mean_gradient(name, seed):
  """Every cycle of ``optax.MultiSteps`` is one inner step on the cycle's mean gradient.

  The reference runs the inner optimizer directly on the averaged gradients;
  the accumulating run must emit zero updates inside a cycle and, at each
  cycle's end, the reference's updates, parameters and state. Ternary Adam's
  rounding key advances once per inner step, so both runs draw the same bits.
  """
  rng = np.random.default_rng(seed)
  inner = build(name)
  accumulating = optax.MultiSteps(build(name), every_k_schedule=MICRO_STEPS)
  params = reference_params = make_params()
  state = accumulating.init(params)
  reference_state = inner.init(reference_params)
  update, reference_update = jax.jit(accumulating.update), jax.jit(inner.update)
  for cycle in range(CYCLES):
    micro_batches = [on_dyadic_grid(params, rng) for _ in range(MICRO_STEPS)]
    for micro_step, grads in enumerate(micro_batches):
      updates, state = update(grads, state, params)
      if micro_step < MICRO_STEPS - 1:
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
      params = optax.apply_updates(params, updates)
    mean = jax.tree.map(lambda *g: sum(g) / MICRO_STEPS, *micro_batches)
    reference_updates, reference_state = reference_update(mean, reference_state, reference_params)
    reference_params = optax.apply_updates(reference_params, reference_updates)
    context = f"cycle {cycle}, seed {seed}: "
    assert_same_values(updates, reference_updates, context + "updates")
    assert_same_values(params, reference_params, context + "params")
    assert_same_values(state.inner_opt_state, reference_state, context + "state")


@pytest.mark.parametrize("name", NAMES)
def test_chains_after_clipping_and_under_a_mask(name, seed):
  params = make_params()
  only_dense = {k: k == "dense" for k in params}
  opt = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.masked(build(name), only_dense),
  )
  target = make_target(params, seed)
  state = opt.init(params)
  grads = jax.grad(quadratic_loss)(params, target)
  updates, state = jax.jit(opt.update)(grads, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
  clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  # Masked-out leaves pass through as the clipped gradients; the masked-in
  # ones are the optimizer's step on the clipped gradients of those alone
  # (float32 roundings apart: the global norm is summed in another program).
  alone = build(name)
  dense = {"dense": params["dense"]}
  expected, _ = jax.jit(alone.update)({"dense": clipped["dense"]}, alone.init(dense), dense)
  for key in params:
    want = expected["dense"] if only_dense[key] else clipped[key]
    chex.assert_trees_all_close(updates[key], want, rtol=1e-6, atol=1e-9, custom_message=f"{key}, seed {seed}")


@pytest.mark.parametrize("name", NAMES)
def test_skipped_non_finite_step_leaves_state_unchanged(name, seed):
  opt = optax.apply_if_finite(build(name), max_consecutive_errors=5)
  params = make_params()
  target = make_target(params, seed)
  state = opt.init(params)
  grads = jax.grad(quadratic_loss)(params, target)
  _, state = jax.jit(opt.update)(grads, state, params)
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  updates, after = jax.jit(opt.update)(bad, state, params)
  chex.assert_trees_all_equal(after.inner_state, state.inner_state)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
