"""Ternary-state Adam: Adam whose first moment is stored in {-1, 0, +1}.

No published method stores Adam's moments as trits; this is our design,
built from pieces the low-precision optimizer literature supports.

* **First moment: trits with block scales.** ``m`` is kept as codes in
  ``{-1, 0, +1}`` with one float32 scale per block of ``block_size``
  consecutive elements (``pallas_kernels.ternary``), packed 5 trits per byte
  in base 3 (``3**5 = 243 <= 256``, 1.6 bits) or 4 per byte (``"2bit"``,
  cheaper to unpack). Rounding is stochastic, ``P(t = sign(m)) = |m| / s``,
  so the stored moment is an unbiased estimate of the full-precision one and
  small EMA increments are not swamped by the rounding (TernGrad, QSGD). The
  random bits come from a key kept in the state and split every step, so a
  run replays exactly from the same key.
* **Scales from a bound.** A block's new scale is
  ``b1 s + (1 - b1) max |g|``, which bounds ``|m| = |b1 t s + (1 - b1) g|``
  and is known from the gradient alone: unlike the absmax of the new ``m``,
  it needs no pass over the moment before coding it. The larger scales (more
  zeros) trained as well as the absmax on the library's benchmarks.
* **Second moment: factored for matrices.** ``nu`` sits under a square root
  in the denominator and cannot be ternary (a code of 0 would blow up the
  step). For tensors of rank >= 2 it is Adafactor's factorization over the
  last two axes: EMAs of the row and column means of ``g**2 + 1e-30``,
  rebuilt as ``outer(row, col) / mean(row)``. Tensors of rank < 2 (biases,
  norm scales) keep a full-precision ``nu``: they are a vanishing share of a
  model's parameters.
* **Small tensors stay exact.** Tensors of fewer than ``min_quantized_size`` elements
  (4096, the threshold of bitsandbytes and torchao) keep float32 ``m`` and
  ``nu``: per-block scales would cost as much as the codes they save.
* **A low default** ``b1 = 0.5``. Stochastic rounding adds zero-mean noise of
  variance up to ``s |m|`` to the stored moment at every step; the EMA keeps
  a ``b1**2`` share of each step's noise, so the noise in ``m`` is about
  ``b1**2 / (1 - b1**2)`` times one step's: 4.3 at ``b1 = 0.9``, 0.33 at
  ``0.5``. SOLO (arXiv 2505.00347) likewise ties the momentum value to the
  precision of signed low-bit states. On the library's training task,
  ``b1 = 0.9`` trailed AdamW clearly while ``0.5`` matched it; the same
  optimizer with a full-precision ``m`` matched AdamW at every ``b1``, so the
  gap is the rounding noise (``benchmarks/README.md``).
* **Blocks of 128** by default, as in 4-bit AdamW: smaller blocks put fewer
  large entries beside each small one (less rounding noise) but cost 4 bytes
  of scale per block; 64, 128 and 256 trained alike at ``b1 = 0.5``.
* **Block-major layout** (``pallas_kernels.ternary``): when blocks
  tile the last axis of a tensor ``(..., n)`` the trits are shaped
  ``(..., n // block_size, bytes)``, so the moment shards along the same
  axes as its parameter (``optax_memopt.state_shardings``).

State per tensor of ``d >= min_quantized_size`` elements, in ``b = ceil(d / block_size)``
blocks: ``b ceil(block_size / 5)`` bytes of trits (base 3), ``4 b`` bytes of
scales and, for a ``(r, c)`` matrix, ``4 (r + c)`` bytes of factored ``nu``:
0.24 bytes per parameter for Llama-2-7B's parameters, against 8 for float32
AdamW (``python -m benchmarks.memory``; ``optax_memopt.ternary_adam_state``
describes the state's trees).

The step of each large tensor (decode ``m``, update ``m`` and ``nu``, the
direction, stochastic re-encoding) is ``pallas_kernels.ternary_adam_update``,
in XLA. The factored statistics are reductions over whole rows and columns,
done before the fused step, which receives the root of the rebuilt ``nu``
(the outer product of the statistics' roots: no square root per element).
Where blocks tile the rows, a row's sum is that of its blocks' sums, which
the step's block maxima share one reduction with.

References:
  Kingma and Ba, "Adam: A Method for Stochastic Optimization", 2015
  (https://arxiv.org/abs/1412.6980).
  Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear
  Memory Cost", 2018 (https://arxiv.org/abs/1804.04235).
  Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
  Distributed Deep Learning", 2017 (https://arxiv.org/abs/1705.07878).
  Xu et al., "Pushing the Limits of Low-Bit Optimizers: A Focus on EMA
  Dynamics" (SOLO), 2025 (https://arxiv.org/abs/2505.00347).
  Li, Chen and Zhu, "Memory Efficient Optimizers with 4-bit States",
  NeurIPS 2023 (https://arxiv.org/abs/2309.01507).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from optax_memopt import hyperparameters, leaves, sharding
from optax_memopt.ternary_adam_state import (
  ScaleByTernaryAdamState,
  TernaryAdamMu,
  TernaryAdamNu,
  init_state,
  is_factored,
  is_ternary,
)
from pallas_kernels import ternary
from pallas_kernels.blocks import blocks_shape, to_blocks
from pallas_kernels.ternary_adam_update import block_statistics, ternary_adam_update

__all__ = [
  "ScaleByTernaryAdamState",
  "TernaryAdamMu",
  "TernaryAdamNu",
  "scale_by_ternary_adam",
  "ternary_adam",
]

# Added to g**2 before the factored statistics, as in Adafactor: a gradient
# that is zero so far still gives positive row means, so rebuilding nu never
# divides by zero.
_FACTORED_EPS = 1e-30


def _check_hyperparameters(b1, b2, eps, block_size, min_quantized_size, packing) -> None:
  """Eager checks; floats only when they are Python numbers (they may be traced)."""
  hyperparameters.check_decay_rate("b1", b1)
  hyperparameters.check_decay_rate("b2", b2)
  hyperparameters.check_non_negative("eps", eps)
  ternary.check_block_size(block_size)
  hyperparameters.check_int("min_quantized_size", min_quantized_size, 0)
  hyperparameters.check_static("packing", packing)
  ternary.packing_layout(packing)


def _check_real(leaf: jax.Array) -> None:
  # The fp32 path below min_quantized_size would otherwise drop an imaginary part
  # without a word, and trits have no complex phase.
  if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
    raise ValueError(
      f"ternary_adam supports real floating parameters; got a {leaf.dtype} leaf of shape"
      f" {leaf.shape}. Route complex parameters to another optimizer with optax.partition."
    )


def _row_statistics(grad: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array | None]:
  """``mean(g**2, axis=-1)``, and the blocks' ``max |g|`` where blocks tile the rows (else None).

  Where they do, both come from one reduction over ``g``
  (``block_statistics``), a row's sum being that of its blocks' sums.
  """
  grad = grad.astype(jnp.float32)
  if grad.shape[-1] % block_size:
    return jnp.mean(jnp.square(grad), axis=-1), None
  blocks = to_blocks(grad, blocks_shape(grad.shape, block_size), block_size)
  sums, absmax = block_statistics(blocks)
  return jnp.sum(sums, axis=-1) / grad.shape[-1], absmax


def _rebuild_root(row: jax.Array, col: jax.Array) -> jax.Array:
  """The root of ``outer(row, col) / mean(row)`` over the last two axes.

  As ``outer(sqrt(row / mean(row)), sqrt(col))``: the roots of the
  statistics rather than of every element, so the step takes no square root
  per element (``nu_root`` of the fused step).
  """
  row_mean = jnp.mean(row, axis=-1, keepdims=True)
  # An infinite statistic would rebuild finite rows as 0 (x / inf), whose
  # steps are then m / eps: huge and finite. Make the fault visible instead.
  row_mean = jnp.where(jnp.isfinite(row_mean), row_mean, jnp.nan)
  return jnp.sqrt(row / row_mean)[..., :, None] * jnp.sqrt(col)[..., None, :]


def scale_by_ternary_adam(
  b1: jax.typing.ArrayLike = 0.5,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  *,
  block_size: int = 128,
  min_quantized_size: int = 4096,
  packing: str = "base3",
  key: int | jax.Array = 0,
  min_size: int | None = None,
) -> optax.GradientTransformation:
  """Rescales updates like Adam, with a ternary first moment and factored second.

  For a tensor of at least ``min_quantized_size`` elements, at step ``k`` with
  gradient ``g``:

  .. math::
    m_k = \\beta_1 \\hat m_{k-1} + (1 - \\beta_1) g, \\qquad
    \\hat m_k = \\mathrm{round}_\\xi(m_k) \\in s \\cdot \\{-1, 0, 1\\},
    \\quad \\mathbb{E}_\\xi[\\hat m_k] = m_k

    R_k = \\beta_2 R_{k-1} + (1 - \\beta_2) \\operatorname{mean}_j (g^2 + \\epsilon_1), \\quad
    C_k = \\beta_2 C_{k-1} + (1 - \\beta_2) \\operatorname{mean}_i (g^2 + \\epsilon_1), \\quad
    \\nu_k = \\frac{R_k C_k^\\top}{\\operatorname{mean}(R_k)}

    u_k = \\frac{m_k / (1 - \\beta_1^k)}{\\sqrt{\\nu_k / (1 - \\beta_2^k)} + \\epsilon}

  with ``s = beta_1 s_prev + (1 - beta_1) max |g_k|`` over each block of
  ``block_size`` elements (a bound on ``|m_k|`` there) and ``round_xi``
  stochastic rounding. Tensors of rank < 2 update ``nu``
  elementwise, and tensors below ``min_quantized_size`` elements run plain Adam in
  float32. The design and its defaults are explained in the module
  docstring; the state's trees in ``optax_memopt.ternary_adam_state``.

  Args:
    b1: decay of the first moment, in ``[0, 1)``. Lower than Adam's 0.9 so
      that less rounding noise accumulates (module docstring).
    b2: decay of the second-moment statistics, in ``[0, 1)``.
    eps: added to the root of the bias-corrected second moment, ``>= 0``.
    block_size: elements per scale block of the ternary moment: 32, 64 or a
      multiple of 128 (what the kernels' 128-element slices allow). 128, as
      in 4-bit AdamW: about 0.23 bytes of trits and scale per element.
    min_quantized_size: tensors with fewer elements keep float32 ``m`` and
      ``nu``; 4096, the threshold of bitsandbytes and torchao.
    packing: ``"base3"`` (5 trits per byte, the default: the fewest bytes) or
      ``"2bit"`` (4 per byte, cheaper to unpack).
    key: an int seed or a JAX PRNG key for the stochastic rounding, kept in
      the state. Each step splits it into the next key and a step key;
      ``jax.random.bits(step_key, (n,), uint32)`` gives the rounding seeds of
      the ``n`` parameters in ``jax.tree.leaves`` order
      (``pallas_kernels.ternary.counter_hash_bits``).
    min_size: the old name of ``min_quantized_size`` (deprecated: a
      ``DeprecationWarning``).

  Returns:
    An ``optax.GradientTransformation``.

  ``block_size``, ``min_quantized_size`` and ``packing`` fix the state's shapes: with
  ``optax.inject_hyperparams``, list them in ``static_args``.

  Raises:
    ValueError: for a hyper-parameter out of range (floats are checked when
      they are Python numbers), and for complex parameters or gradients
      (route them to another optimizer with ``optax.partition``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {"w": jnp.ones((64, 128)), "b": jnp.zeros((128,))}
    >>> opt = optax_memopt.scale_by_ternary_adam()
    >>> state = opt.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = opt.update(grads, state)
    >>> bool(jnp.allclose(updates["w"], 1.0, atol=1e-4))  # Adam's first step: sign(g).
    True
    >>> state.mu.packed["w"].shape, state.nu.row["w"].shape, state.nu.per_element["b"].shape
    ((64, 1, 26), (64,), (128,))

  References:
    Kingma and Ba, 2015 (https://arxiv.org/abs/1412.6980); Shazeer and
    Stern, 2018 (https://arxiv.org/abs/1804.04235); Xu et al., 2025
    (https://arxiv.org/abs/2505.00347).
  """
  min_quantized_size = hyperparameters.renamed_keyword(
    "min_size", min_size, "min_quantized_size", min_quantized_size, 4096
  )
  _check_hyperparameters(b1, b2, eps, block_size, min_quantized_size, packing)
  initial_key = hyperparameters.typed_key("key", key)
  key_impl = jax.random.key_impl(initial_key)

  def init_fn(params):
    leaves.check_param_dtypes(params, "ternary_adam")
    return init_state(
      params,
      jax.random.key_data(initial_key),
      block_size=block_size,
      min_quantized_size=min_quantized_size,
      packing=packing,
    )

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=key_impl))
    b1_ = jnp.asarray(b1, jnp.float32)
    b2_ = jnp.asarray(b2, jnp.float32)
    bias_correction_1 = 1 - b1_ ** count.astype(jnp.float32)
    bias_correction_2 = 1 - b2_ ** count.astype(jnp.float32)
    # One draw gives every tensor's rounding seed for this step.
    treedef = jax.tree.structure(updates)
    # Each seed a scalar of its own (the barrier), not a slice of the draw: one
    # array read by every tensor's step would let XLA:GPU's sibling fusion
    # merge their passes (pallas_kernels.ternary_adam_update._own_zero).
    draw = jax.random.bits(step_key, (treedef.num_leaves,), jnp.uint32)
    seeds = treedef.unflatten(jax.lax.optimization_barrier(list(draw)))

    def update_leaf(grad, seed, packed, scales, mu, row, col, nu):
      _check_real(grad)
      if not is_ternary(grad, min_quantized_size):
        # Plain Adam in float32.
        g = grad.astype(jnp.float32)
        mu = b1_ * mu + (1 - b1_) * g
        nu = b2_ * nu + (1 - b2_) * g * g
        direction = (mu / bias_correction_1) / (jnp.sqrt(nu / bias_correction_2) + eps)
        return direction.astype(grad.dtype), packed, scales, mu, row, col, nu
      mu_trits = ternary.TernaryArray(packed, scales)
      options = dict(
        seed=seed,
        count=count,
        b1=b1,
        b2=b2,
        eps=eps,
        block_size=block_size,
        packing=packing,
      )
      if not is_factored(grad, min_quantized_size):
        step = ternary_adam_update(grad, mu_trits, nu, **options)
        return step.direction, *step.mu, mu, row, col, step.nu
      # Adafactor's statistics of g**2 + eps over the last two axes; the
      # fused step takes the root of the nu they rebuild.
      row_means, block_absmax = _row_statistics(grad, block_size)
      col_means = jnp.mean(jnp.square(grad.astype(jnp.float32)), axis=-2)
      row = b2_ * row + (1 - b2_) * (row_means + _FACTORED_EPS)
      col = b2_ * col + (1 - b2_) * (col_means + _FACTORED_EPS)
      step = ternary_adam_update(grad, mu_trits, nu_root=_rebuild_root(row, col), block_absmax=block_absmax, **options)
      return step.direction, *step.mu, mu, row, col, nu

    per_leaf = leaves.map_steps(
      update_leaf,
      updates,
      seeds,
      state.mu.packed,
      state.mu.scales,
      state.mu.per_element,
      state.nu.row,
      state.nu.col,
      state.nu.per_element,
    )
    # Each field of the results, as a tree like the gradients (None where
    # a field does not apply to a parameter).
    directions, packed, scales, mu, row, col, nu = leaves.unzip(updates, per_leaf, 7)
    new_state = ScaleByTernaryAdamState(
      count=count,
      key=jax.random.key_data(next_key),
      mu=TernaryAdamMu(packed=packed, scales=scales, per_element=mu),
      nu=TernaryAdamNu(row=row, col=col, per_element=nu),
    )
    return directions, new_state

  # Block-major reshapes split sharded axes: under explicit mesh axes the
  # update runs with them left to the partitioner, typed like its inputs.
  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def ternary_adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: jax.typing.ArrayLike = 0.5,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  weight_decay: jax.typing.ArrayLike = 0.0,
  mask: Any | Callable[[optax.Params], Any] | None = None,
  *,
  block_size: int = 128,
  min_quantized_size: int = 4096,
  packing: str = "base3",
  key: int | jax.Array = 0,
  min_size: int | None = None,
) -> optax.GradientTransformation:
  """Ternary-state AdamW: ``scale_by_ternary_adam``, decoupled weight decay, learning rate.

  .. math::
    \\theta_k = \\theta_{k-1} - \\eta_k \\left(u_k + \\lambda \\theta_{k-1}\\right)

  with ``u_k`` the direction of ``scale_by_ternary_adam``. 0.24 bytes of
  state per parameter for Llama-2-7B's parameters (float32 AdamW: 8).

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay of the ternary first moment, in ``[0, 1)``.
    b2: decay of the second-moment statistics, in ``[0, 1)``.
    eps: added to the root of the second moment, ``>= 0``.
    weight_decay: decoupled weight decay ``lambda``.
    mask: which params get weight decay, as in ``optax.adamw``.
    block_size: elements per scale block: 32, 64 or a multiple of 128.
    min_quantized_size: tensors with fewer elements keep float32 ``m`` and ``nu``.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).
    key: an int seed or a JAX PRNG key for the stochastic rounding.
    min_size: the old name of ``min_quantized_size`` (deprecated).

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {"w": jnp.full((64, 128), 2.0)}
    >>> loss = lambda p: jnp.sum(p["w"] ** 2)
    >>> opt = optax_memopt.ternary_adam(learning_rate=0.1)
    >>> state = opt.init(params)
    >>> for _ in range(50):
    ...   updates, state = opt.update(jax.grad(loss)(params), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> bool(loss(params) < 0.01 * 64 * 128 * 4.0)
    True

  References:
    Loshchilov and Hutter, "Decoupled Weight Decay Regularization", 2019
    (https://arxiv.org/abs/1711.05101).
  """
  hyperparameters.check_learning_rate(learning_rate)
  hyperparameters.check_non_negative("weight_decay", weight_decay)
  hyperparameters.check_mask("mask", mask)
  min_quantized_size = hyperparameters.renamed_keyword(
    "min_size", min_size, "min_quantized_size", min_quantized_size, 4096
  )
  return optax.chain(
    scale_by_ternary_adam(
      b1=b1,
      b2=b2,
      eps=eps,
      block_size=block_size,
      min_quantized_size=min_quantized_size,
      packing=packing,
      key=key,
    ),
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )
