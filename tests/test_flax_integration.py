"""Every registered optimizer in Flax's own training APIs.

Flax teaches training with ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and a
step under ``nnx.jit``; under it NNX splits the optimizer's state into an
``nnx.State`` and merges it back, rebuilding any container it finds where a
parameter's array belongs. Each optimizer of ``tests.optimizer_cases.CASES``
(a new one is covered by adding it there) trains a small NNX model through
that step, through ``nnx.split``/``nnx.merge`` of the optimizer, through an
orbax checkpoint of the ``nnx.Optimizer`` state, and a Linen model through
``flax.training.train_state.TrainState``.

The model's tree is that of ``tests.test_transformation_properties``, so the
registry's hyper-parameters reach every compressed path: the 24 x 40 and
40 x 8 kernels span several MicroAdam blocks of 256 (the second with a tail),
hold TACO's heavy hitters and ternary Adam's codes with factored ``v``; the
embedding takes Adam-mini's per-token rule and TACO's fallback; the 40-wide
bias is ternary with full ``v``, the norm scale stays float32.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state

from tests.optimizer_cases import CASES
from tests.test_checkpoint import bitwise
from tests.test_transformation_properties import build

NAMES = sorted(CASES)
VOCAB, DIM, HIDDEN, CLASSES = 50, 24, 40, 8
TRAIN_STEPS = 8
# Eight steps of every registered optimizer bring the loss below 80% of its
# start (MicroAdam, the slowest, to about 70%); a step in the wrong direction
# raises it and a lost update leaves it where it was.
LOSS_FRACTION_AFTER_TRAINING = 0.8
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 3


class Classifier(nnx.Module):
  """Embedding, RMSNorm, a hidden layer and a linear head over the classes."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.norm = nnx.RMSNorm(DIM, rngs=rngs)
    self.dense = nnx.Linear(DIM, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

  def __call__(self, tokens):
    return self.out(jax.nn.relu(self.dense(self.norm(self.embed(tokens)))))


class LinenClassifier(nn.Module):
  """The same network in Linen."""

  @nn.compact
  def __call__(self, tokens):
    hidden = nn.RMSNorm(name="norm")(nn.Embed(VOCAB, DIM, name="embed")(tokens))
    return nn.Dense(CLASSES, name="out")(jax.nn.relu(nn.Dense(HIDDEN, name="dense")(hidden)))


def loss_fn(model, tokens, labels):
  return optax.softmax_cross_entropy_with_integer_labels(model(tokens), labels).mean()


def make_data(seed):
  """Every token once, each with a random class to learn."""
  tokens = jnp.arange(VOCAB)
  return tokens, jax.random.randint(jax.random.key(seed), (VOCAB,), 0, CLASSES)


@functools.cache
def transformation(name):
  """One transformation per case, so the tests share ``train_step``'s compiled programs."""
  return build(name)


def model_and_optimizer(tx, seed):
  model = Classifier(nnx.Rngs(seed))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, tokens, labels):
  """The step of Flax's documentation."""
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, labels)
  optimizer.update(model, grads)
  return loss


def train(model, optimizer, data, steps):
  return [float(train_step(model, optimizer, *data)) for _ in range(steps)]


def assert_loss_falls(losses, context):
  assert all(np.isfinite(losses)), f"{context}: losses {losses}"
  assert all(b < a for a, b in zip(losses, losses[1:])), f"{context}: losses {losses}"
  assert losses[-1] < LOSS_FRACTION_AFTER_TRAINING * losses[0], f"{context}: losses {losses}"


@pytest.mark.parametrize("name", NAMES)
def test_nnx_optimizer_trains_as_plain_optax_does(name, seed):
  """``nnx.Optimizer`` under ``nnx.jit``: the loss falls, as in a plain optax loop.

  The same steps written with pure dicts and ``tx.update`` (no NNX state
  handling) give the same parameters and losses: NNX neither loses nor
  rebuilds any part of the state.
  """
  data = make_data(seed)
  graphdef, initial = nnx.split(Classifier(nnx.Rngs(seed)), nnx.Param)
  tx = transformation(name)
  model, optimizer = model_and_optimizer(tx, seed)
  losses = train(model, optimizer, data, TRAIN_STEPS + 1)
  assert_loss_falls(losses, f"{name}, seed {seed}")
  assert int(optimizer.step[...]) == TRAIN_STEPS + 1

  @jax.jit
  def plain_step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), *data))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = nnx.to_pure_dict(initial)
  opt_state = tx.init(params)
  plain_losses = []
  for _ in range(TRAIN_STEPS + 1):
    params, opt_state, loss = plain_step(params, opt_state)
    plain_losses.append(float(loss))
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-5, err_msg=f"{name}, seed {seed}")
  jax.tree.map(
    lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name}, seed {seed}"),
    nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    params,
  )


