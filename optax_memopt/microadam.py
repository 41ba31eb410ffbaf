"""MicroAdam: Adam from a window of sparse gradients and 4-bit error feedback.

Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
Overhead and Provable Convergence", NeurIPS 2024,
https://arxiv.org/abs/2405.15593.

Instead of dense moments, MicroAdam keeps, per tensor, a ring of the last
``window`` sparse gradients (the top ``density`` fraction of each block of
``block_size`` entries by magnitude; int16 block-local indices and bf16
values) and a 4-bit error-feedback buffer holding what the top-k dropped,
added back to the next gradient. Adam's ``m`` and ``v`` are rebuilt from the
window at every step. At the defaults the state is about 0.9 bytes per
parameter, against 8 for fp32 Adam.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from optax_memopt import hyperparameters, leaves, sharding
from pallas_kernels import dispatch, error_feedback, microadam_update, quantize, static_args, topk

ERROR_BITS = 4


class ScaleByMicroAdamState(NamedTuple):
  """State of ``scale_by_microadam``; every field but ``count`` mirrors the params.

  Shapes are per parameter of ``d`` elements, with ``K =
  topk.selection_size(d, density=density, block_size=block_size)`` entries
  kept per step. Each parameter-shaped tree holds one array per parameter
  (the error feedback is three such trees), so the state goes through Flax
  NNX's ``nnx.Optimizer`` under ``nnx.jit`` unchanged.
  """

  count: jax.Array  # shape=(), dtype=jnp.int32; steps taken.
  indices: optax.Updates  # shape=(window, K), dtype=jnp.int16; block-local, block-major.
  values: optax.Updates  # shape=(window, K), dtype=jnp.bfloat16.
  # codes: shape=(ceil(d / 2),), dtype=jnp.uint8 (4-bit, planar layout);
  # minimum, maximum: shape=(ceil(d / bucket_size),), dtype=jnp.bfloat16.
  error: quantize.QuantizedArray

  field_layouts = {
    "count": sharding.Layout.REPLICATED,
    "indices": sharding.Layout.FLAT,
    "values": sharding.Layout.FLAT,
    "error": sharding.Layout.FLAT,
  }


def _check_hyperparameters(
  b1, b2, eps, window, density, block_size, bucket_size, implementation
) -> tuple[int, float, int, int]:
  """The shape-fixing hyper-parameters as Python numbers; a ``ValueError`` naming a bad one."""
  hyperparameters.check_decay_rate("b1", b1)
  hyperparameters.check_decay_rate("b2", b2)
  hyperparameters.check_non_negative("eps", eps)
  window = hyperparameters.check_int("window", window, 1)
  density = hyperparameters.check_fraction("density", density)
  block_size = hyperparameters.check_int(
    "block_size",
    block_size,
    1,
    static_args.INT16_INDEX_LIMIT,
    hint=" (block-local indices are stored as int16)",
  )
  bucket_size = hyperparameters.check_int("bucket_size", bucket_size, 1)
  # Raises ValueError naming bucket_size for a size the quantizer does not take.
  quantize.num_buckets(0, bucket_size)
  dispatch.check(implementation)
  if implementation in ("pallas", "interpret"):
    unsupported = error_feedback.kernel_unsupported_reason(block_size, bucket_size)
    if unsupported is not None:
      raise ValueError(unsupported)
  return window, density, block_size, bucket_size


def _whole_blocks(size: int, block_size: int, bucket_size: int) -> bool:
  """Whether a tensor of ``size`` elements is whole top-k blocks that divide over the devices.

  Each block is whole buckets and packed code rows, so every part of its
  step (selection, error codes and statistics, the window's update) lies
  within blocks, and a shard of whole blocks can take its step alone
  (:func:`_block_local_step`). A tensor of fewer blocks than some sharding
  of it would cut (its blocks not a multiple of the devices) takes the step
  unpartitioned: its blocks would straddle shards, and the custom
  partitioning would leave its state laid out unlike its declared layout.
  """
  if not (size > 0 and size % block_size == 0 and block_size % bucket_size == 0 and block_size % quantize.ROW == 0):
    return False
  return (size // block_size) % jax.device_count() == 0


# Operands and results of one tensor's step: the flat gradient and direction,
# codes and statistics, ``n`` blocks of ``a``, ``c`` and ``s`` elements each,
# and the ring's ``(window, n * k)`` entries; the step count and decay rates
# are scalars. Flat, the partitioner splits a sharded leading axis into whole
# blocks; a (rows, columns) -> (blocks, block_size) reshape whose blocks cross
# rows would move the tensor through an all-to-all.
_BLOCK_RULE = "(n a), w (n k), w (n k), (n c), (n s), (n s), , , , -> (n a), w (n k), w (n k), (n c), (n s), (n s)"


def _block_rule(**sizes: int) -> tuple[str, dict[str, int]]:
  """``_BLOCK_RULE`` and its factors' sizes, without the factors of size 1 (which Shardy refuses in a compound)."""
  rule = _BLOCK_RULE
  for factor, size in sizes.items():
    if size == 1:
      rule = re.sub(rf"\(n {factor}\)", "n", rule) if factor != "n" else re.sub(r"\(n (\w)\)", r"\1", rule)
  kept = {factor: size for factor, size in sizes.items() if size > 1 and re.search(rf"\({factor} |\b{factor}\)", rule)}
  return rule, kept


def _block_local_step(
  flat_step, gradient, indices, values, codes, minimum, maximum, *scalars, window: int, block_size: int
):
  """``flat_step`` of a tensor of whole blocks, taken by each device on the blocks it holds.

  The step is partitioned by ``custom_partitioning`` along its blocks
  (``_BLOCK_RULE``): where the mesh axes that shard the flattened tensor cut
  it into runs of whole blocks, each device runs ``flat_step`` (kernels
  included) on its own blocks and nothing crosses devices, as for an
  FSDP-sharded parameter and its state laid out by
  ``optax_memopt.state_shardings``. Otherwise (blocks that straddle shards,
  e.g. a parameter's last axis split by tensor parallelism) the partitioner
  brings the blocks together (all-to-all, or all-gather where the blocks do
  not divide over the devices) before the step and back after it: the same
  numbers, with collectives. A device's step computes the window's
  directions ``WINDOW_ENTRIES_AT_ONCE / shards`` entries at a time, so its
  temporaries split like the parameters. A single-device program runs
  ``flat_step`` unchanged.

  Returns:
    ``(direction, indices, values, codes, minimum, maximum)``, the direction
    flat and the state in its own shapes.
  """
  n_blocks = gradient.size // block_size

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    axes = arg_shapes[0].sharding.spec[0] if arg_shapes[0].sharding.spec else None
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    shards = math.prod(mesh.shape[a] for a in names)
    if n_blocks % shards:
      axes, shards = None, 1
    # A device's share of the window entries a single device computes at once:
    # the step's temporaries split like its parameters.
    local_step = functools.partial(flat_step, entries_at_once=max(1, microadam_update.WINDOW_ENTRIES_AT_ONCE // shards))
    flat = NamedSharding(mesh, PartitionSpec(axes))
    ring = NamedSharding(mesh, PartitionSpec(None, axes))
    scalar = NamedSharding(mesh, PartitionSpec())
    results = (flat, ring, ring, flat, flat, flat)
    return mesh, local_step, results, (*results, *(scalar,) * len(scalars))

  def infer(mesh, arg_shapes, result_shape):
    return partition(mesh, arg_shapes, result_shape)[2]

  rule, sizes = _block_rule(
    n=n_blocks,
    a=block_size,
    k=indices.shape[1] // n_blocks,
    c=codes.size // n_blocks,
    s=minimum.size // n_blocks,
  )
  # Positional operands only: custom_partitioning binds no keyword-only arguments.
  step = custom_partitioning(lambda *operands: flat_step(*operands))
  step.def_partition(
    partition=partition,
    infer_sharding_from_operands=infer,
    sharding_rule=rule,
    **sizes,
  )
  return step(gradient.reshape(-1), indices, values, codes, minimum, maximum, *scalars)


def scale_by_microadam(
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  *,
  window: int = 10,
  density: float = 0.01,
  block_size: int = 16384,
  bucket_size: int = 1024,
  implementation: dispatch.Implementation = None,
) -> optax.GradientTransformation:
  """Rescale updates by MicroAdam's window of sparse gradients.

  Per parameter, flattened to ``d`` elements, at step ``t`` (1-based):

  .. math::
    a = g_t + \\mathrm{dequant}(e_{t-1}), \\qquad
    (I_t, V_t) = \\text{block-top-}k(|a|), \\qquad
    e_t = \\mathrm{quant}_4(a \\text{ with } a[I_t] = 0),

  ``(I_t, V_t)`` is written to ring row ``(t - 1) mod m`` (``m = window``),
  and with ``e_r = (t - 1 - r) mod m`` the age of row ``r``,

  .. math::
    M = \\sum_{r < \\min(t, m)} \\beta_1^{e_r} V_r[I_r], \\quad
    S = \\sum_{r < \\min(t, m)} \\beta_2^{e_r} V_r[I_r]^2, \\quad
    u = \\frac{c_1 M}{\\sqrt{c_2 S} + \\epsilon},

  with ``c_1 = (1 - b1) / (1 - b1^t)``, ``c_2 = (1 - b2) / (1 - b2^t)`` and
  ``u = 0`` at entries in no row. Top-k keeps ``ceil(n * density)``
  entries (at least 1) of every block of ``n`` elements: ``n = block_size``
  for the full blocks, the remainder ``d mod block_size`` for the last (a
  tensor smaller than one block is one such block). The 4-bit quantizer is
  asymmetric with bf16 ``min``/``max`` per bucket of ``bucket_size``.
  Arithmetic is fp32 whatever the parameter dtype (fp64, fp32, bf16, fp16):
  a float64 gradient is rounded to float32 on entry (the ring keeps bf16
  values and the error feedback 4-bit codes, far coarser than either), and
  the direction is returned in the parameter's dtype.

  With ``density = 1`` and ``window`` at least the number of steps this is
  Adam (``eps_root = 0``) up to the bf16 rounding of stored gradients. With a
  truncated window it is not: a constant gradient gives
  ``|u| -> (1 - b1^m) / sqrt(1 - b2^m)`` (about 6.5 at the defaults), so the
  steps can be larger than Adam's ``|u| <= 1``.

  State per parameter: ``4 * window * K + ceil(d / 2) + 4 *
  ceil(d / bucket_size)`` bytes (int16 indices and bf16 values in the ring,
  4-bit codes, bf16 statistics), plus one int32 step count, with

  .. math::
    K = \\lfloor d / D \\rfloor \\lceil D \\cdot density \\rceil
        + \\lceil (d \\bmod D) \\cdot density \\rceil, \\qquad D = block\\_size:

  about ``0.9 + 4 / bucket_size`` bytes per parameter at window 10 and
  density 1% (0.904 at the defaults).

  Defaults and why:

  * ``window = 10``, ``density = 0.01``: the paper's.
  * ``block_size = 16384``: whole rows of 256 (64 rows), as the Pallas
    top-k kernel reads blocks; int16 block-local indices (``<= 32768``); and
    a power of two divides the shard sizes of sharded tensors, so no block
    straddles two shards.
  * ``bucket_size = 1024``: 4 rows of 256, so the quantizer's kernels run one
    program per bucket and 16 buckets tile a top-k block. The statistics
    cost ``4 / 1024`` bytes per parameter. Finer buckets buy little: top-k
    already cuts the error at the block's k-th largest magnitude, which
    bounds every bucket's range.

  Args:
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.
    window: number of sparse gradients kept (``m``), ``>= 1``.
    density: fraction of each block kept by top-k, in ``(0, 1]``.
    block_size: elements per top-k block, in ``[1, 32768]``; the Pallas
      error-feedback kernel needs a power of two ``>= 256``.
    bucket_size: elements per min/max statistic of the error feedback: a
      positive multiple of 256, or 32, 64 or 128; the Pallas error-feedback
      kernel needs a power of two dividing ``block_size``.
    implementation: ``None`` (each op's default for the device,
      ``pallas_kernels.dispatch``), ``"xla"``, ``"pallas"`` or
      ``"interpret"``; passed to every op.

  ``window``, ``density``, ``block_size`` and ``bucket_size`` fix the
  state's shapes: they must be Python numbers, and under
  ``optax.inject_hyperparams`` listed in ``static_args``.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: for a hyper-parameter out of range or a shape-fixing one
      given as an array (checked when the transformation is built; ``b1``,
      ``b2``, ``eps`` only when Python numbers).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_memopt
    >>> opt = optax_memopt.scale_by_microadam(block_size=256, density=0.25)
    >>> params = {"w": jnp.zeros((4, 256))}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": jnp.ones((4, 256))}, state)
    >>> int((updates["w"] != 0).sum())  # 64 of each block of 256 kept
    256

  References:
    Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
    Overhead and Provable Convergence", NeurIPS 2024,
    https://arxiv.org/abs/2405.15593
  """
  window, density, block_size, bucket_size = _check_hyperparameters(
    b1, b2, eps, window, density, block_size, bucket_size, implementation
  )

  def init_fn(params):
    leaves.check_param_dtypes(params, "microadam")

    def ring(dtype):
      def zeros(leaf):
        kept = topk.selection_size(leaf.size, density=density, block_size=block_size)
        return jnp.zeros((window, kept), dtype)

      return jax.tree.map(zeros, params)

    def zero_statistics(leaf):
      return jnp.zeros((quantize.num_buckets(leaf.size, bucket_size),), jnp.bfloat16)

    # The error of zeros as the quantizer stores it (constant buckets: code 0,
    # min = max = 0), built directly rather than computed.
    return ScaleByMicroAdamState(
      count=jnp.zeros([], jnp.int32),
      indices=ring(jnp.int16),
      values=ring(jnp.bfloat16),
      error=quantize.QuantizedArray(
        codes=jax.tree.map(lambda p: jnp.zeros((math.ceil(p.size * ERROR_BITS / 8),), jnp.uint8), params),
        minimum=jax.tree.map(zero_statistics, params),
        maximum=jax.tree.map(zero_statistics, params),
      ),
    )

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)

    def flat_step(gradient, indices, values, codes, minimum, maximum, count, b1, b2, eps, *, entries_at_once=None):
      """The step of one flat tensor (or of a shard of whole blocks of it): its direction and state."""
      error = quantize.QuantizedArray(codes, minimum, maximum)
      ring_row = (count - 1) % window
      # Error feedback a = g + dequant(e), the block top-k of |a|, which goes
      # to this step's ring row, and what top-k left out (a with a[I] = 0), the
      # next error in 4 bits.
      selected, kept, error = error_feedback.feedback_step(
        error,
        gradient,
        density=density,
        block_size=block_size,
        bits=ERROR_BITS,
        bucket_size=bucket_size,
        stats_dtype=jnp.bfloat16,
        implementation=implementation,
      )
      indices = indices.at[ring_row].set(selected)
      values = values.at[ring_row].set(kept.astype(jnp.bfloat16))
      # M and S from the window, and the direction c1 M / (sqrt(c2 S) + eps).
      direction = microadam_update.microadam_update(
        indices,
        values,
        count,
        b1,
        b2,
        eps,
        size=gradient.size,
        density=density,
        block_size=block_size,
        dtype=gradient.dtype,
        entries_at_once=entries_at_once,
      )
      return (direction, indices, values, *error)

    def update_leaf(gradient, indices, values, *error):
      param_dtype = gradient.dtype
      # The ops take floats of at most 32 bits; a float64 gradient is read in
      # float32, the precision of MicroAdam's arithmetic.
      if jnp.dtype(param_dtype).itemsize > 4:
        gradient = gradient.astype(jnp.float32)
      hyper = (count, *(jnp.asarray(h, jnp.float32) for h in (b1, b2, eps)))
      # The Pallas interpreter (tests on CPUs) calls back to the host, which custom_partitioning does not take.
      if (
        _whole_blocks(gradient.size, block_size, bucket_size)
        and implementation != "interpret"
        and sharding.PARTITIONS_KERNEL_STEPS
      ):
        direction, *state = _block_local_step(
          flat_step, gradient, indices, values, *error, *hyper, window=window, block_size=block_size
        )
      else:
        direction, *state = flat_step(gradient.reshape(-1), indices, values, *error, *hyper)
      return (direction.reshape(gradient.shape).astype(param_dtype), *state)

    # On XLA:CPU one leaf after another, so that one leaf's dense temporaries
    # (its error feedback and direction) are live at a time, not every leaf's.
    per_leaf = leaves.map_steps(update_leaf, updates, state.indices, state.values, *state.error)
    directions, indices, values, *error = leaves.unzip(updates, per_leaf, 6)
    return directions, ScaleByMicroAdamState(count, indices, values, quantize.QuantizedArray(*error))

  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def microadam(
  learning_rate: optax.ScalarOrSchedule,
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  weight_decay: jax.typing.ArrayLike = 0.0,
  mask: Any | Callable[[optax.Params], Any] | None = None,
  *,
  window: int = 10,
  density: float = 0.01,
  block_size: int = 16384,
  bucket_size: int = 1024,
  implementation: dispatch.Implementation = None,
) -> optax.GradientTransformation:
  """MicroAdam with decoupled weight decay (AdamW style).

  ``chain(scale_by_microadam(...), add_decayed_weights(weight_decay, mask),
  scale_by_learning_rate(learning_rate))``: the update is
  ``-lr * (u + weight_decay * p)`` with ``u`` MicroAdam's direction (see
  ``scale_by_microadam`` for the algorithm, the state and the defaults).

  Args:
    learning_rate: a float or an ``optax.Schedule``.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.
    weight_decay: decoupled weight decay.
    mask: which parameters weight decay applies to (a pytree of booleans or
      a function of the params), as in ``optax.add_decayed_weights``.
    window: number of sparse gradients kept, ``>= 1``.
    density: fraction of each block kept by top-k, in ``(0, 1]``.
    block_size: elements per top-k block, in ``[1, 32768]``.
    bucket_size: elements per min/max statistic of the error feedback: a
      positive multiple of 256, or 32, 64 or 128.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {"w": jnp.ones((64, 64)), "b": jnp.zeros((64,))}
    >>> opt = optax_memopt.microadam(1e-3, weight_decay=1e-2)
    >>> state = opt.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = jax.jit(opt.update)(grads, state, params)
    >>> params = optax.apply_updates(params, updates)

    Under ``optax.inject_hyperparams``, the shape-fixing arguments are static:

    >>> opt = optax.inject_hyperparams(
    ...     optax_memopt.microadam,
    ...     static_args=("window", "density", "block_size", "bucket_size"),
    ... )(learning_rate=1e-3)
    >>> state = opt.init(params)

  References:
    Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
    Overhead and Provable Convergence", NeurIPS 2024,
    https://arxiv.org/abs/2405.15593
  """
  hyperparameters.check_learning_rate(learning_rate)
  hyperparameters.check_non_negative("weight_decay", weight_decay)
  hyperparameters.check_mask("mask", mask)
  return optax.chain(
    scale_by_microadam(
      b1,
      b2,
      eps,
      window=window,
      density=density,
      block_size=block_size,
      bucket_size=bucket_size,
      implementation=implementation,
    ),
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )
