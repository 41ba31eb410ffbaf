r"""One fused step of ternary-state Adam for one tensor.

The first moment is stored as blockwise-scaled trits in the block-major layout
of :mod:`pallas_kernels.ternary_blocks`; the second moment ``nu`` is a float32
array with one entry per element. One step reads the gradient ``g``, the
stored trits ``t`` with their block scales ``s`` and ``nu``, and computes

.. math::
  m = \beta_1\, t\, s + (1 - \beta_1)\, g, \qquad
  \nu' = \beta_2\, \nu + (1 - \beta_2)\, g^2, \qquad
  u = \frac{m / (1 - \beta_1^k)}{\sqrt{\nu' / (1 - \beta_2^k)} + \epsilon},

then stores ``m`` again as trits with stochastic rounding,
``P(t = sign(m)) = |m| / s'`` (unbiased), under new block scales

.. math::
  s' = \beta_1\, s + (1 - \beta_1) \max_{\text{block}} |g|,

a bound on ``|m|`` (``|t s| <= s``) known before ``m`` is, so the step needs
no pass over the new moment to find its block maxima. The random bits are the
counter hash of a uint32 seed and of the element's index in the flattened
tensor (:func:`pallas_kernels.ternary.counter_hash_bits`). The direction
``u`` uses the unrounded ``m``; only the stored moment is rounded. Instead of
``nu`` the caller may pass ``nu_root``, the square root of this step's second
moment (for instance the outer product of the roots of factored row and
column statistics): it is not updated or returned, and the step takes no
square root per element. :func:`ternary_adam_update_reference` states the
step in plain jnp.

Implementations (``implementation=``):

* ``"xla"``: jnp code on the block-major arrays, arranged so that XLA:CPU
  vectorizes it; equal to the reference bit for bit.
* ``"pallas"``: one Mosaic GPU kernel (``plgpu.kernel``) over chunks of whole
  scale blocks and whole packed rows of the flat layout of
  :mod:`pallas_kernels.ternary` (:mod:`pallas_kernels._ternary_chunks`). Its
  loads are 128-lane slices, which cannot read the block-major bytes in
  place: XLA converts the moment's bytes to the flat layout before the kernel
  and back after it. The new scales are computed in XLA for both
  implementations; the last partial chunk runs in the XLA path. The kernel
  takes the square root as ``x * rsqrt(x)`` (Mosaic GPU on JAX 0.10 lowers no
  ``sqrt``), so its directions agree with the reference to a few float32
  ulps; trits, scales and ``nu`` agree bit for bit.
* ``"interpret"``: the same kernel run by the Mosaic GPU interpreter (CPU).
* ``None``: ``"xla"`` everywhere while the kernel with its layout
  conversions is slower (``dispatch.FASTER_ON_HOPPER``).

Block sizes and packings are those of :mod:`pallas_kernels.ternary`:
``block_size`` 32, 64 or a multiple of 128, ``packing`` ``"base3"`` or
``"2bit"``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels import _ternary_chunks as chunks
from pallas_kernels import dispatch
from pallas_kernels import packing as planar
from pallas_kernels import ternary
from pallas_kernels import ternary_blocks

PLANE_WIDTH = planar.PLANE_WIDTH
# Gradient dtypes the kernel reads directly (converted to float32 in registers).
_KERNEL_GRAD_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Order of the scalars in the kernel's hyper-parameter input.
_B1, _B2, _EPS, _BIAS_CORRECTION_1, _BIAS_CORRECTION_2, _INVERSE_ROOT_BIAS_CORRECTION_2 = range(6)


class TernaryAdamStep(NamedTuple):
  """What one step returns."""

  direction: jax.Array  # The gradient's shape and dtype.
  momentum: ternary.TernaryArray  # The new first moment, rounded stochastically.
  nu: jax.Array | None  # float32, nu's shape; None when the step was given nu_root.


# Elementwise math shared by the kernel body and the reference.


def _first_moment(previous: jax.Array, grad: jax.Array, b1: jax.Array) -> jax.Array:
  return b1 * previous + (1 - b1) * grad


def _second_moment(previous: jax.Array, grad: jax.Array, b2: jax.Array) -> jax.Array:
  return b2 * previous + (1 - b2) * (grad * grad)


def _direction(m: jax.Array, root_of_nu_hat: jax.Array, bias_correction_1, eps) -> jax.Array:
  """Adam's ``m_hat / (sqrt(nu_hat) + eps)`` from the root of the bias-corrected ``nu``."""
  return (m / bias_correction_1) / (root_of_nu_hat + eps)


