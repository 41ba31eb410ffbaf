"""Saving and restoring every optimizer's state with orbax in the middle of training.

A run interrupted after a few steps, saved with ``orbax.checkpoint``,
restored into freshly built objects (the restore target is
``jax.eval_shape`` of a new optimizer's ``init``, as a new process has) and
resumed must equal the uninterrupted run bitwise: step counts, integer
codes, low-precision values and every parameter. Restoring into a sharded
layout is checked on 8 devices by ``tests/test_sharding.py``.
"""

from __future__ import annotations

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import optax_memopt
from optax_memopt import checkpoint
from tests.optimizer_cases import CASES
from tests.test_transformation_properties import (
  build,
  make_params,
  make_target,
  quadratic_loss,
)

NAMES = sorted(CASES)
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 3


def train_step(optimizer):
  @jax.jit
  def step(params, state, target):
    grads = jax.grad(quadratic_loss)(params, target)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(step, params, state, targets):
  for target in targets:
    params, state = step(params, state, target)
  return params, state


def bitwise(tree):
  """Leaves as (dtype, bytes): equality that also sees -0.0, NaN payloads and dtype changes."""
  return jax.tree.map(lambda x: (str(np.asarray(x).dtype), np.asarray(x).tobytes()), tree)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_resumed_run_equals_uninterrupted_run(name, dtype, seed, tmp_path):
  """Save midway, restore into a new optimizer (as a new process would), resume.

  The MicroAdam reference keeps its step count outside the state (lost on
  resume) and casts its integer buffers through a float dtype; here every
  counter and code is a state leaf: the restored state is the saved one leaf
  by leaf and dtype by dtype, and the resumed run is the uninterrupted one.
  """
  initial = make_params(dtype, seed=seed % 1000)
  targets = [make_target(initial, seed + t) for t in range(STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)]
  optimizer = build(name)
  step = train_step(optimizer)
  initial_state = optimizer.init(initial)
  expected_params, expected_state = run(step, initial, initial_state, targets)

  params, state = run(step, initial, initial_state, targets[:STEPS_BEFORE_SAVE])
  saved = {"params": params, "opt_state": state}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "checkpoint", saved)
  checkpointer.wait_until_finished()

  fresh = build(name)
  target = jax.eval_shape(lambda p: {"params": p, "opt_state": fresh.init(p)}, initial)
  restored = ocp.StandardCheckpointer().restore(tmp_path / "checkpoint", target)
  assert jax.tree.structure(restored) == jax.tree.structure(saved), f"seed {seed}"
  assert bitwise(restored) == bitwise(saved), f"seed {seed}"
  counts = [
    int(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored["opt_state"])[0]
    if jax.tree_util.keystr(path).endswith("count") and leaf.ndim == 0
  ]
  assert counts and set(counts) == {STEPS_BEFORE_SAVE}, f"step counts after restoring: {counts}"

  resumed_params, resumed_state = run(
    train_step(fresh), restored["params"], restored["opt_state"], targets[STEPS_BEFORE_SAVE:]
  )
  assert bitwise(resumed_params) == bitwise(expected_params), f"seed {seed}"
  assert bitwise(resumed_state) == bitwise(expected_state), f"seed {seed}"
  chex.assert_trees_all_equal(resumed_state, expected_state)


SAVED_CHECKPOINTS = pathlib.Path(__file__).parent / "data" / "checkpoints"


def three_steps(optimizer, params):
  """Three steps of ``optimizer`` from ``params`` on seeded random gradients."""
  state = optimizer.init(params)
  for step in range(3):
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(step + 1), p.shape), params)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def taco_three_steps():
  """The run whose state ``taco_0.1.0`` and ``taco_92960de`` hold.

  TACO's fields in the first: index, momentum, scale; in the second: indices, momentum, scales.
  """
  params = {"w": jax.random.normal(jax.random.key(0), (16, 24)), "b": jnp.zeros((24,))}
  return three_steps(optax_memopt.taco(1e-2, k=4), params)


def adamw_4bit_three_steps():
  """The run whose state release 0.1.0 saved into ``adamw_4bit_0.1.0`` (low-bit AdamW's mu_or_paired then: mu)."""
  params = {"w": jax.random.normal(jax.random.key(0), (32, 256)), "b": jnp.zeros((24,))}
  return three_steps(optax_memopt.adamw_4bit(1e-2, weight_decay=1e-4), params)


def ternary_adam_three_steps():
  """The run whose state ``ternary_adam_92960de`` holds (mu's and nu's per_element then: dense).

  A matrix (trits, row and column statistics), a vector of ``min_quantized_size``
  elements (trits, per-element nu) and a small vector (per-element mu and nu).
  """
  params = {"w": jax.random.normal(jax.random.key(0), (64, 128)), "v": jnp.ones((4096,)), "b": jnp.zeros((24,))}
  return three_steps(optax_memopt.ternary_adam(1e-2, weight_decay=1e-4), params)


@pytest.mark.parametrize(
  "saved, saved_by, run",
  [
    ("taco_0.1.0", "0.1.0", taco_three_steps),
    ("adamw_4bit_0.1.0", "0.1.0", adamw_4bit_three_steps),
    ("taco_92960de", "main-92960de", taco_three_steps),
    ("ternary_adam_92960de", "main-92960de", ternary_adam_three_steps),
  ],
)
def test_a_checkpoint_saved_before_a_field_was_renamed_restores(saved, saved_by, run):
  """Each checkpoint was saved by the code named in its directory, before a rename of its state's fields."""
  directory = SAVED_CHECKPOINTS / saved
  assert directory.exists(), f"checkpoint missing: {directory}"
  params, state = run()
  target = jax.eval_shape(lambda: {"params": params, "opt_state": state})
  with pytest.raises(ValueError, match="not found"):
    ocp.StandardCheckpointer().restore(directory, target)
  saved = ocp.StandardCheckpointer().restore(directory, checkpoint.target_with_saved_names(target, saved_by))
  restored = checkpoint.rename_restored(saved, target, saved_by)
  assert jax.tree.structure(restored) == jax.tree.structure(target)
  assert bitwise(restored) == bitwise({"params": params, "opt_state": state})


def test_saved_by_names_the_code_that_saved_a_checkpoint():
  with pytest.raises(ValueError, match="saved_by must be one of '0.1.0', 'main-92960de'; got '0.2.0'"):
    checkpoint.target_with_saved_names({}, saved_by="0.2.0")