@pytest.mark.parametrize("name", NAMES)
def test_split_and_merge_round_trip_continues_identically(name, seed):
  """``nnx.split``/``nnx.merge`` of model and optimizer keeps every state leaf and its place.

  Training then continues as an uninterrupted run does, both with
  ``nnx.jit`` and in the functional form (merge inside ``jax.jit``, split on
  the way out).
  """
  data = make_data(seed)
  tx = transformation(name)
  model, optimizer = model_and_optimizer(tx, seed)
  expected_losses = train(model, optimizer, data, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)[STEPS_BEFORE_SAVE:]
  expected = bitwise(nnx.to_pure_dict(nnx.state((model, optimizer))))

  model, optimizer = model_and_optimizer(tx, seed)
  train(model, optimizer, data, STEPS_BEFORE_SAVE)
  graphdef, state = nnx.split((model, optimizer))
  pure_state = nnx.to_pure_dict(state)
  merged_model, merged_optimizer = nnx.merge(graphdef, state)
  before, after = nnx.as_pure(optimizer.opt_state), nnx.as_pure(merged_optimizer.opt_state)
  assert jax.tree.structure(after) == jax.tree.structure(before), f"{name}: the state's containers changed"
  assert bitwise(after) == bitwise(before), f"{name}, seed {seed}"
  assert train(merged_model, merged_optimizer, data, STEPS_AFTER_SAVE) == expected_losses, f"{name}, seed {seed}"
  assert bitwise(nnx.to_pure_dict(nnx.state((merged_model, merged_optimizer)))) == expected, f"{name}, seed {seed}"

  @jax.jit
  def functional_step(state):
    model, optimizer = nnx.merge(graphdef, state)
    loss = train_step(model, optimizer, *data)
    return nnx.state((model, optimizer)), loss

  nnx.replace_by_pure_dict(state, pure_state)
  functional_losses = []
  for _ in range(STEPS_AFTER_SAVE):
    state, loss = functional_step(state)
    functional_losses.append(float(loss))
  assert functional_losses == expected_losses, f"{name}, seed {seed}"
  assert bitwise(nnx.to_pure_dict(state)) == expected, f"{name}, seed {seed}"


@pytest.mark.parametrize("name", NAMES)
def test_orbax_checkpoint_of_nnx_optimizer_resumes_bitwise(name, tmp_path, seed):
  """Save model and ``nnx.Optimizer`` midway, restore into fresh ones, resume.

  The restore target is the abstract state of a newly built model and
  optimizer (``nnx.eval_shape``), as a new process has; the resumed run
  equals the uninterrupted one bitwise, step count included.
  """
  data = make_data(seed)
  tx = transformation(name)
  model, optimizer = model_and_optimizer(tx, seed)
  train(model, optimizer, data, STEPS_BEFORE_SAVE)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "checkpoint", nnx.state((model, optimizer)))
  checkpointer.wait_until_finished()
  expected_losses = train(model, optimizer, data, STEPS_AFTER_SAVE)

  graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: model_and_optimizer(tx, seed + 1)))
  restored = ocp.StandardCheckpointer().restore(tmp_path / "checkpoint", abstract_state)
  resumed_model, resumed_optimizer = nnx.merge(graphdef, restored)
  assert int(resumed_optimizer.step[...]) == STEPS_BEFORE_SAVE
  assert train(resumed_model, resumed_optimizer, data, STEPS_AFTER_SAVE) == expected_losses, f"{name}, seed {seed}"
  assert bitwise(nnx.to_pure_dict(nnx.state((resumed_model, resumed_optimizer)))) == bitwise(
    nnx.to_pure_dict(nnx.state((model, optimizer)))
  ), f"{name}, seed {seed}"


@pytest.mark.parametrize("name", NAMES)
def test_linen_train_state_trains(name, seed):
  """``TrainState.create(apply_fn, params, tx)`` and ``apply_gradients`` under ``jax.jit``."""
  tokens, labels = make_data(seed)
  network = LinenClassifier()
  state = train_state.TrainState.create(
    apply_fn=network.apply, params=network.init(jax.random.key(seed), tokens)["params"], tx=transformation(name)
  )

  @jax.jit
  def step(state):
    def loss(params):
      logits = state.apply_fn({"params": params}, tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value

  losses = []
  for _ in range(TRAIN_STEPS + 1):
    state, loss = step(state)
    losses.append(float(loss))
  assert_loss_falls(losses, f"{name}, seed {seed}")
  assert int(state.step) == TRAIN_STEPS + 1
