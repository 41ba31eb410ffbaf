"""Ternary-state Adam: Adam whose first moment is stored in {-1, 0, +1}.

No published method stores Adam's moments as trits; this is our design,
built from the pieces that the low-precision optimizer literature supports,
and measured on the library's training task (``optax_memopt.training``).

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
  and is known from the gradient alone, rather than the absmax of the new
  ``m``, which costs a pass over every tensor's moment before it can be
  coded (about 10% of the CPU step at 10M parameters, and a pass per chunk
  in the GPU kernel). The scales are larger (more zeros, rounding variance
  ``s |m| - m**2`` up), which did not show in training: validation losses
  after 1000 pre-training steps, absmax / bound, seeds 0-2: 1.873 / 1.899,
  1.859 / 1.834, 1.874 / 1.883; after 300 fine-tuning steps 1.911 / 1.911,
  1.914 / 1.913, 1.915 / 1.913 (``benchmarks.convergence``; AdamW 1.868
  and 1.908 at seed 0). The current step (other random draws, and the root
  of the factored ``nu`` taken from its statistics) scores 1.877, 1.868,
  1.904 and 1.909, 1.918, 1.916, against AdamW's 1.868, 1.855, 1.878 and
  1.908, 1.913, 1.915.
* **Second moment: factored for matrices.** ``nu`` sits under a square root
  in the denominator and cannot be ternary (a code of 0 would blow up the
  step). For tensors of rank >= 2 it is Adafactor's factorization over the
  last two axes: EMAs of the row and column means of ``g**2 + 1e-30``,
  rebuilt as ``outer(row, col) / mean(row)``, about 0 bytes per parameter.
  Tensors of rank < 2 (biases, norm scales) keep a full-precision ``nu``;
  they are a vanishing share of a model's parameters, so a low-bit code
  would save almost nothing.
* **Small tensors stay exact.** Tensors of fewer than ``min_size`` elements
  (4096, the threshold of bitsandbytes and torchao) keep float32 ``m`` and
  ``nu``: their state is small, and per-block scales would cost as much as
  the codes they save.
* **A low default** ``b1 = 0.5``. Stochastic rounding adds zero-mean noise of
  variance up to ``s |m|`` to the stored moment at every step; the EMA keeps
  a ``b1**2`` share of each step's noise, so the noise in ``m`` is about
  ``b1**2 / (1 - b1**2)`` times one step's: 4.3 at ``b1 = 0.9``, 0.33 at
  ``0.5``. SOLO (arXiv 2505.00347) likewise ties the momentum value to the
  precision of signed low-bit states. On the training task (byte-level
  Transformer, batches of 16 x 64 bytes, learning rate 3e-3, no weight
  decay, AdamW at ``b1 = 0.9`` as the baseline, blocks of 128, one seed per
  run), mean training loss over the last 20 of 300 steps at dim 64: AdamW
  1.87; ternary ``b1`` 0.9: 2.27, 0.8: 2.03, 0.7: 1.93, 0.6: 1.89, 0.5:
  1.85; over the last 20 of 600 steps at dim 128: AdamW 1.46,
  ternary ``b1`` 0.5: 1.45, 0.7: 1.59, 0.9: 2.12. The same factored
  optimizer with a full-precision ``m`` scores 1.83-1.85 for every ``b1``
  from 0.5 to 0.9: the gap at high ``b1`` is the rounding noise, not the
  lower momentum.
* **Blocks of 128** by default, as in 4-bit AdamW. Smaller blocks put fewer
  large entries beside each small one (less rounding noise) but cost 4
  bytes of scale per block. At ``b1 = 0.8`` (dim 64, 300 steps) blocks of
  64, 128 and 256 gave 1.98, 2.03 and 2.10; at ``b1 = 0.5`` they gave 1.86,
  1.85 and 1.86, all within run-to-run noise. Blocks of 128 cost
  26/128 + 4/128 = 0.23 bytes per parameter (64: 0.27).
* **Block-major layout.** Each block's trits are packed on their own
  (``ceil(block_size / 5)`` bytes in base 3) and, when blocks tile the last
  axis of a tensor ``(..., n)``, the moment is shaped
  ``(..., n // block_size, bytes)`` with scales ``(..., n // block_size, 1)``
  (``pallas_kernels.ternary_adam_update``): it shards along the same axes as
  its parameter (``optax_memopt.state_shardings``), and the step needs no
  communication beyond the factored statistics' reductions. The price is the
  padding of each block to whole bytes: 0.003 bytes per parameter at blocks
  of 128.

State per tensor of ``d >= min_size`` elements, in ``b = ceil(d / block_size)``
blocks: ``b ceil(block_size / 5)`` bytes of trits (base 3),
``4 b`` bytes of scales and, for a ``(r, c)`` matrix, ``4 (r + c)`` bytes of
factored ``nu``. A Transformer of 9.6M parameters (dim 384, 6 layers) holds
0.256 bytes per parameter (blocks of 64: 0.287; 256: 0.240; ``"2bit"``:
0.303), against 8 for float32 AdamW and about 2 for 8-bit AdamW.

The step of each large tensor (decode ``m``, update ``m`` and ``nu``, the
direction, stochastic re-encoding) is ``pallas_kernels.ternary_adam_update``:
XLA code by default, or with ``implementation="pallas"`` one fused Pallas
kernel on Hopper GPUs, which reads the moment through a conversion to its own
byte layout and is not yet faster than XLA there. The factored statistics are
reductions over whole rows and columns, done in XLA before the fused step,
which receives the root of the rebuilt ``nu`` (the outer product of the
statistics' roots: no square root per element). One draw from the key gives
every tensor's rounding seed for the step.

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import optax

from optax_memopt import hyperparameters, sharding
from optax_memopt.leaves import check_param_dtypes

from pallas_kernels import _backend
from pallas_kernels import dispatch
from pallas_kernels import ternary
from pallas_kernels import ternary_adam_update as fused_step

# Added to g**2 before the factored statistics, as in Adafactor: a gradient
# that is zero so far still gives positive row means, so rebuilding nu never
# divides by zero.
_FACTORED_EPS = 1e-30


class FactoredSecondMoment(NamedTuple):
  """Adafactor's statistics of ``g**2`` for a tensor of shape ``(..., r, c)``."""

  row: jax.Array  # float32, shape (..., r): EMA of the mean over the last axis.
  col: jax.Array  # float32, shape (..., c): EMA of the mean over the second-to-last axis.


