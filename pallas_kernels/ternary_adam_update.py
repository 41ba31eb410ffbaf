r"""One fused step of ternary-state Adam for one tensor.

The first moment is stored as blockwise-scaled trits in the block-major layout
of :mod:`pallas_kernels.ternary`; the second moment ``nu`` is a float32 array
with one entry per element. One step reads the gradient ``g``, the stored
trits ``t`` with their block scales ``s`` and ``nu``, and computes

.. math::
  m = \beta_1\, t\, s + (1 - \beta_1)\, g, \qquad
  \nu' = \beta_2\, \nu + (1 - \beta_2)\, g^2, \qquad
  u = \frac{m / (1 - \beta_1^k)}{\sqrt{\nu' / (1 - \beta_2^k)} + \epsilon},

then stores ``m`` again as trits with stochastic rounding,
``P(t = sign(m)) = |m| / s'`` (unbiased), under new block scales

.. math::
  s' = \beta_1\, s + (1 - \beta_1) \max_{\text{block}} |g|,

a bound on ``|m|`` (``|t s| <= s``) known from the gradient alone, so the
scales need no pass over the new moment. The random bits are the counter hash
of a uint32 seed and of the element's index in the flattened tensor
(:func:`pallas_kernels.ternary.counter_hash_bits`). The direction ``u`` uses
the unrounded ``m``; only the stored moment is rounded. Instead of ``nu`` the
caller may pass ``nu_root``, the square root of this step's second moment
(for instance the outer product of the roots of factored row and column
statistics): it is not updated or returned, and the step takes no square
root per element.

Implementations: :func:`ternary_adam_update_reference` states the step in
plain jnp, element by element; it is the tests' oracle. ``ternary_adam_update``
runs XLA code on the blocks ``(..., block_size)`` of the tensor, equal to the
reference bit for bit (directions to float32 rounding). Its passes over
memory, as XLA:GPU compiles them for a matrix whose rows are whole blocks:
one reduction over ``g`` (the block maxima, and the block sums of ``g**2``
that the factored statistics share, :func:`block_statistics`), one pass
that computes ``m`` once for the direction (fused by XLA into the
parameters' update) and for the new codes, written out at 4 bits per element,
and one that packs those codes. No Pallas kernel: a kernel that wrote the
direction would add a write and a read of it before the parameters' update,
more than the whole XLA step saves.

Block sizes and packings are those of :mod:`pallas_kernels.ternary`:
``block_size`` 32, 64 or a multiple of 128, ``packing`` ``"base3"`` or
``"2bit"``.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import static_args, ternary, xla_cpu
from pallas_kernels.blocks import from_blocks, to_blocks


class TernaryAdamStep(NamedTuple):
  """What one step returns."""

  direction: jax.Array  # The gradient's shape and dtype.
  mu: ternary.TernaryArray  # The new first moment, rounded stochastically.
  nu: jax.Array | None  # float32, nu's shape; None when the step was given nu_root.


# Reference.


def ternary_adam_update_reference(
  grad: jax.Array,
  mu: ternary.TernaryArray,
  nu: jax.Array | None = None,
  *,
  nu_root: jax.Array | None = None,
  seed: jax.Array,
  count: jax.typing.ArrayLike,
  b1: jax.typing.ArrayLike,
  b2: jax.typing.ArrayLike,
  eps: jax.typing.ArrayLike,
  block_size: int,
  packing: str = "base3",
) -> TernaryAdamStep:
  """The step of ``ternary_adam_update`` in plain jnp, element by element of the flat tensor.

  The math of the module docstring and the byte layout of
  :mod:`pallas_kernels.ternary`, written for reading rather than
  speed; arguments and result as ``ternary_adam_update``'s (unchecked).
  """
  layout = ternary.packing_layout(packing)
  size, n_blocks = grad.size, math.prod(mu.packed.shape[:-1])
  b1, b2, eps = (jnp.float32(x) for x in (b1, b2, eps))
  k = jnp.asarray(count).astype(jnp.float32)
  g = grad.reshape(-1).astype(jnp.float32)
  place = layout.base ** jnp.arange(layout.planes, dtype=jnp.int32)[:, None]

  def per_element(scales):
    return jnp.repeat(scales.reshape(-1), block_size)[:size]

  # Byte j of a block holds the codes t + 1 of its elements j + p w, digit p.
  block_bytes = mu.packed.reshape(n_blocks, 1, -1).astype(jnp.int32)
  codes = (block_bytes // place % layout.base).reshape(n_blocks, -1)[:, :block_size]
  trits = (codes.reshape(-1)[:size] - 1).astype(jnp.float32)
  m = b1 * (trits * per_element(mu.scales)) + (1 - b1) * g
  if nu is not None:
    nu_shape = nu.shape
    nu = b2 * nu.reshape(-1).astype(jnp.float32) + (1 - b2) * g * g
    root_of_nu_hat = jnp.sqrt(nu / (1 - b2**k))
  else:
    root_of_nu_hat = nu_root.reshape(-1).astype(jnp.float32) / jnp.sqrt(1 - b2**k)
  direction = (m / (1 - b1**k)) / (root_of_nu_hat + eps)

  magnitude = jnp.pad(jnp.abs(g), (0, n_blocks * block_size - size))
  new_scales = b1 * mu.scales.reshape(-1) + (1 - b1) * magnitude.reshape(n_blocks, block_size).max(axis=1)
  bits = ternary.counter_hash_bits(seed, jnp.arange(size, dtype=jnp.uint32))
  uniform = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  keep = uniform * per_element(new_scales) < jnp.abs(m)
  new_codes = jnp.where(keep, jnp.where(m < 0, 0, 2), 1)
  width = mu.packed.shape[-1]
  slots = jnp.ones((n_blocks * block_size,), jnp.int32).at[:size].set(new_codes)
  slots = jnp.pad(
    slots.reshape(n_blocks, block_size), ((0, 0), (0, layout.planes * width - block_size)), constant_values=1
  )
  new_bytes = jnp.sum(slots.reshape(n_blocks, layout.planes, width) * place, axis=1)
  return TernaryAdamStep(
    direction.reshape(grad.shape).astype(grad.dtype),
    ternary.TernaryArray(
      new_bytes.astype(jnp.uint8).reshape(mu.packed.shape),
      new_scales.reshape(mu.scales.shape),
    ),
    None if nu is None else nu.reshape(nu_shape),
  )


# XLA implementation.


def block_statistics(grad_blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``sum g**2`` and ``max |g|`` over the last axis of float32 blocks ``(..., block_size)``.

  One reduction for both: the factored second moment's row sums (summed
  over a row's blocks) and the new scales then take one pass over ``g``
  (on XLA:CPU two, folded in halves: ``xla_cpu.reduce_row``). Called
  with the same blocks by the optimizer and by the step, the two calls are
  one computation after XLA's common-subexpression elimination.
  """
  return xla_cpu.reduce_row(
    (jnp.square(grad_blocks), jnp.abs(grad_blocks)),
    (np.float32(0), np.float32(0)),
    lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
  )