def _kernel_sqrt(x: jax.Array) -> jax.Array:
  """``sqrt`` as ``x * rsqrt(x)`` (Mosaic GPU on JAX 0.10 has no sqrt), 0 where ``x`` is.

  A NaN second moment stays NaN, so a non-finite gradient shows in the step.
  """
  return jnp.where(x != 0, x * lax.rsqrt(x), 0.0)


def _hyperparameters(count, b1, b2, eps) -> jax.Array:
  """float32 ``[b1, b2, eps, 1 - b1**count, 1 - b2**count, 1 / sqrt(1 - b2**count)]``."""
  b1, b2, eps = (jnp.asarray(x, jnp.float32) for x in (b1, b2, eps))
  count = jnp.asarray(count).astype(jnp.float32)
  bias_correction_2 = 1 - b2**count
  return jnp.stack(
      [b1, b2, eps, 1 - b1**count, bias_correction_2, lax.rsqrt(bias_correction_2)]
  )


# Reference.


def ternary_adam_update_reference(
    grad: jax.Array,
    momentum: ternary.TernaryArray,
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
  :mod:`pallas_kernels.ternary_blocks`, written for reading rather than
  speed; arguments and result as ``ternary_adam_update``'s (unchecked).
  """
  layout = ternary.packing_layout(packing)
  size, n_blocks = grad.size, math.prod(momentum.packed.shape[:-1])
  b1, b2, eps = (jnp.float32(x) for x in (b1, b2, eps))
  k = jnp.asarray(count).astype(jnp.float32)
  g = grad.reshape(-1).astype(jnp.float32)
  place = layout.base ** jnp.arange(layout.planes, dtype=jnp.int32)[:, None]

  def per_element(scales):
    return jnp.repeat(scales.reshape(-1), block_size)[:size]

  # Byte j of a block holds the codes t + 1 of its elements j + p w, digit p.
  block_bytes = momentum.packed.reshape(n_blocks, 1, -1).astype(jnp.int32)
  codes = (block_bytes // place % layout.base).reshape(n_blocks, -1)[:, :block_size]
  trits = (codes.reshape(-1)[:size] - 1).astype(jnp.float32)
  m = b1 * (trits * per_element(momentum.scales)) + (1 - b1) * g
  if nu is not None:
    nu_shape = nu.shape
    nu = b2 * nu.reshape(-1).astype(jnp.float32) + (1 - b2) * g * g
    root_of_nu_hat = jnp.sqrt(nu / (1 - b2**k))
  else:
    root_of_nu_hat = nu_root.reshape(-1).astype(jnp.float32) / jnp.sqrt(1 - b2**k)
  direction = (m / (1 - b1**k)) / (root_of_nu_hat + eps)

  magnitude = jnp.pad(jnp.abs(g), (0, n_blocks * block_size - size))
  new_scales = b1 * momentum.scales.reshape(-1) + (1 - b1) * magnitude.reshape(
      n_blocks, block_size).max(axis=1)
  bits = ternary.counter_hash_bits(seed, jnp.arange(size, dtype=jnp.uint32))
  uniform = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  keep = uniform * per_element(new_scales) < jnp.abs(m)
  new_codes = jnp.where(keep, jnp.where(m < 0, 0, 2), 1)
  width = momentum.packed.shape[-1]
  slots = jnp.ones((n_blocks * block_size,), jnp.int32).at[:size].set(new_codes)
  slots = jnp.pad(slots.reshape(n_blocks, block_size), ((0, 0), (0, layout.planes * width - block_size)),
                  constant_values=1)
  new_bytes = jnp.sum(slots.reshape(n_blocks, layout.planes, width) * place, axis=1)
  return TernaryAdamStep(
      direction.reshape(grad.shape).astype(grad.dtype),
      ternary.TernaryArray(
          new_bytes.astype(jnp.uint8).reshape(momentum.packed.shape),
          new_scales.reshape(momentum.scales.shape),
      ),
      None if nu is None else nu.reshape(nu_shape),
  )


# XLA implementation.


def _element_indices(shape: tuple[int, ...], offset: int) -> jax.Array:
  """uint32 row-major index (plus ``offset``) of each element of an array of ``shape``.

  A sum of per-axis iotas rather than a reshaped flat iota, so that the SPMD
  partitioner computes each device's indices in place.
  """
  index = jnp.full(shape, offset, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride *= shape[axis]
  return index


def _block_absmax(x: jax.Array) -> jax.Array:
  """``max |x|`` over the last axis, keeping it (size 1); ``+0`` for a block of zeros, NaN if any.

  Elementwise maxima of the two halves of each block while its length is
  even, then a reduction of what is left (1 element for power-of-two
  blocks): XLA:CPU runs the halving as one vectorized loop, faster than
  its reduction over short rows.
  """
  magnitude = jnp.abs(x)
  while magnitude.shape[-1] % 2 == 0:
    half = magnitude.shape[-1] // 2
    magnitude = jnp.maximum(magnitude[..., :half], magnitude[..., half:])
  return jnp.max(magnitude, axis=-1, keepdims=True)


def _scale_bound(grad_blocks: jax.Array, scales: jax.Array, b1: jax.Array) -> jax.Array:
  """The new block scales ``b1 s + (1 - b1) max |g|`` from gradient blocks ``(..., block_size)``."""
  return b1 * scales + (1 - b1) * _block_absmax(grad_blocks.astype(jnp.float32))


def _second_moment_and_root(
    nu: jax.Array, grad: jax.Array, hyper: jax.Array, *, update_nu: bool
) -> tuple[jax.Array, jax.Array]:
  """The new ``nu`` (``nu`` itself if not ``update_nu``) and the root of its bias-corrected value.

  ``nu`` is last step's float32 second moment with ``update_nu``, and the
  root of this step's otherwise.
  """
  if not update_nu:
    return nu, nu * hyper[_INVERSE_ROOT_BIAS_CORRECTION_2]
  nu = _second_moment(nu, grad.astype(jnp.float32), hyper[_B2])
  # jnp.sqrt, not the kernel's x * rsqrt(x): XLA:CPU vectorizes it; the
  # directions differ by float32 rounding.
  return nu, jnp.sqrt(nu / hyper[_BIAS_CORRECTION_2])


def _new_trits(
    m: jax.Array, new_scales: jax.Array, seed: jax.Array, *, layout: Any, index_offset: int
) -> jax.Array:
  """The bytes of ``m`` ``(..., block_size)`` rounded stochastically to trits of ``new_scales``."""
  bits = ternary.counter_hash_bits(seed, _element_indices(m.shape, index_offset))
  return ternary_blocks.pack_blocks(ternary.ternary_codes(m, new_scales, bits), layout)


def _step_blocks(
    grad: jax.Array,
    stored: jax.Array,
    scales: jax.Array,
    new_scales: jax.Array,
    nu: jax.Array,
    seed: jax.Array,
    hyper: jax.Array,
    *,
    layout: Any,
    update_nu: bool,
    index_offset: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The step on blocks: ``grad`` and float32 ``nu`` of shape ``(..., block_size)``.

  ``nu`` as in ``_second_moment_and_root``. Returns the direction, the new
  trits' bytes and the new ``nu``; ``index_offset`` is the flat index of the
  first element.
  """
  block_size = grad.shape[-1]

  def moment(grad, stored):
    previous = (ternary_blocks.unpack_blocks(stored, block_size, layout) - 1) * scales
    return _first_moment(previous, grad.astype(jnp.float32), hyper[_B1])

  nu, root_of_nu_hat = _second_moment_and_root(nu, grad, hyper, update_nu=update_nu)
  direction = _direction(
      moment(grad, stored), root_of_nu_hat, hyper[_BIAS_CORRECTION_1], hyper[_EPS]
  ).astype(grad.dtype)
  # The codes compute the moment afresh from the gradient and the stored
  # trits (the barrier keeps XLA from merging it with the direction's):
  # XLA would otherwise write every tensor's float32 moment out at once, and
  # that temporary memory, faulted in anew at every step, cost more than
  # the arithmetic.
  m = moment(*lax.optimization_barrier((grad, stored)))
  new_stored = _new_trits(m, new_scales, seed, layout=layout, index_offset=index_offset)
  return direction, new_stored, nu


def _step_xla(
    grad: jax.Array,
    stored: jax.Array,
    scales: jax.Array,
    new_scales: jax.Array,
    nu: jax.Array,
    seed: jax.Array,
    hyper: jax.Array,
    *,
    block_size: int,
    layout: Any,
    update_nu: bool,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The step of a tensor: ``grad`` and ``nu`` of its shape, the moment block-major."""
  blocks = stored.shape[:-1]
  nu = nu.astype(jnp.float32)
  if grad.ndim and grad.shape[-1] % block_size == 0:
    # Blocks tile the last axis: the blocks' view is a reshape of it, and
    # XLA computes the direction in the blocks' view or in the tensor's
    # shape (fused into the parameters' update) alike.
    direction, new_stored, new_nu = _step_blocks(
        ternary_blocks.to_blocks(grad, blocks, block_size),
        stored,
        scales,
        new_scales,
        ternary_blocks.to_blocks(nu, blocks, block_size),
        seed,
        hyper,
        layout=layout,
        update_nu=update_nu,
    )
    return (
        ternary_blocks.from_blocks(direction, grad.shape),
        new_stored,
        ternary_blocks.from_blocks(new_nu, nu.shape) if update_nu else None,
    )
  # The flat layout: an array of the tensor's shape read in the blocks'
  # view, or the other way round, is indexed per element through its flat
  # index, in code XLA:CPU does not vectorize. The stored
  # moment is written out in the blocks' view, then read in the tensor's
  # shape for the direction (``nu`` stays there: the outer product of
  # factored statistics' roots is a plain broadcast) and in the blocks' for
  # the new trits.
  previous = ternary_blocks.stored_moment(stored, scales, block_size, layout)
  new_nu, root_of_nu_hat = _second_moment_and_root(nu, grad, hyper, update_nu=update_nu)
  m = _first_moment(ternary_blocks.from_blocks(previous, grad.shape), grad.astype(jnp.float32), hyper[_B1])
  direction = _direction(
      m, root_of_nu_hat, hyper[_BIAS_CORRECTION_1], hyper[_EPS]
  ).astype(grad.dtype)
  grad_blocks = ternary_blocks.to_blocks(grad, blocks, block_size).astype(jnp.float32)
  new_stored = _new_trits(
      _first_moment(previous, grad_blocks, hyper[_B1]), new_scales, seed,
      layout=layout, index_offset=0,
  )
  return direction, new_stored, new_nu if update_nu else None


# Mosaic GPU kernel.


def _step_kernel(
    *refs,
    geometry: Any,
    layout: Any,
    chunks_per_step: int,
    update_nu: bool,
    interpret: bool,
) -> None:
  """Per packed row of each chunk: the moment, ``nu``, the direction and the new trits."""
  if update_nu:
    (grad_ref, stored_ref, scales_ref, new_scales_ref, nu_ref, seed_ref, hyper_ref,
     direction_ref, new_stored_ref, new_nu_ref) = refs
  else:
    (grad_ref, stored_ref, scales_ref, new_scales_ref, nu_ref, seed_ref, hyper_ref,
     direction_ref, new_stored_ref) = refs
  b1, b2, eps = hyper_ref[_B1], hyper_ref[_B2], hyper_ref[_EPS]
  bias_correction_1 = hyper_ref[_BIAS_CORRECTION_1]
  bias_correction_2 = hyper_ref[_BIAS_CORRECTION_2]
  inverse_root_bias_correction_2 = hyper_ref[_INVERSE_ROOT_BIAS_CORRECTION_2]
  seed = seed_ref[0]
  lane = chunks.lane_indices(interpret)
  first_chunk = lax.axis_index("steps") * chunks_per_step
  bytes_per_chunk = geometry.chunk // layout.planes

  def step_chunk(i):
    chunk = first_chunk + i
    start = chunk * geometry.chunk
    first_block = chunk * geometry.blocks_per_chunk
    old_scales = [scales_ref[first_block + k] for k in range(geometry.blocks_per_chunk)]
    new_scales = [new_scales_ref[first_block + k] for k in range(geometry.blocks_per_chunk)]

    def stored_codes(row):
      byte = chunk * bytes_per_chunk + row * PLANE_WIDTH
      return planar.split_planes(chunks.load_slice(stored_ref, byte), layout.base, layout.planes)

    def load_grad(offset):
      return chunks.load_slice(grad_ref, start + offset).astype(jnp.float32)

    def moment(offset, codes, grad):
      scale = chunks.slice_scale(old_scales, offset, lane, geometry)
      return _first_moment(ternary.dequantize_codes(codes, scale), grad, b1)

    def step_row(row):
      codes = stored_codes(row)
      new_codes = []
      for plane in range(layout.planes):
        offset = row * geometry.row + plane * PLANE_WIDTH
        grad = load_grad(offset)
        m = moment(offset, codes[plane], grad)
        nu = chunks.load_slice(nu_ref, start + offset)
        if update_nu:
          nu = _second_moment(nu, grad, b2)
          new_nu_ref[pl.ds(start + offset, PLANE_WIDTH)] = nu
          root_of_nu_hat = _kernel_sqrt(nu / bias_correction_2)
        else:
          root_of_nu_hat = nu * inverse_root_bias_correction_2
        direction = _direction(m, root_of_nu_hat, bias_correction_1, eps)
        direction_ref[pl.ds(start + offset, PLANE_WIDTH)] = direction.astype(direction_ref.dtype)
        bits = ternary.counter_hash_bits(seed, (start + offset).astype(jnp.uint32) + lane)
        scale = chunks.slice_scale(new_scales, offset, lane, geometry)
        new_codes.append(ternary.ternary_codes(m, scale, bits))
      byte = chunk * bytes_per_chunk + row * PLANE_WIDTH
      new_stored_ref[pl.ds(byte, PLANE_WIDTH)] = planar.combine_planes(new_codes, layout.base)

    chunks.for_each_index(geometry.rows_per_chunk, step_row)

  chunks.for_each_index(chunks_per_step, step_chunk)


def _step_pallas(
    grad: jax.Array,
    stored: jax.Array,
    scales: jax.Array,
    new_scales: jax.Array,
    nu: jax.Array,
    seed: jax.Array,
    hyper: jax.Array,
    *,
    block_size: int,
    layout: Any,
    update_nu: bool,
    interpret: bool,
    chunks_per_step: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The kernel on whole grid steps of chunks, the reference on the rest.

  Arguments and results as ``_step_xla``'s; the kernel's part of the
  moment goes through the flat layout (see the module docstring).
  """
  size = grad.size
  geometry = chunks.ChunkGeometry(block_size, layout.planes)
  steps, chunks_per_step = chunks.grid_extent(size, geometry, chunks_per_step)
  if steps == 0:
    return _step_xla(
        grad, stored, scales, new_scales, nu, seed, hyper,
        block_size=block_size, layout=layout, update_nu=update_nu,
    )
  done = steps * chunks_per_step * geometry.chunk
  done_blocks = done // block_size
  flat_grad = grad.reshape(-1)
  if flat_grad.dtype not in _KERNEL_GRAD_DTYPES:
    flat_grad = flat_grad.astype(jnp.float32)
  flat_nu = nu.reshape(-1).astype(jnp.float32)
  block_bytes = stored.reshape(-1, stored.shape[-1])
  flat_scales = scales.reshape(-1)
  flat_new_scales = new_scales.reshape(-1)
  # The kernel's part of the moment in the flat layout (whole packed rows).
  flat_stored = ternary_blocks.flat_bytes(block_bytes[:done_blocks], done, block_size, layout)
  out_type = [
      jax.ShapeDtypeStruct((size,), grad.dtype),
      jax.ShapeDtypeStruct(flat_stored.shape, jnp.uint8),
  ]
  if update_nu:
    out_type.append(jax.ShapeDtypeStruct((size,), jnp.float32))
  kernel = _backend.mosaic_gpu_kernel(
      functools.partial(
          _step_kernel,
          geometry=geometry,
          layout=layout,
          chunks_per_step=chunks_per_step,
          update_nu=update_nu,
          interpret=interpret,
      ),
      out_type=tuple(out_type),
      grid=(steps,),
      grid_names=("steps",),
      interpret=interpret,
  )
  direction, new_flat_stored, *new_nu = kernel(
      flat_grad, flat_stored, flat_scales, flat_new_scales, flat_nu, seed.reshape(1), hyper
  )
  new_block_bytes = ternary_blocks.block_bytes(new_flat_stored, done, (done_blocks,), block_size, layout)
  new_nu = new_nu[0] if update_nu else None
  if done < size:
    # Chunk boundaries are block boundaries: the tail is whole blocks, the
    # last one maybe padded, written in place into the kernel's outputs (its
    # bytes, which the kernel does not produce, appended).
    tail_blocks = block_bytes.shape[0] - done_blocks
    tail = _step_blocks(
        ternary_blocks.to_blocks(flat_grad[done:], (tail_blocks,), block_size),
        block_bytes[done_blocks:],
        flat_scales[done_blocks:, None],
        flat_new_scales[done_blocks:, None],
        ternary_blocks.to_blocks(flat_nu[done:], (tail_blocks,), block_size),
        seed,
        hyper,
        layout=layout,
        update_nu=update_nu,
        index_offset=done,
    )
    tail_direction, tail_stored, tail_nu = tail
    direction = lax.dynamic_update_slice(
        direction, tail_direction.reshape(-1)[: size - done], (done,)
    )
    new_block_bytes = jnp.concatenate([new_block_bytes, tail_stored])
    if update_nu:
      new_nu = lax.dynamic_update_slice(new_nu, tail_nu.reshape(-1)[: size - done], (done,))
  return (
      direction.reshape(grad.shape),
      new_block_bytes.reshape(stored.shape),
      new_nu.reshape(nu.shape) if update_nu else None,
  )


# Entry point.


@functools.partial(
    jax.jit, static_argnames=("block_size", "layout", "update_nu", "implementation")
)
def _step(
    grad, stored, scales, nu, seed, count, b1, b2, eps,
    *, block_size: int, layout: Any, update_nu: bool, implementation: str,
):
  hyper = _hyperparameters(count, b1, b2, eps)
  # One computation of the new scales for both implementations: the kernel
  # reads them rather than finding them itself.
  new_scales = _scale_bound(ternary_blocks.to_blocks(grad, stored.shape[:-1], block_size), scales, hyper[_B1])
  args = (grad, stored, scales, new_scales, nu.reshape(grad.shape), seed, hyper)
  options = dict(block_size=block_size, layout=layout, update_nu=update_nu)
  if implementation == "xla":
    direction, new_stored, new_nu = _step_xla(*args, **options)
  else:
    direction, new_stored, new_nu = _step_pallas(
        *args, **options, interpret=implementation == "interpret"
    )
  return TernaryAdamStep(
      direction,
      ternary.TernaryArray(new_stored, new_scales),
      new_nu.reshape(nu.shape) if update_nu else None,
  )


def _check_rate(name: str, value: Any) -> None:
  if isinstance(value, (int, float)) and not 0 <= value < 1:
    raise ValueError(f"{name} must be in [0, 1); got {value}.")


def ternary_adam_update(
    grad: jax.typing.ArrayLike,
    momentum: ternary.TernaryArray,
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
    implementation: dispatch.Implementation = None,
) -> TernaryAdamStep:
  """One Adam step of a tensor whose first moment is stored as trits.

  .. math::
    m = \\beta_1 \\hat m + (1 - \\beta_1) g, \\quad
    \\nu' = \\beta_2 \\nu + (1 - \\beta_2) g^2, \\quad
    u = \\frac{m / (1 - \\beta_1^k)}{\\sqrt{\\nu' / (1 - \\beta_2^k)} + \\epsilon},
    \\quad \\hat m' = s' \\cdot \\mathrm{round}_\\xi(m / s'), \\quad
    s' = \\beta_1 s + (1 - \\beta_1) \\max_\\text{block} |g|

  where ``\\hat m`` is the decoded ``momentum`` with block scales ``s``, ``k``
  is ``count`` and ``round_xi`` unbiased stochastic rounding to ``{-1, 0, 1}``
  with the random bits of ``counter_hash_bits(seed, index)``, those of
  ``ternary_encode(..., key=key)`` for ``seed = ternary.seed_from_key(key)``.

  The second moment comes in one of two ways. ``nu``: last step's, updated
  here with ``g**2`` and returned. ``nu_root``: the square root of this
  step's ``nu'``, used as it is and not returned; a caller that factors
  ``nu'`` (the outer product of row and column statistics) passes the outer
  product of their roots, and the step takes no square root per element.

  Args:
    grad: the gradient, a floating array of any shape.
    momentum: the stored first moment of ``grad``, a ``TernaryArray`` in
      the block-major layout of ``ternary_blocks.shapes(grad.shape, ...)`` (from
      ``ternary_blocks.zeros`` or a previous step).
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
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    A ``TernaryAdamStep``: the direction ``u`` (the gradient's shape and
    dtype), the new block-major ``TernaryArray`` and the new ``nu``
    (``None`` when ``nu_root`` was given).

  Raises:
    ValueError: naming the argument that is missing, of the wrong shape or
      dtype, or out of range.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_kernels import ternary_blocks
    >>> from pallas_kernels.ternary_adam_update import ternary_adam_update
    >>> grad = jnp.linspace(-1.0, 1.0, 1024).reshape(4, 256)
    >>> momentum = ternary_blocks.zeros(grad.shape, block_size=128)
    >>> step = ternary_adam_update(
    ...     grad, momentum, jnp.zeros_like(grad), seed=jnp.uint32(7), count=1,
    ...     b1=0.9, b2=0.999, eps=1e-8, block_size=128)
    >>> bool(jnp.allclose(step.direction, jnp.sign(grad), atol=1e-4))
    True
    >>> step.momentum.packed.shape, step.momentum.scales.shape
    ((4, 2, 26), (4, 2, 1))

  References:
    Kingma and Ba, "Adam: A Method for Stochastic Optimization", 2015
    (https://arxiv.org/abs/1412.6980).
  """
  grad = jnp.asarray(grad)
  if not jnp.issubdtype(grad.dtype, jnp.floating):
    raise ValueError(f"grad must have a floating dtype; got {grad.dtype}.")
  ternary.check_block_size(block_size)
  layout = ternary.packing_layout(packing)
  if not isinstance(momentum, ternary.TernaryArray):
    raise ValueError(f"momentum must be a TernaryArray; got {type(momentum).__name__}.")
  stored, scales = (jnp.asarray(a) for a in momentum)
  for name, actual, expected in zip(
      ("packed", "scales"),
      (stored, scales),
      ternary_blocks.shapes(grad.shape, block_size=block_size, packing=packing),
  ):
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
      raise ValueError(
          f"momentum.{name} must be {expected.dtype}{list(expected.shape)} for a"
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
  _check_rate("b1", b1)
  _check_rate("b2", b2)
  if isinstance(eps, (int, float)) and not eps >= 0:
    raise ValueError(f"eps must be >= 0; got {eps}.")
  return dispatch.run(
      "ternary_adam_update",
      implementation,
      lambda resolved: _step(
          grad, stored, scales, second_moment, seed, count, b1, b2, eps,
          block_size=block_size, layout=layout, update_nu=nu is not None,
          implementation=resolved,
      ),
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """The fused step for both packings, both ways of passing ``nu``, and a long bf16 gradient."""

  def example(name, shape, grad_dtype, block_size, packing, update_nu):
    grad = jax.ShapeDtypeStruct(shape, grad_dtype)
    momentum = ternary_blocks.shapes(shape, block_size=block_size, packing=packing)
    second_moment = jax.ShapeDtypeStruct(shape, jnp.float32)

    def fn(grad, momentum, second_moment):
      return ternary_adam_update(
          grad, momentum, **{"nu" if update_nu else "nu_root": second_moment},
          seed=jnp.uint32(7), count=3, b1=0.9, b2=0.999, eps=1e-8,
          block_size=block_size, packing=packing, implementation="pallas",
      )

    return _backend.LoweringExample(
        name, _backend.MOSAIC_GPU_CALL, fn, (grad, momentum, second_moment)
    )

  size = (2 * 1280 + 100,)  # Whole chunks and a tail for both packings.
  return [
      example("ternary_adam_update_base3_128", size, jnp.float32, 128, "base3", True),
      # Blocks tiling the last axis of a matrix: block-major moment.
      example("ternary_adam_update_base3_256_nu_root", (20, 768), jnp.float32, 256, "base3", False),
      example("ternary_adam_update_2bit_64", size, jnp.float32, 64, "2bit", True),
      # Blocks over 8 packed rows: loops over rows and over a block's slices.
      example("ternary_adam_update_base3_1024", (6400 + 10,), jnp.float32, 1024, "base3", True),
      # Several chunks per grid step.
      example(
          "ternary_adam_update_base3_64_long_bfloat16", (2**24 + 3,), jnp.bfloat16, 64, "base3", False
      ),
  ]
