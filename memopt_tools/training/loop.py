"""Training a ``model.Transformer`` with any optax optimizer, functionally and jitted."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from memopt_tools.training import data, model
from optax_memopt.hyperparameters import check_int
from optax_memopt.state_bytes import state_nbytes

Params = Any
ProgressFn = Callable[[int, float, float], None]  # (step, loss, steps per second).


@dataclasses.dataclass
class TrainResult:
  train_losses: list[float]
  validation_loss: float
  state_bytes: int
  n_params: int
  seconds_per_step: float  # NaN for a one-step run: the only step compiles.
  params: Params = dataclasses.field(repr=False)


class NonFiniteLossError(FloatingPointError):
  """The loss became NaN or infinite: the run diverged.

  Attributes:
    step: the 1-based step whose training loss is not finite (the last step
      when only the validation loss after it is not).
    result: the run up to there; ``train_losses`` holds the finite losses
      before ``step`` and ``validation_loss`` is NaN when training stopped early.
  """

  def __init__(self, message: str, *, step: int, result: TrainResult):
    super().__init__(message)
    self.step = step
    self.result = result


def init_params(config: model.TransformerConfig, seed: int) -> tuple[nnx.GraphDef, Params]:
  """The model's graph and its parameters as a plain nested dict."""
  graphdef, state = nnx.split(model.Transformer(config, rngs=nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def next_token_loss(graphdef: nnx.GraphDef, params: Params, batch: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``."""
  logits = nnx.merge(graphdef, params)(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()


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
  The losses are read back every ``progress_every`` steps (and after the
  first and the last); ``progress``, when given, is called with each.

  Raises:
    NonFiniteLossError: at the first read-back that finds a NaN or infinite
      training loss (naming the first such step), or when the validation loss
      after the last step is not finite.
  """
  check_int("steps", steps, 1)
  check_int("progress_every", progress_every, 1)
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
  losses = []  # Device scalars; turned into floats at each check, so steps run ahead meanwhile.
  checked = 0
  start = 0.0  # Set after the first step, which compiles, so that only the rest is timed.

  def seconds_per_step(done: int) -> float:
    """Mean over the steps after the first, which compiles; NaN when there are none."""
    return (time.perf_counter() - start) / (done - 1) if done > 1 else math.nan

  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, next(batches))
    losses.append(loss)
    if i == 0 or (i + 1) % progress_every == 0 or i == steps - 1:
      losses[checked:] = [float(x) for x in jax.device_get(losses[checked:])]
      bad = next((j for j in range(checked, len(losses)) if not math.isfinite(losses[j])), None)
      if bad is not None:
        raise NonFiniteLossError(
          f"the training loss became {losses[bad]} at step {bad + 1} of {steps}",
          step=bad + 1,
          result=TrainResult(
            train_losses=losses[:bad],
            validation_loss=math.nan,
            state_bytes=state_nbytes(opt_state),
            n_params=_size(params),
            seconds_per_step=seconds_per_step(i + 1),
            params=params,
          ),
        )
      checked = len(losses)
      if i == 0:
        start = time.perf_counter()
      elif progress is not None:
        progress(i + 1, losses[-1], i / max(time.perf_counter() - start, 1e-9))
  result = TrainResult(
    train_losses=losses,
    validation_loss=evaluate(graphdef, params, valid_tokens, batch_size=batch_size, seq_len=seq_len),
    state_bytes=state_nbytes(opt_state),
    n_params=_size(params),
    seconds_per_step=seconds_per_step(steps),
    params=params,
  )
  if not math.isfinite(result.validation_loss):
    raise NonFiniteLossError(
      f"the validation loss after the last step ({steps}) is {result.validation_loss}",
      step=steps,
      result=result,
    )
  return result


def train_allowing_divergence(
  config: model.TransformerConfig, optimizer: optax.GradientTransformation, **options: Any
) -> tuple[TrainResult, NonFiniteLossError | None]:
  """``train``, with a run that diverges returned instead of raised.

  Args:
    config, optimizer, options: as for :func:`train`.

  Returns:
    The run's result and ``None``; for a run whose loss became NaN or
    infinite, the run up to there (the error's ``result``) and the error.
  """
  try:
    return train(config, optimizer, **options), None
  except NonFiniteLossError as error:
    return error.result, error


def _size(params: Params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
