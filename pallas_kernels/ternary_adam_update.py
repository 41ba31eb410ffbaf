"""One fused step of ternary-state Adam for one tensor.

The first moment is stored as blockwise-scaled trits in the *block-major*
layout of this module (:func:`momentum_shapes`); the second moment ``nu`` is a
float32 array with one entry per element. One step reads the gradient ``g``,
the stored trits ``t`` with their block scales ``s`` and ``nu``, and computes

.. math::
  m = \\beta_1\\, t\\, s + (1 - \\beta_1)\\, g, \\qquad
  \\nu' = \\beta_2\\, \\nu + (1 - \\beta_2)\\, g^2, \\qquad
  u = \\frac{m / (1 - \\beta_1^k)}{\\sqrt{\\nu' / (1 - \\beta_2^k)} + \\epsilon},

then stores ``m`` again as trits with stochastic rounding,
``P(t = \\operatorname{sign} m) = |m| / s'`` (unbiased), under new block
scales

.. math::
  s' = \\beta_1\\, s + (1 - \\beta_1) \\max_{\\text{block}} |g|,

a bound on ``|m|`` (``|t s| <= s``) known before ``m`` is: the step needs no
pass over the new moment to find its block maxima before coding it. The
random bits are the counter hash of a uint32 seed and of the element's index
in the flattened tensor, those of ``ternary_encode(m, key=key)`` for the seed
``ternary.seed_from_key(key)``. On the library's training task the bound
trains as well as the exact absmax (validation losses over three seeds in the
docstring of ``optax_memopt.ternary_adam``) and saves a pass over every
tensor. The direction ``u`` uses the unrounded ``m`` of this step; only the
stored moment is rounded. Instead of ``nu`` the caller may pass ``nu_root``,
the square root of this step's second moment (for instance the outer product
of the roots of factored row and column statistics, which need reductions
over whole rows and columns): it is not updated or returned, and the step
takes no square root per element.

Block-major layout. Scale blocks are ``block_size`` consecutive elements of
the flattened tensor, as in :mod:`pallas_kernels.ternary`. When they tile the
last axis (``shape[-1] % block_size == 0``) the moment of a tensor of shape
``(..., n)`` is stored as ``packed`` uint8 of shape
``(..., n // block_size, bytes_per_block)`` and ``scales`` float32 of shape
``(..., n // block_size, 1)``: every axis of the tensor keeps its place (the
last one counts blocks), so a sharding of the tensor is a sharding of its
moment, and no byte holds trits of two blocks. Other tensors use
``(ceil(size / block_size), bytes_per_block)`` and ``(..., 1)``, the last
block zero padded. Within a block, the planar layout of
:mod:`pallas_kernels.packing` with one row of ``w = bytes_per_block =
ceil(block_size / planes)`` bytes: byte ``j`` holds the codes ``t + 1`` of
elements ``j, j + w, ...`` (5 per byte in base 3, 4 in ``"2bit"``); slots
past the block's end hold code 1 (a zero trit). Base 3 takes 7, 13, 26 and 52
bytes for blocks of 32, 64, 128 and 256 elements (1.75, 1.625, 1.625 and
1.625 bits per element); ``"2bit"`` exactly 2 bits.

The kernel takes the square root as ``x * rsqrt(x)`` (and 0 at ``x = 0``):
Mosaic GPU on JAX 0.10 lowers ``rsqrt`` but not ``sqrt``. The reference
takes ``jnp.sqrt``, faster on CPUs, so the two directions agree to float32
rounding (a few ulps); the trits, scales and ``nu`` agree bit for bit.

Implementations (``implementation=``):

* ``"xla"``: the reference, on the block-major arrays directly.
* ``"pallas"``: one Mosaic GPU kernel (``plgpu.kernel``) over chunks of whole
  scale blocks and whole packed rows of the flat layout of
  :mod:`pallas_kernels.ternary` (rows of ``planes * 128`` elements, byte ``j``
  holding elements ``j, j + 128, ...``). Its loads are 128-lane slices, and a
  block of 128 elements packs into 26 bytes, so it cannot read the
  block-major bytes in place: XLA converts the moment's bytes to the flat
  layout before the kernel and back after it. On an H200 (JAX 0.11, 40M
  parameter model) the optimizer step took 4.2 ms this way and 3.3 ms with
  ``"xla"``, against 1.2 ms for ``optax.adamw`` (then with a first pass per
  chunk for the exact block absmax of the new moment, since replaced by the
  scale bound). The new scales are computed once, in XLA, for both
  implementations; per packed row the kernel computes the moment, updates
  ``nu``, writes the direction and packs the new trits. The last partial
  chunk (and chunks that do not fill a grid step) run in the reference and
  are written in place, so the result equals ``"xla"`` bit for bit.
* ``"interpret"``: the same kernel run by the Mosaic GPU interpreter (CPU).
* ``None``: ``"xla"`` everywhere, as long as the kernel with its layout
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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels import dispatch
from pallas_kernels import packing as planar
from pallas_kernels import ternary

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


# Block-major layout.


def _blocked_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  """The moment's shape without its last axis: the tensor's, in blocks."""
  if shape and shape[-1] % block_size == 0:
    return (*shape[:-1], shape[-1] // block_size)
  return (-(-math.prod(shape) // block_size),)


def _bytes_per_block(block_size: int, layout: Any) -> int:
  return -(-block_size // layout.planes)


def momentum_shapes(
    shape: tuple[int, ...], *, block_size: int, packing: str = "base3"
) -> ternary.TernaryArray:
  """The ``jax.ShapeDtypeStruct`` of ``packed`` and ``scales`` of a tensor's moment.

  Args:
    shape: the tensor's shape.
    block_size: elements per scale block: 32, 64 or a multiple of 128.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).

  Returns:
    A ``TernaryArray`` of ``ShapeDtypeStruct``: uint8 ``(*blocks,
    ceil(block_size / trits_per_byte))`` and float32 ``(*blocks, 1)``, with
    ``blocks = (*shape[:-1], shape[-1] // block_size)`` when ``block_size``
    divides the last axis and ``(ceil(size / block_size),)`` otherwise.

  Examples:
    >>> from pallas_kernels.ternary_adam_update import momentum_shapes
    >>> [a.shape for a in momentum_shapes((64, 256), block_size=128)]
    [(64, 2, 26), (64, 2, 1)]
    >>> [a.shape for a in momentum_shapes((100, 30), block_size=128, packing="2bit")]
    [(24, 32), (24, 1)]
  """
  ternary.check_block_size(block_size)
  layout = ternary.packing_layout(packing)
  blocks = _blocked_shape(tuple(shape), block_size)
  return ternary.TernaryArray(
      jax.ShapeDtypeStruct((*blocks, _bytes_per_block(block_size, layout)), jnp.uint8),
      jax.ShapeDtypeStruct((*blocks, 1), jnp.float32),
  )


def zero_momentum(
    shape: tuple[int, ...], *, block_size: int, packing: str = "base3"
) -> ternary.TernaryArray:
  """A first moment of zeros (zero trits, zero scales) for a tensor of ``shape``."""
  layout = ternary.packing_layout(packing)
  packed, scales = momentum_shapes(shape, block_size=block_size, packing=packing)
  # Every plane holds code 1: the byte sum(base**p).
  zero_trits = sum(layout.base**p for p in range(layout.planes))
  return ternary.TernaryArray(
      jnp.full(packed.shape, zero_trits, jnp.uint8), jnp.zeros(scales.shape, jnp.float32)
  )


def _to_blocks(x: jax.Array, blocks: tuple[int, ...], block_size: int, fill=0) -> jax.Array:
  """``x`` as ``(*blocks, block_size)``: a reshape, after padding with ``fill`` if needed."""
  padding = math.prod(blocks) * block_size - x.size
  if padding:
    x = jnp.pad(x.reshape(-1), (0, padding), constant_values=fill)
  return x.reshape(*blocks, block_size)


def _from_blocks(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  size = math.prod(shape)
  if x.size != size:
    x = x.reshape(-1)[:size]
  return x.reshape(shape)


# Codes per row of the padded view _pack_blocks writes out; every block size
# (32, 64 or a multiple of 128) is whole rows, and one more row covers the
# at most planes - 1 slots past a block's end.
_PACKING_ROW = 16


def _pack_blocks(codes: jax.Array, layout: Any) -> jax.Array:
  """Codes ``(..., block_size)`` in ``[0, base)`` to bytes ``(..., bytes_per_block)``.

  Byte ``j`` is ``sum_p base**p code[j + p w]`` (``packing.combine_planes``
  of the plane slices), code 1 (a zero trit) in the slots past the block's
  end.

  XLA:CPU fuses elementwise producers into every user, so summing plane
  slices of the codes directly would compute each code inside loops over
  rows of ``w`` bytes (26 for blocks of 128), which do not vectorize; an
  int8 matrix product by the place values, the earlier way, cost as much
  as computing the codes. Viewed as rows of 16 codes and padded with one
  more row of code 1 (which covers the slots past the block's end), the
  codes are instead written out once by a fusion vectorized along the rows
  (XLA:CPU does not fuse that padded view into the sums), and the sums read
  whole bytes. On the CPU the step of the 10M (40M) parameter benchmark
  went from 1.9x (2.2x) to 1.5x (1.9x) AdamW's time. Wider rows vectorize
  no better and add temporary memory, which costs page faults once a
  step's temporary buffer exceeds 32 MiB: glibc then maps it afresh at
  every call (``benchmarks/README.md``).
  """
  block_size = codes.shape[-1]
  width = _bytes_per_block(block_size, layout)
  blocks = codes.shape[:-1]
  rows = codes.astype(jnp.uint8).reshape(*blocks, block_size // _PACKING_ROW, _PACKING_ROW)
  slots = jnp.pad(rows, [(0, 0)] * len(blocks) + [(0, 1), (0, 0)], constant_values=1)
  slots = slots.reshape(*blocks, block_size + _PACKING_ROW)
  return planar.combine_planes(
      [slots[..., p * width : (p + 1) * width] for p in range(layout.planes)], layout.base
  )


# The largest row of blocks whose place values _unpack_blocks tiles (a
# constant of 256 KiB).
_MAX_TILED_PLACES = 65536


def _digits(byte: jax.Array, place: Any, base: int) -> jax.Array:
  """Digit ``p`` in base ``base`` of uint8 bytes, given ``place = base**p``, as float32.

  By multiplies and shifts of uint32, which XLA:CPU vectorizes where it does
  not vectorize integer division: the quotient ``q = floor(byte / base**p)``
  is ``(byte ceil(2**16 / base**p)) >> 16`` and ``floor(q / base)`` is
  ``(q ceil(2**17 / base)) >> 17``, both exact for bytes below 256 (the
  tests check every byte and place). On one core this made ternary Adam's
  step 4-7% faster than a float formula with two floors.
  """
  place = np.asarray(place, np.int64)
  quotient = (byte.astype(jnp.uint32) * (-(-(2**16) // place)).astype(np.uint32)) >> 16
  whole = (quotient * np.uint32(-(-(2**17) // base))) >> 17
  return (quotient - whole * np.uint32(base)).astype(jnp.float32)


def _unpack_blocks(packed: jax.Array, block_size: int, layout: Any) -> jax.Array:
  """Inverse of ``_pack_blocks``: the codes ``(..., block_size)``, as float32.

  Each element reads its byte (the block's bytes repeated once per plane,
  one byte per element, which XLA may write out cheaply) and takes its digit
  (``_digits``).
  """
  width = packed.shape[-1]
  last_plane = block_size - (layout.planes - 1) * width
  byte = jnp.concatenate([packed] * (layout.planes - 1) + [packed[..., :last_plane]], axis=-1)
  place = layout.base ** (np.arange(block_size) // width)
  if packed.ndim >= 2 and packed.shape[-2] * block_size <= _MAX_TILED_PLACES:
    # One place value per element of a whole row of blocks: when the codes
    # are used in the tensor's own shape (..., n), XLA:CPU then reads the
    # constant in step with the elements and vectorizes the loop, which it
    # does not with an index modulo block_size.
    place = np.tile(place, (packed.shape[-2], 1))
  return _digits(byte, place, layout.base)


def _stored_moment(
    packed: jax.Array, scales: jax.Array, block_size: int, layout: Any
) -> jax.Array:
  """The stored moment ``t s`` of blocks ``(..., block_size)``, written out.

  Decoded plane by plane from the bytes (plane ``p`` holds elements
  ``p w, ..., p w + w - 1`` of each block), then concatenated: XLA:CPU writes
  a concatenation out instead of fusing it into its consumers, so the
  moment can be read in another shape than the blocks' without index
  arithmetic per element.
  """
  width = packed.shape[-1]
  planes = [
      (_digits(packed, layout.base**plane, layout.base) - 1) * scales
      for plane in range(layout.planes)
  ]
  planes[-1] = planes[-1][..., : block_size - (layout.planes - 1) * width]
  return jnp.concatenate(planes, axis=-1)


def _flat_bytes(block_bytes: jax.Array, size: int, block_size: int, layout: Any) -> jax.Array:
  """Block-major bytes ``(..., bytes_per_block)`` as the flat planar bytes of their first ``size`` trits."""
  codes = _unpack_blocks(block_bytes, block_size, layout).reshape(-1)[:size].astype(jnp.uint32)
  return planar.pack(codes, base=layout.base, planes=layout.planes)


def _block_bytes(
    flat_bytes: jax.Array, size: int, blocks: tuple[int, ...], block_size: int, layout: Any
) -> jax.Array:
  """Inverse of ``_flat_bytes``: the flat bytes of ``size`` trits as ``(*blocks, bytes_per_block)``."""
  codes = planar.unpack(flat_bytes, size, base=layout.base, planes=layout.planes)
  return _pack_blocks(_to_blocks(codes.astype(jnp.uint32), blocks, block_size, fill=1), layout)


def to_flat(
    momentum: ternary.TernaryArray, *, size: int, block_size: int, packing: str = "base3"
) -> ternary.TernaryArray:
  """The moment of ``size`` elements in the flat layout of ``ternary_encode``.

  ``ternary_decode(to_flat(t, ...), ...)`` is the moment as a flat array.
  """
  layout = ternary.packing_layout(packing)
  return ternary.TernaryArray(
      _flat_bytes(momentum.packed, size, block_size, layout), momentum.scales.reshape(-1)
  )


def from_flat(
    t: ternary.TernaryArray, shape: tuple[int, ...], *, block_size: int, packing: str = "base3"
) -> ternary.TernaryArray:
  """Inverse of ``to_flat``: ``ternary_encode``'s output in the block-major layout of ``shape``.

  ``from_flat(ternary_encode(m, block_size=b), m.shape, block_size=b)`` is
  ``m`` encoded with absmax scales, in the layout the step reads.
  """
  layout = ternary.packing_layout(packing)
  shape = tuple(shape)
  blocks = _blocked_shape(shape, block_size)
  return ternary.TernaryArray(
      _block_bytes(t.packed, math.prod(shape), blocks, block_size, layout),
      t.scales.reshape(*blocks, 1),
  )


# XLA reference.


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
  # jnp.sqrt, not the kernel's x * rsqrt(x): XLA:CPU vectorizes it (7% of
  # the step at 40M parameters); the directions differ by float32 rounding.
  return nu, jnp.sqrt(nu / hyper[_BIAS_CORRECTION_2])


def _new_trits(
    m: jax.Array, new_scales: jax.Array, seed: jax.Array, *, layout: Any, index_offset: int
) -> jax.Array:
  """The bytes of ``m`` ``(..., block_size)`` rounded stochastically to trits of ``new_scales``."""
  bits = ternary.counter_hash_bits(seed, _element_indices(m.shape, index_offset))
  return _pack_blocks(ternary.ternary_codes(m, new_scales, bits), layout)


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
    previous = (_unpack_blocks(stored, block_size, layout) - 1) * scales
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


def _step_reference(
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
        _to_blocks(grad, blocks, block_size),
        stored,
        scales,
        new_scales,
        _to_blocks(nu, blocks, block_size),
        seed,
        hyper,
        layout=layout,
        update_nu=update_nu,
    )
    return (
        _from_blocks(direction, grad.shape),
        new_stored,
        _from_blocks(new_nu, nu.shape) if update_nu else None,
    )
  # The flat layout: an array of the tensor's shape read in the blocks'
  # view, or the other way round, is indexed per element through its flat
  # index, in code XLA:CPU does not vectorize (the direction of a 640 x 320
  # matrix took 5x the time per element of the tiled layout's). The stored
  # moment is written out in the blocks' view, then read in the tensor's
  # shape for the direction (``nu`` stays there: the outer product of
  # factored statistics' roots is a plain broadcast) and in the blocks' for
  # the new trits.
  previous = _stored_moment(stored, scales, block_size, layout)
  new_nu, root_of_nu_hat = _second_moment_and_root(nu, grad, hyper, update_nu=update_nu)
  m = _first_moment(_from_blocks(previous, grad.shape), grad.astype(jnp.float32), hyper[_B1])
  direction = _direction(
      m, root_of_nu_hat, hyper[_BIAS_CORRECTION_1], hyper[_EPS]
  ).astype(grad.dtype)
  grad_blocks = _to_blocks(grad, blocks, block_size).astype(jnp.float32)
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
  lane = ternary.lane_indices(interpret)
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
      return planar.split_planes(ternary.load_slice(stored_ref, byte), layout.base, layout.planes)

    def load_grad(offset):
      return ternary.load_slice(grad_ref, start + offset).astype(jnp.float32)

    def moment(offset, codes, grad):
      scale = ternary.slice_scale(old_scales, offset, lane, geometry)
      return _first_moment(ternary.dequantize_codes(codes, scale), grad, b1)

    def step_row(row):
      codes = stored_codes(row)
      new_codes = []
      for plane in range(layout.planes):
        offset = row * geometry.row + plane * PLANE_WIDTH
        grad = load_grad(offset)
        m = moment(offset, codes[plane], grad)
        nu = ternary.load_slice(nu_ref, start + offset)
        if update_nu:
          nu = _second_moment(nu, grad, b2)
          new_nu_ref[pl.ds(start + offset, PLANE_WIDTH)] = nu
          root_of_nu_hat = _kernel_sqrt(nu / bias_correction_2)
        else:
          root_of_nu_hat = nu * inverse_root_bias_correction_2
        direction = _direction(m, root_of_nu_hat, bias_correction_1, eps)
        direction_ref[pl.ds(start + offset, PLANE_WIDTH)] = direction.astype(direction_ref.dtype)
        bits = ternary.counter_hash_bits(seed, (start + offset).astype(jnp.uint32) + lane)
        scale = ternary.slice_scale(new_scales, offset, lane, geometry)
        new_codes.append(ternary.ternary_codes(m, scale, bits))
      byte = chunk * bytes_per_chunk + row * PLANE_WIDTH
      new_stored_ref[pl.ds(byte, PLANE_WIDTH)] = planar.combine_planes(new_codes, layout.base)

    ternary.for_each_index(geometry.rows_per_chunk, step_row)

  ternary.for_each_index(chunks_per_step, step_chunk)


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

  Arguments and results as ``_step_reference``'s; the kernel's part of the
  moment goes through the flat layout (see the module docstring).
  """
  size = grad.size
  geometry = ternary.ChunkGeometry(block_size, layout.planes)
  steps, chunks_per_step = ternary.grid_extent(size, geometry, chunks_per_step)
  if steps == 0:
    return _step_reference(
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
  flat_stored = _flat_bytes(block_bytes[:done_blocks], done, block_size, layout)
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
  new_block_bytes = _block_bytes(new_flat_stored, done, (done_blocks,), block_size, layout)
  new_nu = new_nu[0] if update_nu else None
  if done < size:
    # Chunk boundaries are block boundaries: the tail is whole blocks, the
    # last one maybe padded, written in place into the kernel's outputs (its
    # bytes, which the kernel does not produce, appended).
    tail_blocks = block_bytes.shape[0] - done_blocks
    tail = _step_blocks(
        _to_blocks(flat_grad[done:], (tail_blocks,), block_size),
        block_bytes[done_blocks:],
        flat_scales[done_blocks:, None],
        flat_new_scales[done_blocks:, None],
        _to_blocks(flat_nu[done:], (tail_blocks,), block_size),
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
  new_scales = _scale_bound(_to_blocks(grad, stored.shape[:-1], block_size), scales, hyper[_B1])
  args = (grad, stored, scales, new_scales, nu.reshape(grad.shape), seed, hyper)
  options = dict(block_size=block_size, layout=layout, update_nu=update_nu)
  if implementation == "xla":
    direction, new_stored, new_nu = _step_reference(*args, **options)
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
      the block-major layout of ``momentum_shapes(grad.shape, ...)`` (from
      ``zero_momentum``, ``from_flat`` or a previous step).
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
    >>> from pallas_kernels.ternary_adam_update import ternary_adam_update, zero_momentum
    >>> grad = jnp.linspace(-1.0, 1.0, 1024).reshape(4, 256)
    >>> momentum = zero_momentum(grad.shape, block_size=128)
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
      momentum_shapes(grad.shape, block_size=block_size, packing=packing),
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
  implementation = dispatch.resolve("ternary_adam_update", implementation)
  return _step(
      grad, stored, scales, second_moment, seed, count, b1, b2, eps,
      block_size=block_size, layout=layout, update_nu=nu is not None,
      implementation=implementation,
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """The fused step for both packings, both ways of passing ``nu``, and a long bf16 gradient."""

  def example(name, shape, grad_dtype, block_size, packing, update_nu):
    grad = jax.ShapeDtypeStruct(shape, grad_dtype)
    momentum = momentum_shapes(shape, block_size=block_size, packing=packing)
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
