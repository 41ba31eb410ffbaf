"""Training with bfloat16 parameters falls like training in float32.

Every optimizer of the registry runs the same short descent twice on the
quadratic of ``tests/test_transformation_properties.py`` (loss and gradient
taken in float32, parameters stored as float32 or as bfloat16) from the same
start, the float32 one rounded to bfloat16, so both start at the same point,
and the two runs' distances to the target (``sqrt(loss)``) after 20 steps
are compared.

The bound. bfloat16 keeps 8 significant bits, so every parameter and update
of the bfloat16 run is rounded by up to 2**-8 of itself. Summed as if every
rounding pushed the same way, that allows the runs to end about 1 apart
(0.86-1.30 here); in fact the roundings go both ways and mostly cancel. Over
60 seeds per optimizer (a fresh start and target each) the bfloat16 run
ended between 0.033 nearer and 0.086 farther than the float32 one (optax's
AdamW the farthest: its moments are bfloat16 too, 0.070-0.086 behind; every
other method within 0.04), a spread of a few thousandths per optimizer. The
bound is twice the largest difference seen, 0.17: a seed that lands beyond
it is far outside every optimizer's spread. The float32 runs fall by 6 to 22
in those 20 steps, so the bound is under 3% of the smallest descent: a
bfloat16 run that stalls (updates below the parameters' spacing lost),
drifts, or turns non-finite fails. A third run, each optimizer followed by
``optax_memopt.stochastic_rounding``, keeps bfloat16 parameters too and is
held to the same bound: over 8 seeds per optimizer it ended between 0.021
nearer and 0.085 farther than float32 (optax's AdamW again the farthest,
0.071-0.085: its bfloat16 moments, not the parameters' rounding; every
other method within 0.032).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_memopt import with_stochastic_rounding
from tests.optimizer_cases import CASES
from tests.test_transformation_properties import build, make_params, make_target, quadratic_loss

NAMES = sorted(CASES)
STEPS = 20
# Three times the registry's: each step moves the parameters well beyond
# their bfloat16 spacing, and the descent is a large multiple of the bound
# in few steps.
LEARNING_RATE = 3e-2
# The largest |bfloat16 - float32| distance after STEPS seen over 60 seeds of
# every optimizer (module docstring), and the bound: twice that.
LARGEST_OBSERVED_DIFFERENCE = 0.086
BOUND = 2 * LARGEST_OBSERVED_DIFFERENCE


def descend(optimizer, params, target):
  """``sqrt(loss)`` at the start and after each step, and the final parameters."""

  @jax.jit
  def step(params, state):
    grads = jax.grad(quadratic_loss)(params, target)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return params, state, jnp.sqrt(quadratic_loss(params, target))

  state = optimizer.init(params)
  distances = [float(jnp.sqrt(quadratic_loss(params, target)))]
  for _ in range(STEPS):
    params, state, distance = step(params, state)
    distances.append(float(distance))
  return params, distances


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_parameters_descend_like_float32(name, seed):
  start = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params(seed=seed % 1000))
  target = make_target(start, seed)
  float32_start = jax.tree.map(lambda p: p.astype(jnp.float32), start)
  _, float32_distances = descend(build(name, learning_rate=LEARNING_RATE), float32_start, target)
  bfloat16_params, bfloat16_distances = descend(build(name, learning_rate=LEARNING_RATE), start, target)
  rounded_params, rounded_distances = descend(
    with_stochastic_rounding(build(name, learning_rate=LEARNING_RATE), seed), start, target
  )
  context = (
    f"{name}, seed {seed}: distance to the target from {float32_distances[0]:.4f} to"
    f" {float32_distances[-1]:.4f} in float32, {bfloat16_distances[-1]:.4f} in bfloat16,"
    f" {rounded_distances[-1]:.4f} with stochastic rounding; bound {BOUND:.3f}"
  )

  for params, distances in ((bfloat16_params, bfloat16_distances), (rounded_params, rounded_distances)):
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params)), context
    assert np.all(np.isfinite(distances)), context
    assert abs(distances[-1] - float32_distances[-1]) <= BOUND, context
  # The claim says something only if float32 falls well beyond the bound.
  assert float32_distances[0] - float32_distances[-1] > 20 * BOUND, context
