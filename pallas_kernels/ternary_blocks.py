r"""Block-major trits: the byte layout of ternary Adam's first moment.

Scale blocks are ``block_size`` consecutive elements of the flattened tensor,
as in :mod:`pallas_kernels.ternary`. When they tile the last axis
(``shape[-1] % block_size == 0``) the moment of a tensor of shape ``(..., n)``
is stored as ``packed`` uint8 of shape ``(..., n // block_size, w)`` and
``scales`` float32 of shape ``(..., n // block_size, 1)``: every axis of the
tensor keeps its place (the last one counts blocks), so a sharding of the
tensor is a sharding of its moment, and no byte holds trits of two blocks.
Other tensors use ``(ceil(size / block_size), w)`` and ``(..., 1)``, the last
block zero padded.

Within a block, the planar layout of :mod:`pallas_kernels.packing` with one
row of ``w = ceil(block_size / planes)`` bytes:

.. math::
  \text{byte}_j = \sum_{p=0}^{\text{planes}-1} \text{base}^p \, (t_{j + p w} + 1)

(5 planes of base 3, or 4 of base 4 for ``"2bit"``); slots past the block's
end hold code 1 (a zero trit). Base 3 takes 7, 13, 26 and 52 bytes for blocks
of 32, 64, 128 and 256 elements (1.75, 1.625, 1.625 and 1.625 bits per
element); ``"2bit"`` exactly 2 bits.

The functions here are the XLA code that packs and unpacks these bytes,
written so that XLA:CPU vectorizes them (see each docstring), and the
conversion to and from the flat layout that the Mosaic GPU kernel of
:mod:`pallas_kernels.ternary_adam_update` reads.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import packing as planar
from pallas_kernels import ternary


def blocked_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  """The moment's shape without its last axis: the tensor's, in blocks."""
  if shape and shape[-1] % block_size == 0:
    return (*shape[:-1], shape[-1] // block_size)
  return (-(-math.prod(shape) // block_size),)


def bytes_per_block(block_size: int, layout: Any) -> int:
  """``w = ceil(block_size / planes)``: the bytes of one block."""
  return -(-block_size // layout.planes)


def shapes(
    shape: tuple[int, ...], *, block_size: int, packing: str = "base3"
) -> ternary.TernaryArray:
  """The ``jax.ShapeDtypeStruct`` of ``packed`` and ``scales`` of a tensor's block-major trits.

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
    >>> from pallas_kernels.ternary_blocks import shapes
    >>> [a.shape for a in shapes((64, 256), block_size=128)]
    [(64, 2, 26), (64, 2, 1)]
    >>> [a.shape for a in shapes((100, 30), block_size=128, packing="2bit")]
    [(24, 32), (24, 1)]
  """
  ternary.check_block_size(block_size)
  layout = ternary.packing_layout(packing)
  blocks = blocked_shape(tuple(shape), block_size)
  return ternary.TernaryArray(
      jax.ShapeDtypeStruct((*blocks, bytes_per_block(block_size, layout)), jnp.uint8),
      jax.ShapeDtypeStruct((*blocks, 1), jnp.float32),
  )


def zeros(
    shape: tuple[int, ...], *, block_size: int, packing: str = "base3"
) -> ternary.TernaryArray:
  """Block-major trits of zeros (zero trits, zero scales) for a tensor of ``shape``.

  Examples:
    >>> from pallas_kernels.ternary_blocks import zeros
    >>> t = zeros((3,), block_size=32)
    >>> t.packed.tolist(), t.scales.tolist()  # Code 1 in all 5 places: 121.
    ([[121, 121, 121, 121, 121, 121, 121]], [[0.0]])
  """
  layout = ternary.packing_layout(packing)
  packed, scales = shapes(shape, block_size=block_size, packing=packing)
  # Every plane holds code 1: the byte sum(base**p).
  zero_trits = sum(layout.base**p for p in range(layout.planes))
  return ternary.TernaryArray(
      jnp.full(packed.shape, zero_trits, jnp.uint8), jnp.zeros(scales.shape, jnp.float32)
  )


def to_blocks(x: jax.Array, blocks: tuple[int, ...], block_size: int, fill=0) -> jax.Array:
  """``x`` as ``(*blocks, block_size)``: a reshape, after padding with ``fill`` if needed."""
  padding = math.prod(blocks) * block_size - x.size
  if padding:
    x = jnp.pad(x.reshape(-1), (0, padding), constant_values=fill)
  return x.reshape(*blocks, block_size)


def from_blocks(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  size = math.prod(shape)
  if x.size != size:
    x = x.reshape(-1)[:size]
  return x.reshape(shape)


# Codes per row of the padded view pack_blocks writes out; every block size
# (32, 64 or a multiple of 128) is whole rows, and one more row covers the
# at most planes - 1 slots past a block's end.
_PACKING_ROW = 16


def pack_blocks(codes: jax.Array, layout: Any) -> jax.Array:
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
  whole bytes. Wider rows vectorize no better and add temporary memory.
  """
  block_size = codes.shape[-1]
  width = bytes_per_block(block_size, layout)
  blocks = codes.shape[:-1]
  rows = codes.astype(jnp.uint8).reshape(*blocks, block_size // _PACKING_ROW, _PACKING_ROW)
  slots = jnp.pad(rows, [(0, 0)] * len(blocks) + [(0, 1), (0, 0)], constant_values=1)
  slots = slots.reshape(*blocks, block_size + _PACKING_ROW)
  return planar.combine_planes(
      [slots[..., p * width : (p + 1) * width] for p in range(layout.planes)], layout.base
  )


# The largest row of blocks whose place values unpack_blocks tiles (a
# constant of 256 KiB).
_MAX_TILED_PLACES = 65536


def digits(byte: jax.Array, place: Any, base: int) -> jax.Array:
  """Digit ``p`` in base ``base`` of uint8 bytes, given ``place = base**p``, as float32.

  By multiplies and shifts of uint32, which XLA:CPU vectorizes where it does
  not vectorize integer division: the quotient ``q = floor(byte / base**p)``
  is ``(byte ceil(2**16 / base**p)) >> 16`` and ``floor(q / base)`` is
  ``(q ceil(2**17 / base)) >> 17``, both exact for bytes below 256 (the
  tests check every byte and place).
  """
  place = np.asarray(place, np.int64)
  quotient = (byte.astype(jnp.uint32) * (-(-(2**16) // place)).astype(np.uint32)) >> 16
  whole = (quotient * np.uint32(-(-(2**17) // base))) >> 17
  return (quotient - whole * np.uint32(base)).astype(jnp.float32)


def unpack_blocks(packed: jax.Array, block_size: int, layout: Any) -> jax.Array:
  """Inverse of ``pack_blocks``: the codes ``(..., block_size)``, as float32.

  Each element reads its byte (the block's bytes repeated once per plane,
  one byte per element, which XLA may write out cheaply) and takes its digit
  (``digits``).
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
  return digits(byte, place, layout.base)


def stored_moment(
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
      (digits(packed, layout.base**plane, layout.base) - 1) * scales
      for plane in range(layout.planes)
  ]
  planes[-1] = planes[-1][..., : block_size - (layout.planes - 1) * width]
  return jnp.concatenate(planes, axis=-1)


def flat_bytes(block_bytes: jax.Array, size: int, block_size: int, layout: Any) -> jax.Array:
  """Block-major bytes ``(..., bytes_per_block)`` as the flat planar bytes of their first ``size`` trits."""
  codes = unpack_blocks(block_bytes, block_size, layout).reshape(-1)[:size].astype(jnp.uint32)
  return planar.pack(codes, base=layout.base, planes=layout.planes)


def block_bytes(
    flat_bytes: jax.Array, size: int, blocks: tuple[int, ...], block_size: int, layout: Any
) -> jax.Array:
  """Inverse of ``flat_bytes``: the flat bytes of ``size`` trits as ``(*blocks, bytes_per_block)``."""
  codes = planar.unpack(flat_bytes, size, base=layout.base, planes=layout.planes)
  return pack_blocks(to_blocks(codes.astype(jnp.uint32), blocks, block_size, fill=1), layout)