def _own_zero(seed: jax.Array) -> jax.Array:
  """An int32 zero that XLA cannot tell from another tensor's (it comes from this tensor's seed).

  Index vectors built from it are this tensor's own. Shared by several
  tensors' steps (a constant, or one iota after common-subexpression
  elimination), one would be an operand of all their code passes, and
  XLA:GPU's sibling fusion merges passes that share an operand: it would
  merge the code passes of different tensors into one, which splits each
  from its direction (that then reads ``g`` and the codes again).
  """
  return jnp.minimum((seed >> 1).astype(jnp.int32), 0)


def _element_indices(shape: tuple[int, ...], zero: jax.Array) -> jax.Array:
  """uint32 row-major index of each element of an array of ``shape``, from ``_own_zero``'s ``zero``.

  A sum of per-axis iotas rather than a reshaped flat iota, so that the SPMD
  partitioner computes each device's indices in place.
  """
  index = jnp.full(shape, zero.astype(jnp.uint32))
  stride = 1
  for axis in reversed(range(len(shape))):
    iota = lax.broadcasted_iota(jnp.int32, (shape[axis],), 0) + zero
    index = index + lax.broadcast_in_dim(iota.astype(jnp.uint32), shape, (axis,)) * jnp.uint32(stride)
    stride *= shape[axis]
  return index


