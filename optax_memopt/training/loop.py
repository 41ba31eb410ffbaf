"""Training a ``model.Transformer`` with any optax optimizer, functionally and jitted."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from optax_memopt.state_bytes import state_nbytes
from optax_memopt.training import data, model

Params = Any
ProgressFn = Callable[[int, float, float], None]  # (step, loss, steps per second).


@dataclasses.dataclass
class TrainResult:
  train_losses: list[float]
  validation_loss: float
  state_bytes: int
  n_params: int
  seconds_per_step: float
  params: Params = dataclasses.field(repr=False)


def init_params(config: model.TransformerConfig, seed: int) -> tuple[nnx.GraphDef, Params]:
  """The model's graph and its parameters as a plain nested dict."""
  graphdef, state = nnx.split(model.Transformer(config, rngs=nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def next_token_loss(graphdef: nnx.GraphDef, params: Params, batch: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``."""
  logits = nnx.merge(graphdef, params)(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch[:, 1:]
  ).mean()


def evaluate(graphdef, params, tokens: np.ndarray, *, batch_size: int, seq_len: int) -> float:
  """Mean loss over a fixed set of held-out windows."""
  batches = data.evaluation_windows(tokens, batch_size=batch_size, seq_len=seq_len, max_batches=8)
  loss = jax.jit(lambda p, b: next_token_loss(graphdef, p, b))
  return float(np.mean([loss(params, b) for b in batches]))


def train(
    config: model.TransformerConfig,
    optimizer: optax.GradientTransformation,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    corpus: str = "pydoc_topics",
    params: Params | None = None,
    progress: ProgressFn | None = None,
    progress_every: int = 10,
) -> TrainResult:
  """Trains for ``steps`` steps on ``corpus`` and reports losses and state size.

  ``params`` starts from given weights (fine-tuning) instead of a fresh
  initialisation. The same ``seed`` gives the same initialisation and batches
  whatever the optimizer, so runs of different optimizers compare fairly.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1; got {steps}.")
  train_tokens, valid_tokens = data.split(data.load_corpus(corpus))
  graphdef, fresh = init_params(config, seed)
  params = fresh if params is None else params
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: next_token_loss(graphdef, p, batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = data.random_windows(train_tokens, batch_size=batch_size, seq_len=seq_len, seed=seed)
  losses = []
  # The first step compiles; time the rest.
  params, opt_state, loss = step(params, opt_state, next(batches))
  losses.append(float(loss))
  start = time.perf_counter()
  for i in range(1, steps):
    params, opt_state, loss = step(params, opt_state, next(batches))
    if progress is not None and (i % progress_every == 0 or i == steps - 1):
      losses_so_far = float(loss)
      progress(i + 1, losses_so_far, i / max(time.perf_counter() - start, 1e-9))
    losses.append(loss)
  losses = [float(l) for l in jax.device_get(losses)]
  seconds_per_step = (time.perf_counter() - start) / max(steps - 1, 1)
  return TrainResult(
      train_losses=losses,
      validation_loss=evaluate(graphdef, params, valid_tokens, batch_size=batch_size, seq_len=seq_len),
      state_bytes=state_nbytes(opt_state),
      n_params=sum(x.size for x in jax.tree.leaves(params)),
      seconds_per_step=seconds_per_step,
      params=params,
  )