class ScaleByTernaryAdamState(NamedTuple):
  """State of ``scale_by_ternary_adam``; ``mu`` and ``nu`` follow the params' tree."""

  count: jax.typing.ArrayLike  # shape=(), dtype=jnp.int32.
  key: jax.Array  # uint32 key data of the rounding key, shape of the key's impl.
  # Per tensor of d >= min_size elements, a ternary.TernaryArray, block-major
  # (ternary_adam_update.momentum_shapes): for a param (..., n) with
  # n % block_size == 0, packed uint8 (..., n // block_size, bytes_per_block)
  # and float32 scales (..., n // block_size, 1); otherwise the same with
  # (ceil(d / block_size),) blocks. Per smaller tensor, float32 of the
  # param's shape.
  mu: optax.Updates
  # Per tensor of d >= min_size elements and rank >= 2, a FactoredSecondMoment;
  # per other tensor, float32 of the param's shape.
  nu: optax.Updates


def _check_hyperparameters(b1, b2, eps, block_size, min_size, packing) -> None:
  """Eager checks; floats only when they are Python numbers (they may be traced)."""
  hyperparameters.check_decay_rate("b1", b1)
  hyperparameters.check_decay_rate("b2", b2)
  hyperparameters.check_non_negative("eps", eps)
  if isinstance(block_size, bool) or not isinstance(block_size, int):
    raise ValueError(
        f"block_size must be a Python int (list it in inject_hyperparams'"
        f" static_args); got {block_size!r}."
    )
  ternary.check_block_size(block_size)
  if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
    raise ValueError(
        f"min_size must be a Python int >= 0 (list it in inject_hyperparams'"
        f" static_args); got {min_size!r}."
    )
  ternary.packing_layout(packing)


def _typed_key(key: int | jax.Array) -> jax.Array:
  """A typed PRNG key from a seed, a typed key or a legacy uint32 key."""
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    return jax.random.key(key)
  if isinstance(key, (jax.Array, np.ndarray)):
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
      return key
    if key.dtype == jnp.uint32 and key.shape == (2,):
      return jax.random.wrap_key_data(key)
    # A seed that inject_hyperparams turned into an array.
    if jnp.issubdtype(key.dtype, jnp.integer) and key.shape == ():
      return jax.random.key(key)
  raise ValueError(
      "key must be an int seed or a single JAX PRNG key (typed, or legacy"
      f" uint32 of shape (2,)); got {key!r}."
  )


def _is_ternary(leaf: jax.Array, min_size: int) -> bool:
  return leaf.size >= min_size


def _check_real(leaf: jax.Array) -> None:
  # The fp32 path below min_size would otherwise drop an imaginary part
  # without a word, and trits have no complex phase.
  if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
    raise ValueError(
        f"ternary_adam supports real floating parameters; got a {leaf.dtype} leaf of shape"
        f" {leaf.shape}. Route complex parameters to another optimizer with optax.partition."
    )