def _stored_codes_on_gpu(packed: jax.Array, zero: jax.Array, block_size: int, layout: Any) -> jax.Array:
  """``ternary.unpack_blocks`` by a gather of each element's byte.

  ``unpack_blocks`` concatenates the planes' bytes, which XLA:GPU writes out
  as a float32 moment; reading each element's byte by index keeps the codes
  inside the fusions that use them.
  """
  width = packed.shape[-1]
  position = lax.iota(jnp.int32, block_size) + zero  # This tensor's own (_own_zero).
  byte = jnp.take(packed, position % width, axis=-1)
  return ternary.digits(byte, layout.base ** (position // width), layout.base)


def _codes_written_out_on_gpu(codes: jax.Array) -> jax.Array:
  """``codes`` (``[0, base)``); on XLA:GPU written out at 4 bits per element by the direction's pass.

  Packing reads 5 (or 4) codes per byte, in another shape than the
  parameters' update: XLA:GPU would recompute ``m`` there from ``g`` and the
  old codes (4 bytes per element read again). The barrier makes the pass that
  computes the direction also write the codes, in half a byte per element.
  """
  return lax.platform_dependent(
    codes,
    cpu=lambda codes: codes,
    default=lambda codes: lax.optimization_barrier(codes.astype(jnp.uint4)).astype(jnp.uint32),
  )


def _update_blocks(
  grad: jax.Array,
  stored: jax.Array,
  scales: jax.Array,
  nu: jax.Array,
  seed: jax.Array,
  hyper: jax.Array,
  *,
  block_size: int,
  layout: Any,
  update_nu: bool,
  absmax: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """The step on the tensor's blocks: direction, new bytes, new scales and new ``nu``.

  ``nu`` is last step's float32 second moment with ``update_nu``, the root of
  this step's otherwise; ``absmax`` the blocks' ``max |g|`` or None.
  """
  b1, b2 = hyper[_B1], hyper[_B2]
  blocks = stored.shape[:-1]
  grad_blocks = to_blocks(grad.astype(jnp.float32), blocks, block_size)
  if absmax is None:
    _, absmax = block_statistics(grad_blocks)
  new_scales = b1 * scales + (1 - b1) * absmax[..., None]
  stored_codes = lax.platform_dependent(
    stored,
    cpu=lambda stored: ternary.unpack_blocks(stored, block_size, layout),
    default=lambda stored: _stored_codes_on_gpu(stored, _own_zero(seed), block_size, layout),
  )
  m = b1 * ((stored_codes - 1) * scales) + (1 - b1) * grad_blocks
  nu_blocks = to_blocks(nu.astype(jnp.float32), blocks, block_size)
  if update_nu:
    nu_blocks = b2 * nu_blocks + (1 - b2) * jnp.square(grad_blocks)
    root_of_nu_hat = jnp.sqrt(nu_blocks / hyper[_BIAS_CORRECTION_2])
  else:
    root_of_nu_hat = nu_blocks * hyper[_INVERSE_ROOT_BIAS_CORRECTION_2]
  direction = (m / hyper[_BIAS_CORRECTION_1]) / (root_of_nu_hat + hyper[_EPS])
  bits = ternary.counter_hash_bits(seed, _element_indices(m.shape, _own_zero(seed)))
  codes = _codes_written_out_on_gpu(ternary.ternary_codes(m, new_scales, bits))
  new_stored = ternary.pack_blocks(codes, layout)
  new_nu = from_blocks(nu_blocks, nu.shape) if update_nu else None
  return from_blocks(direction, grad.shape).astype(grad.dtype), new_stored, new_scales, new_nu


# Entry point.

# Order of the scalars in the step's hyper-parameter vector.
_B1, _B2, _EPS, _BIAS_CORRECTION_1, _BIAS_CORRECTION_2, _INVERSE_ROOT_BIAS_CORRECTION_2 = range(6)


def _hyperparameters(count, b1, b2, eps) -> jax.Array:
  """float32 ``[b1, b2, eps, 1 - b1**count, 1 - b2**count, 1 / sqrt(1 - b2**count)]``."""
  b1, b2, eps = (jnp.asarray(x, jnp.float32) for x in (b1, b2, eps))
  count = jnp.asarray(count).astype(jnp.float32)
  bias_correction_2 = 1 - b2**count
  return jnp.stack([b1, b2, eps, 1 - b1**count, bias_correction_2, lax.rsqrt(bias_correction_2)])


@functools.partial(jax.jit, static_argnames=("block_size", "layout", "update_nu"))
def _jitted_update(
  grad,
  stored,
  scales,
  nu,
  seed,
  count,
  b1,
  b2,
  eps,
  absmax,
  *,
  block_size: int,
  layout: Any,
  update_nu: bool,
):
  hyper = _hyperparameters(count, b1, b2, eps)
  direction, new_stored, new_scales, new_nu = _update_blocks(
    grad,
    stored,
    scales,
    nu.reshape(grad.shape),
    seed,
    hyper,
    block_size=block_size,
    layout=layout,
    update_nu=update_nu,
    absmax=absmax,
  )
  return TernaryAdamStep(
    direction,
    ternary.TernaryArray(new_stored, new_scales),
    new_nu.reshape(nu.shape) if update_nu else None,
  )


def ternary_adam_update(
  grad: jax.typing.ArrayLike,
  mu: ternary.TernaryArray | None = None,
  nu: jax.typing.ArrayLike | None = None,
  *,
  nu_root: jax.typing.ArrayLike | None = None,
  seed: jax.typing.ArrayLike,
  count: jax.typing.ArrayLike,
  b1: jax.typing.ArrayLike,
  b2: jax.typing.ArrayLike,
  eps: jax.typing.ArrayLike,
  block_size: int,
  packing: str = "base3",
  block_absmax: jax.typing.ArrayLike | None = None,
  momentum: ternary.TernaryArray | None = None,
) -> TernaryAdamStep:
  """One Adam step of a tensor whose first moment is stored as trits.

  .. math::
    m = \\beta_1 \\hat m + (1 - \\beta_1) g, \\quad
    \\nu' = \\beta_2 \\nu + (1 - \\beta_2) g^2, \\quad
    u = \\frac{m / (1 - \\beta_1^k)}{\\sqrt{\\nu' / (1 - \\beta_2^k)} + \\epsilon},
    \\quad \\hat m' = s' \\cdot \\mathrm{round}_\\xi(m / s'), \\quad
    s' = \\beta_1 s + (1 - \\beta_1) \\max_\\text{block} |g|

  where ``\\hat m`` is the decoded ``mu`` with block scales ``s``, ``k``
  is ``count`` and ``round_xi`` unbiased stochastic rounding to ``{-1, 0, 1}``
  with the random bits ``ternary.counter_hash_bits(seed, index)`` of the
  element's index in the flattened tensor (``optax_memopt.ternary_adam``
  draws each tensor's ``seed`` from its key at every step).

  The second moment comes in one of two ways. ``nu``: last step's, updated
  here with ``g**2`` and returned. ``nu_root``: the square root of this
  step's ``nu'``, used as it is and not returned; a caller that factors
  ``nu'`` (the outer product of row and column statistics) passes the outer
  product of their roots, and the step takes no square root per element.

  Args:
    grad: the gradient, a floating array of any shape.
    mu: the stored first moment of ``grad``, a ``TernaryArray`` in
      the block-major layout of ``ternary.shapes(grad.shape, ...)`` (from
      ``ternary.zeros`` or a previous step).
    nu: last step's float32 second moment, ``grad.size`` elements; or None
      when ``nu_root`` is given.
    nu_root: instead of ``nu``: the root of this step's second moment,
      ``grad.size`` floating elements.
    seed: the uint32 seed of the stochastic rounding's random bits; draw a
      fresh one for every step and tensor.
    count: the step number ``k >= 1`` of the bias corrections.
    b1: first-moment decay in ``[0, 1)``.
    b2: second-moment decay in ``[0, 1)``.
    eps: added to the root of the second moment, ``>= 0``.
    block_size: elements per scale block: 32, 64 or a multiple of 128.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).
    block_absmax: the blocks' ``max |g|``, float32 of the scales' shape
      without their last axis, where the caller has them from
      ``block_statistics`` (one reduction over ``g`` for both); found here
      otherwise.
    momentum: the old name of ``mu`` (deprecated: a ``DeprecationWarning``).

  Returns:
    A ``TernaryAdamStep``: the direction ``u`` (the gradient's shape and
    dtype), the new ``mu`` (a block-major ``TernaryArray``) and the new
    ``nu`` (``None`` when ``nu_root`` was given).

  Raises:
    ValueError: naming the argument that is missing, of the wrong shape or
      dtype, out of range, or given under both its names.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_kernels import ternary
    >>> from pallas_kernels.ternary_adam_update import ternary_adam_update
    >>> grad = jnp.linspace(-1.0, 1.0, 1024).reshape(4, 256)
    >>> mu = ternary.zeros(grad.shape, block_size=128)
    >>> step = ternary_adam_update(
    ...     grad, mu, jnp.zeros_like(grad), seed=jnp.uint32(7), count=1,
    ...     b1=0.9, b2=0.999, eps=1e-8, block_size=128)
    >>> bool(jnp.allclose(step.direction, jnp.sign(grad), atol=1e-4))
    True
    >>> step.mu.packed.shape, step.mu.scales.shape
    ((4, 2, 26), (4, 2, 1))

  References:
    Kingma and Ba, "Adam: A Method for Stochastic Optimization", 2015
    (https://arxiv.org/abs/1412.6980).
  """
  if momentum is not None:
    if mu is not None:
      raise ValueError("momentum is the old name of mu; pass mu only.")
    warnings.warn("momentum is deprecated; pass mu instead.", DeprecationWarning, stacklevel=2)
    mu = momentum
  if mu is None:
    raise ValueError("mu, the stored first moment, is missing.")
  grad = jnp.asarray(grad)
  if not jnp.issubdtype(grad.dtype, jnp.floating):
    raise ValueError(f"grad must have a floating dtype; got {grad.dtype}.")
  ternary.check_block_size(block_size)
  layout = ternary.packing_layout(packing)
  if not isinstance(mu, ternary.TernaryArray):
    raise ValueError(f"mu must be a TernaryArray; got {type(mu).__name__}.")
  stored, scales = (jnp.asarray(a) for a in mu)
  for name, actual, expected in zip(
    ("packed", "scales"),
    (stored, scales),
    ternary.shapes(grad.shape, block_size=block_size, packing=packing),
  ):
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
      raise ValueError(
        f"mu.{name} must be {expected.dtype}{list(expected.shape)} for a"
        f" gradient of shape {grad.shape}, block_size={block_size} and"
        f" packing={packing!r}; got {actual.dtype}{list(actual.shape)}."
      )
  if (nu is None) == (nu_root is None):
    raise ValueError("Pass exactly one of nu (last step's, updated here) and nu_root.")
  name, second_moment = ("nu", nu) if nu is not None else ("nu_root", nu_root)
  second_moment = jnp.asarray(second_moment)
  if second_moment.size != grad.size or not jnp.issubdtype(second_moment.dtype, jnp.floating):
    raise ValueError(
      f"{name} must be a floating array of grad.size={grad.size} elements; got"
      f" {second_moment.dtype}{list(second_moment.shape)}."
    )
  seed = jnp.asarray(seed)
  if seed.shape != () or seed.dtype != jnp.uint32:
    raise ValueError(f"seed must be a uint32 scalar; got {seed.dtype}{list(seed.shape)}.")
  static_args.check_decay_rate("b1", b1)
  static_args.check_decay_rate("b2", b2)
  static_args.check_non_negative("eps", eps)

  return _jitted_update(
    grad,
    stored,
    scales,
    second_moment,
    seed,
    count,
    b1,
    b2,
    eps,
    block_absmax,
    block_size=block_size,
    layout=layout,
    update_nu=nu is not None,
  )
