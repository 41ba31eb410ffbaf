"""Training with bfloat16 parameters falls like training in float32.

Every optimizer of the registry runs the same short descent twice on the
quadratic of ``tests/test_transformation_properties.py`` (loss and gradient
taken in float32, parameters stored as float32 or as bfloat16) from the same
start, the float32 one rounded to bfloat16, so both start at the same point.

The bound. Write ``D = sqrt(loss)``, the Euclidean distance to the target.
bfloat16 keeps 8 significant bits: rounding moves a value by at most 2**-8 of
its magnitude, so a vector by at most ``2**-8`` of its norm. A bfloat16 step
is the float32 step with its update rounded to bfloat16 and the sum rounded
again; if steps did not amplify a difference in position (these methods take
normalised steps of about the learning rate per coordinate, whose direction a
small change of position does not turn while the target is far, and the
quadratic pulls both runs in near it), the two runs stay within
``sum_t 2**-8 (|p_t| + |u_t|)`` of each other, summed over the float32 run's
parameters ``p_t`` (from the rounded start) and updates ``u_t``. By the
triangle inequality ``D`` then differs by no more than that sum. The descent
is long enough that the float32 run's ``D`` falls by more than twice the
bound, so a bfloat16 run within the bound falls by at least half as much:
the test fails an optimizer that stalls in bfloat16 (updates below the
parameters' spacing lost), drifts, or turns non-finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.optimizer_cases import CASES
from tests.test_transformation_properties import build, make_params, make_target, quadratic_loss

NAMES = sorted(CASES)
STEPS = 20
# Three times the registry's: each step moves the parameters well beyond
# their bfloat16 spacing, and the descent is a large multiple of the bound
# (below) in few steps.
LEARNING_RATE = 3e-2
BFLOAT16_ROUNDING = 2.0**-8  # Largest rounding error relative to the value rounded.


def norm(tree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(tree)))


def descend(optimizer, params, target):
  """``sqrt(loss)`` at the start and after each step, and the sum of ``|p_t| + |u_t|``."""

  @jax.jit
  def step(params, state):
    grads = jax.grad(quadratic_loss)(params, target)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return params, state, jnp.sqrt(quadratic_loss(params, target)), norm(params) + norm(updates)

  state = optimizer.init(params)
  distances = [float(jnp.sqrt(quadratic_loss(params, target)))]
  magnitudes = float(norm(params))
  for _ in range(STEPS):
    params, state, distance, magnitude = step(params, state)
    distances.append(float(distance))
    magnitudes += float(magnitude)
  return params, distances, magnitudes


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_parameters_descend_like_float32(name, seed):
  start = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params(seed=seed % 1000))
  target = make_target(start, seed)
  float32_start = jax.tree.map(lambda p: p.astype(jnp.float32), start)
  _, float32_distances, magnitudes = descend(
      build(name, learning_rate=LEARNING_RATE), float32_start, target
  )
  bfloat16_params, bfloat16_distances, _ = descend(
      build(name, learning_rate=LEARNING_RATE), start, target
  )
  bound = BFLOAT16_ROUNDING * magnitudes
  context = (
      f"{name}, seed {seed}: distance to the target from {float32_distances[0]:.4f} to"
      f" {float32_distances[-1]:.4f} in float32, {bfloat16_distances[-1]:.4f} in bfloat16;"
      f" bound {bound:.4f}"
  )

  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(bfloat16_params)), context
  assert np.all(np.isfinite(bfloat16_distances)), context
  # The claim below says something only if float32 falls well beyond the bound.
  assert float32_distances[0] - float32_distances[-1] > 2 * bound, context
  assert abs(bfloat16_distances[-1] - float32_distances[-1]) <= bound, context