def _is_factored(leaf: jax.Array, min_size: int) -> bool:
  return _is_ternary(leaf, min_size) and leaf.ndim >= 2


def _rebuild_root(nu: FactoredSecondMoment) -> jax.Array:
  """The root of ``outer(row, col) / mean(row)`` over the last two axes.

  As ``outer(sqrt(row / mean(row)), sqrt(col))``: the roots of the
  statistics rather than of every element, so the step takes no square root
  per element (``nu_root`` of the fused step).
  """
  row_mean = jnp.mean(nu.row, axis=-1, keepdims=True)
  # An infinite statistic would rebuild finite rows as 0 (x / inf), whose
  # steps are then m / eps: huge and finite. Make the fault visible instead.
  row_mean = jnp.where(jnp.isfinite(row_mean), row_mean, jnp.nan)
  return jnp.sqrt(nu.row / row_mean)[..., :, None] * jnp.sqrt(nu.col)[..., None, :]


def scale_by_ternary_adam(
    b1: jax.typing.ArrayLike = 0.5,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    block_size: int = 128,
    min_size: int = 4096,
    packing: str = "base3",
    key: int | jax.Array = 0,
    implementation: dispatch.Implementation = None,
) -> optax.GradientTransformation:
  """Rescales updates like Adam, with a ternary first moment and factored second.

  For a tensor of at least ``min_size`` elements, at step ``k`` with
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
  elementwise, and tensors below ``min_size`` elements run plain Adam in
  float32. The design and its defaults are explained in the module
  docstring.

  Args:
    b1: decay of the first moment, in ``[0, 1)``. Lower than Adam's 0.9 so
      that less rounding noise accumulates (module docstring).
    b2: decay of the second-moment statistics, in ``[0, 1)``.
    eps: added to the root of the bias-corrected second moment, ``>= 0``.
    block_size: elements per scale block of the ternary moment: 32, 64 or a
      multiple of 128.
    min_size: tensors with fewer elements keep float32 ``m`` and ``nu``.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).
    key: an int seed or a JAX PRNG key for the stochastic rounding.
    implementation: the fused step's implementation: ``None`` (XLA, for now
      faster than the kernel also on GPUs), ``"xla"``, ``"pallas"`` or
      ``"interpret"``.

  Returns:
    An ``optax.GradientTransformation``.

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
    >>> state.mu["w"].packed.shape, state.nu["w"].row.shape
    ((64, 1, 26), (64,))

  References:
    Kingma and Ba, 2015 (https://arxiv.org/abs/1412.6980); Shazeer and
    Stern, 2018 (https://arxiv.org/abs/1804.04235); Xu et al., 2025
    (https://arxiv.org/abs/2505.00347).
  """
  _check_hyperparameters(b1, b2, eps, block_size, min_size, packing)
  initial_key = _typed_key(key)
  key_impl = jax.random.key_impl(initial_key)
  dispatch.check(implementation)  # Validates it eagerly.

  def init_fn(params):
    check_param_dtypes(params, "ternary_adam")
    def init_mu(param):
      _check_real(param)
      if _is_ternary(param, min_size):
        return fused_step.zero_momentum(param.shape, block_size=block_size, packing=packing)
      return jnp.zeros(param.shape, jnp.float32)

    def init_nu(param):
      if _is_factored(param, min_size):
        return FactoredSecondMoment(
            row=jnp.zeros(param.shape[:-1], jnp.float32),
            col=jnp.zeros(param.shape[:-2] + param.shape[-1:], jnp.float32),
        )
      return jnp.zeros(param.shape, jnp.float32)

    return ScaleByTernaryAdamState(
        count=jnp.zeros([], jnp.int32),
        key=jax.random.key_data(initial_key),
        mu=jax.tree.map(init_mu, params),
        nu=jax.tree.map(init_nu, params),
    )

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=key_impl))
    b1_ = jnp.asarray(b1, jnp.float32)
    b2_ = jnp.asarray(b2, jnp.float32)
    bias_correction_1 = 1 - b1_ ** count.astype(jnp.float32)
    bias_correction_2 = 1 - b2_ ** count.astype(jnp.float32)

    def update_leaf(seed, grad, mu, nu, grad_as_given):
      _check_real(grad)
      if not _is_ternary(grad, min_size):
        g = grad.astype(jnp.float32)
        mu = b1_ * mu + (1 - b1_) * g
        nu = b2_ * nu + (1 - b2_) * g * g
        direction = (mu / bias_correction_1) / (jnp.sqrt(nu / bias_correction_2) + eps)
        return direction.astype(grad.dtype), mu, nu
      factored = isinstance(nu, FactoredSecondMoment)
      if factored:
        # The statistics read the gradient as given, and wait for the
        # previous leaf through nu (_backend.sum_after): the waiting gradient
        # would be copied for them first.
        g = grad_as_given.astype(jnp.float32)
        # Each mean squares the gradient itself: XLA:CPU would otherwise
        # write g**2 out once and read it twice, at twice the cost.
        g_for_columns = lax.optimization_barrier(g)
        row_mean = _backend.sum_after(jnp.square(g), -1, after=nu) / g.shape[-1]
        column_mean = _backend.sum_after(jnp.square(g_for_columns), -2, after=nu) / g.shape[-2]
        # mean(g**2) + eps: the mean(g**2 + eps) of the math, without a
        # tensor of eps that XLA:CPU would write out for the reductions.
        nu = FactoredSecondMoment(
            row=b2_ * nu.row + (1 - b2_) * (row_mean + _FACTORED_EPS),
            col=b2_ * nu.col + (1 - b2_) * (column_mean + _FACTORED_EPS),
        )
      step = fused_step.ternary_adam_update(
          grad,
          mu,
          nu=None if factored else nu,
          nu_root=_rebuild_root(nu) if factored else None,
          seed=seed,
          count=count,
          b1=b1,
          b2=b2,
          eps=eps,
          block_size=block_size,
          packing=packing,
          implementation=implementation,
      )
      return step.direction, step.momentum, nu if factored else step.nu

    grads, treedef = jax.tree.flatten(updates)
    # One draw for every tensor's rounding: a key split per tensor costs
    # two small XLA calls each, on the path of one leaf to the next.
    seeds = jax.random.bits(step_key, (len(grads),), jnp.uint32)
    leaves = _backend.one_leaf_at_a_time(
        update_leaf,
        list(seeds),
        grads,
        treedef.flatten_up_to(state.mu),
        treedef.flatten_up_to(state.nu),
        grads,  # As given, not waiting: for the statistics.
        waiting=(1, 2, 3),
        # The next leaf waits for the state only: the direction is left for
        # XLA to fuse into its consumer (the parameters' update).
        awaited=(1, 2),
        # Two leaves side by side: one's row and column statistics (XNNPACK
        # reductions on one thread) beside the other's loops. 1.64x -> 1.50x
        # AdamW's step at 10M parameters (interleaved runs), for 3.0 -> 3.5 MB
        # of temporary memory; three chains measured no faster.
        chains=2,
    )
    directions, mus, nus = zip(*leaves) if leaves else ((), (), ())
    new_state = ScaleByTernaryAdamState(
        count=count,
        key=jax.random.key_data(next_key),
        mu=treedef.unflatten(mus),
        nu=treedef.unflatten(nus),
    )
    return treedef.unflatten(directions), new_state

  # Block-major reshapes split sharded axes: under explicit mesh axes the
  # update runs with them left to the partitioner, typed like its inputs.
  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def ternary_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.5,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: jax.typing.ArrayLike = 0.0,
    mask: Any = None,
    *,
    block_size: int = 128,
    min_size: int = 4096,
    packing: str = "base3",
    key: int | jax.Array = 0,
    implementation: dispatch.Implementation = None,
) -> optax.GradientTransformation:
  """Ternary-state AdamW: ``scale_by_ternary_adam``, decoupled weight decay, learning rate.

  .. math::
    \\theta_k = \\theta_{k-1} - \\eta_k \\left(u_k + \\lambda \\theta_{k-1}\\right)

  with ``u_k`` the direction of ``scale_by_ternary_adam``. About 0.25 bytes
  of state per parameter on a Transformer (float32 AdamW: 8).

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay of the ternary first moment, in ``[0, 1)``.
    b2: decay of the second-moment statistics, in ``[0, 1)``.
    eps: added to the root of the second moment, ``>= 0``.
    weight_decay: decoupled weight decay ``lambda``.
    mask: which params get weight decay, as in ``optax.adamw``.
    block_size: elements per scale block: 32, 64 or a multiple of 128.
    min_size: tensors with fewer elements keep float32 ``m`` and ``nu``.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).
    key: an int seed or a JAX PRNG key for the stochastic rounding.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

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
  return optax.chain(
      scale_by_ternary_adam(
          b1=b1,
          b2=b2,
          eps=eps,
          block_size=block_size,
          min_size=min_size,
          packing=packing,
          key=key,
          implementation=implementation,
      ),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
