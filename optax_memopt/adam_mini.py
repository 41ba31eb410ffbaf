"""Adam-mini: Adam with one second moment per parameter block.

Zhang et al., "Adam-mini: Use Fewer Learning Rates To Gain More", ICLR 2025,
https://arxiv.org/abs/2406.16793.

Adam keeps a second moment ``v`` per element. Adam-mini keeps one per *block*
(an attention head, an output neuron, a token's embedding row, a whole norm
scale): the block's mean of ``g**2``, averaged in time like Adam's ``v``. The
first moment stays per element, so the state shrinks from ``2N`` to ``N + B``
elements with ``B`` (the number of blocks) a tiny fraction of ``N``.

Which block each parameter gets (the rules, the partition table and the
reference's weight-decay mask) is in ``optax_memopt.adam_mini_blocks``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from optax_memopt import hyperparameters, leaves, sharding
from optax_memopt.adam_mini_blocks import (
  Rules,
  adam_mini_decay_mask,
  adam_mini_partition,
  check_partition_arguments,
)


class ScaleByAdamMiniState(NamedTuple):
  """State of :func:`scale_by_adam_mini`: ``mu`` and ``nu`` are trees like the params.

  Each parameter has exactly one array in each tree (the layout optax's own
  ``ScaleByAdamState`` has, which Flax NNX's ``nnx.Optimizer`` keeps intact
  under ``nnx.jit``).
  """

  count: jax.typing.ArrayLike  # shape=(), dtype=jnp.int32.
  # Like params; dtype mu_dtype, else the parameter's.
  mu: optax.Updates
  # Per leaf the keep-dims block shape (the parameter's rank; each axis 1, a
  # divisor or the full size, see AdamMiniPartition); dtype the parameter's,
  # at least float32.
  nu: optax.Updates

  field_layouts = {"count": sharding.Layout.REPLICATED, "mu": sharding.Layout.PARAM, "nu": sharding.Layout.KEEPDIMS}


def _is_inexact(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.inexact)


def _second_moment_dtype(leaf) -> jnp.dtype:
  """Real, and at least float32: the parameter's precision, never bf16's."""
  real = jnp.finfo(jnp.result_type(leaf)).dtype
  return jnp.promote_types(real, jnp.float32)


def _interleaved(shape, block_shape):
  """``shape`` with each axis cut into (blocks, elements per block)."""
  return tuple(size for axis, blocks in zip(shape, block_shape) for size in (blocks, axis // blocks))


def _block_mean(x: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
  """Mean of ``x`` over each block; the result has shape ``block_shape``."""
  if x.shape == block_shape:
    return x
  within = tuple(range(1, 2 * x.ndim, 2))
  return jnp.mean(x.reshape(_interleaved(x.shape, block_shape)), axis=within)


def _divide_by_block(x: jax.Array, per_block: jax.Array) -> jax.Array:
  """``x`` divided elementwise by the value of its block (``per_block`` has the block shape)."""
  if x.shape == per_block.shape:
    return x / per_block
  cut = _interleaved(x.shape, per_block.shape)
  spread = tuple(size for blocks in per_block.shape for size in (blocks, 1))
  return (x.reshape(cut) / per_block.reshape(spread)).reshape(x.shape)


def scale_by_adam_mini(
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  *,
  rules: Rules = "flax",
  n_heads: int | None = None,
  n_kv_heads: int | None = None,
  stacked_modules: str | Sequence[str] = (),
  mu_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformation:
  r"""Rescale updates by Adam-mini: Adam with one second moment per block.

  For a parameter cut into blocks :math:`b` (see :func:`adam_mini_partition`)
  and step :math:`t \ge 1`:

  .. math::

    m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \quad \text{(per element)} \\
    v_{t,b} &= \beta_2 v_{t-1,b} + (1 - \beta_2)\,
      \tfrac{1}{|b|}\textstyle\sum_{i \in b} g_{t,i}^2
      \quad \text{(per block)} \\
    u_{t,i} &= \frac{m_{t,i} / (1 - \beta_1^t)}
      {\sqrt{v_{t,b(i)}} / \sqrt{1 - \beta_2^t} + \epsilon}

  with :math:`\epsilon` added after the bias correction, as in the reference.
  The blocks are fixed by ``init`` and carried in the shapes of ``nu``.

  Args:
    b1: decay of the first moment; 0.9, Adam's and the reference's default.
    b2: decay of the per-block second moment; 0.999, likewise.
    eps: added to the bias-corrected root of the second moment; 1e-8,
      likewise.
    rules: a rule-set name (``"flax"`` or ``"torch"``), a rule function
      ``(path, leaf) -> BlockRule | str | None``, or a sequence of them tried
      in order (see :func:`adam_mini_partition`); ``"flax"`` by default.
    n_heads: query heads, needed only for fused-head query/key kernels
      (``None``: there are none).
    n_kv_heads: key/value heads for grouped-query attention; ``None`` is
      ``n_heads``.
    stacked_modules: names of modules whose parameters carry a leading layer
      axis, never reduced over; none by default.
    mu_dtype: dtype of the first moment; ``None`` keeps the parameter's.
      ``jnp.bfloat16`` halves the state again.

  The blocks fix the state's shapes, and ``mu_dtype`` its dtype: under
  ``optax.inject_hyperparams`` list ``n_heads`` and ``n_kv_heads`` (and
  ``rules`` when it is a function, ``mu_dtype`` when it is a type such as
  ``jnp.bfloat16``) in ``static_args``. A traced head count raises an error
  that says so.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ScaleByAdamMiniState`.

  Raises:
    ValueError: when built, for a bad hyper-parameter (named); at ``init``,
      for an integer parameter or one no rule fits (the path named).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {"kernel": jnp.ones((4, 3))}
    >>> tx = optax_memopt.scale_by_adam_mini()
    >>> state = tx.init(params)
    >>> state.nu["kernel"].shape  # one block per output neuron
    (1, 3)
    >>> grads = {"kernel": jnp.array([[3., 1., 0.], [4., 1., 2.],
    ...                               [0., 1., 0.], [0., 1., 0.]])}
    >>> updates, state = tx.update(grads, state)
    >>> print(updates["kernel"].round(3))  # each column over its RMS
    [[1.2 1.  0. ]
     [1.6 1.  2. ]
     [0.  1.  0. ]
     [0.  1.  0. ]]

  References:
    Zhang et al., `Adam-mini: Use Fewer Learning Rates To Gain More
    <https://arxiv.org/abs/2406.16793>`_, ICLR 2025.
  """
  hyperparameters.check_decay_rate("b1", b1)
  hyperparameters.check_decay_rate("b2", b2)
  hyperparameters.check_non_negative("eps", eps)
  check_partition_arguments(rules, n_heads, n_kv_heads, stacked_modules)
  mu_dtype = hyperparameters.check_dtype("mu_dtype", mu_dtype)

  def init_fn(params):
    leaves.check_param_dtypes(
      params,
      "adam_mini",
      supported=_is_inexact,
      supported_text="floating-point and complex parameters",
    )
    partition = adam_mini_partition(
      params,
      rules,
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      stacked_modules=stacked_modules,
    )
    nu = partition.treedef.unflatten(
      [
        jnp.zeros(row.block_shape, _second_moment_dtype(param))
        for row, param in zip(partition.rows, jax.tree.leaves(params))
      ]
    )
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params)
    return ScaleByAdamMiniState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)

    def update_leaf(g, m, v):
      """One parameter: Adam's step with ``v`` (shape: one entry per block) shared within each block."""
      dtype = v.dtype  # At least float32, whatever the parameter's precision.
      t = count.astype(dtype)
      beta1, beta2 = jnp.asarray(b1, dtype), jnp.asarray(b2, dtype)
      g = g.astype(jnp.promote_types(g.dtype, dtype))
      m = beta1 * m.astype(g.dtype) + (1 - beta1) * g
      # |g|^2: a complex parameter keeps its phase in m only.
      v = beta2 * v + (1 - beta2) * _block_mean(jnp.real(g * jnp.conj(g)), v.shape)
      m_hat = m / (1 - beta1**t)
      denominator = jnp.sqrt(v) / jnp.sqrt(1 - beta2**t) + jnp.asarray(eps, dtype)
      return _divide_by_block(m_hat, denominator), m, v

    per_leaf = leaves.map_steps(update_leaf, updates, state.mu, state.nu)
    # Unzipped along ``updates``, which may have no leaf at all (every
    # parameter routed elsewhere by optax.partition).
    directions, mu, nu = leaves.unzip(updates, per_leaf, 3)
    directions = optax.tree.cast_like(directions, updates)
    mu = optax.tree.cast_like(mu, state.mu)
    return directions, ScaleByAdamMiniState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def adam_mini(
  learning_rate: optax.ScalarOrSchedule,
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  weight_decay: jax.typing.ArrayLike = 0.0,
  mask: Any | Callable[[optax.Params], Any] | None = None,
  *,
  rules: Rules = "flax",
  n_heads: int | None = None,
  n_kv_heads: int | None = None,
  stacked_modules: str | Sequence[str] = (),
  mu_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformation:
  r"""Adam-mini with decoupled weight decay (AdamW-style).

  The chain :func:`scale_by_adam_mini`, ``optax.add_decayed_weights``,
  ``optax.scale_by_learning_rate``: with :math:`u_t` the Adam-mini direction,

  .. math::

    p_t = p_{t-1} - \eta_t \left(u_t + \lambda\, p_{t-1}\right),

  the reference's ``p *= 1 - lr * wd`` applied to the old parameter. The
  memory is ``N + B`` state elements against AdamW's ``2N`` (``B`` blocks,
  about 0.02% of ``N`` for Llama-2-7B), ``N * 2 + B * 4`` bytes with a
  bfloat16 ``mu_dtype``.

  Args:
    learning_rate: a scalar or schedule.
    b1: decay of the first moment (0.9, as Adam).
    b2: decay of the per-block second moment (0.999, as Adam).
    eps: added to the bias-corrected root of the second moment (1e-8).
    weight_decay: decoupled weight-decay rate; 0 by default, as
      ``optax.adam``.
    mask: which leaves weight decay applies to, a pytree of bools or a
      function of the params; ``None`` (default) applies the reference's rule,
      :func:`adam_mini_decay_mask`: every leaf except those whose path holds
      ``norm``, ``ln`` or ``bias``.
    rules: block rules, see :func:`adam_mini_partition`; ``"flax"`` (default)
      for Flax layouts, ``"torch"`` to reproduce ``adam-mini==1.1.1`` on
      PyTorch names and ``(out, in)`` weights.
    n_heads: query heads, for fused-head query/key kernels.
    n_kv_heads: key/value heads for grouped-query attention; defaults to
      ``n_heads``.
    stacked_modules: names of modules whose parameters carry a leading layer
      axis (``nn.scan``, ``nnx.scan``), never reduced over.
    mu_dtype: dtype of the first moment; ``None`` keeps the parameter's.

  Under ``optax.inject_hyperparams``, list ``n_heads``, ``n_kv_heads`` (and
  ``rules`` or ``mask`` when they are functions, ``mu_dtype`` when it is a
  type) in ``static_args``, as :func:`scale_by_adam_mini` says.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {"dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}}
    >>> tx = optax_memopt.adam_mini(1e-2, weight_decay=0.1)
    >>> print(optax_memopt.adam_mini_partition(params))
    path          shape   rule               blocks
    ------------  ------  -----------------  ------
    dense/bias    (4,)    per element             4
    dense/kernel  (8, 4)  per output neuron       4
    2 tensors, 36 parameters, 8 blocks (v holds 22.222% of Adam's)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    Zhang et al., `Adam-mini: Use Fewer Learning Rates To Gain More
    <https://arxiv.org/abs/2406.16793>`_, ICLR 2025.
  """
  hyperparameters.check_learning_rate(learning_rate)
  hyperparameters.check_non_negative("weight_decay", weight_decay)
  hyperparameters.check_mask("mask", mask)
  return optax.chain(
    scale_by_adam_mini(
      b1,
      b2,
      eps,
      rules=rules,
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      stacked_modules=stacked_modules,
      mu_dtype=mu_dtype,
    ),
    optax.add_decayed_weights(weight_decay, adam_mini_decay_mask if mask is None else mask),
    optax.scale_by_learning_rate(learning_rate),
  )
