r"""Ternary codes: the byte layout of ternary Adam's first moment, and its rounding.

A tensor is cut into scale blocks of ``block_size`` consecutive elements of
its flattened form; each block keeps one float32 scale ``s`` and each
element one trit ``t`` in ``{-1, 0, +1}`` (the value ``t s``).

**Block-major layout.** When blocks tile the last axis
(``shape[-1] % block_size == 0``) the trits of a tensor of shape ``(..., n)``
are stored as ``packed`` uint8 of shape ``(..., n // block_size, w)`` and
``scales`` float32 of shape ``(..., n // block_size, 1)``: every axis of the
tensor keeps its place (the last one counts blocks), so a sharding of the
tensor is a sharding of its codes, and no byte holds trits of two blocks.
Other tensors use ``(ceil(size / block_size), w)`` and ``(..., 1)``, the last
block zero padded. Within a block, byte ``j`` of its ``w = ceil(block_size /
planes)`` bytes holds the codes ``t + 1`` of elements ``j + p w``:

.. math::
  \text{byte}_j = \sum_{p=0}^{\text{planes}-1} \text{base}^p \, (t_{j + p w} + 1)

with 5 planes of base 3 (``"base3"``, ``3**5 = 243 <= 256``) or 4 of base 4
(``"2bit"``, cheaper to unpack); slots past the block's end hold code 1 (a
zero trit). Base 3 takes 7, 13, 26 and 52 bytes for blocks of 32, 64, 128 and
256 elements (1.75, 1.625, 1.625 and 1.625 bits per element); ``"2bit"``
exactly 2 bits.

**Stochastic rounding.** A value ``x`` of a block of scale ``s >= max |x|``
becomes ``t = sign(x) [u s < |x|]`` with ``u`` uniform on ``[0, 1)``, so
``P(t = sign(x)) = |x| / s`` and ``E[t s] = x``: unbiased (TernGrad, QSGD).
The uniforms are a counter-based hash, not ``jax.random``'s stream, so that a
kernel body can draw them too: element ``i`` gets
``u_i = (h(seed XOR i) >> 8) / 2**24`` with ``h(x) = y XOR (y >> 16)``,
``y = x * 0x9E3779B1`` (2**32 over the golden ratio): one multiply and one
xor-shift in uint32. The seed is uniform, so each ``u_i`` is exactly uniform
over the 2**24 values whatever the mixing; ``h`` is a bijection, so within a
call no two elements share their bits; indices are taken modulo ``2**32``.

Block sizes are 32, 64 or a multiple of 128: a 128-element slice of a
tensor then holds whole blocks or lies in one.

References:
  Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
  Quantization and Encoding", 2017 (https://arxiv.org/abs/1610.02132).
  Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
  Distributed Deep Learning", 2017 (https://arxiv.org/abs/1705.07878).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import static_args
from pallas_kernels.blocks import blocks_shape
from pallas_kernels.packing import combine_planes

PACKINGS = ("base3", "2bit")
# Blocks smaller than a 128-element slice: each slice holds whole ones.
_SUB_SLICE_BLOCK_SIZES = (32, 64)
_SLICE = 128


class TernaryArray(NamedTuple):
  """Packed trits and their block scales, in the block-major layout."""

  packed: jax.Array  # uint8, shape (*blocks, ceil(block_size / trits_per_byte)).
  scales: jax.Array  # float32, shape (*blocks, 1).


class Layout(NamedTuple):
  """How trits are packed: codes ``t + 1`` of ``base`` levels, ``planes`` per byte."""

  base: int
  planes: int


_LAYOUTS = {"base3": Layout(base=3, planes=5), "2bit": Layout(base=4, planes=4)}


def check_block_size(block_size: int) -> int:
  """``block_size`` as an ``int``; ``ValueError`` unless it is 32, 64 or a positive multiple of 128."""
  hint = " (32, 64 or a multiple of 128)"
  block_size = static_args.check_int("block_size", block_size, 1, hint=hint)
  if block_size not in _SUB_SLICE_BLOCK_SIZES and block_size % _SLICE:
    raise ValueError(f"block_size must be 32, 64 or a positive multiple of 128; got {block_size}.")
  return block_size


def packing_layout(packing: str) -> Layout:
  """The base and planes of packing ``"base3"`` or ``"2bit"``; ``ValueError`` otherwise."""
  if packing not in _LAYOUTS:
    raise ValueError(f"packing must be one of {PACKINGS}; got {packing!r}.")
  return _LAYOUTS[packing]


# Rounding.


def counter_hash_bits(seed: jax.Array, index: jax.Array) -> jax.Array:
  """The uint32 random bits of elements ``index``: one multiply-xorshift of ``seed ^ index``."""
  bits = (index ^ seed) * jnp.uint32(0x9E3779B1)
  return bits ^ (bits >> jnp.uint32(16))


def uniforms(bits: jax.Array) -> jax.Array:
  """The top 24 bits as a float32 in ``[0, 1)``, exactly representable."""
  # Through int32: the value is below 2**24, and signed conversion lowers everywhere.
  top = (bits >> jnp.uint32(8)).astype(jnp.int32)
  return top.astype(jnp.float32) * jnp.float32(2.0**-24)


def ternary_codes(values: jax.Array, scale: jax.Array, bits: jax.Array) -> jax.Array:
  """uint32 codes ``t + 1`` of float32 ``values`` rounded stochastically to trits of ``scale``."""
  nonzero = uniforms(bits) * scale < jnp.abs(values)
  signed = jnp.where(values < 0, jnp.uint32(0), jnp.uint32(2))
  return jnp.where(nonzero, signed, jnp.uint32(1))


# The layout.


def bytes_per_block(block_size: int, layout: Layout) -> int:
  """``w = ceil(block_size / planes)``: the bytes of one block."""
  return -(-block_size // layout.planes)


def shapes(shape: tuple[int, ...], *, block_size: int, packing: str = "base3") -> TernaryArray:
  """The ``jax.ShapeDtypeStruct`` of ``packed`` and ``scales`` of a tensor's trits.

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
    >>> from pallas_kernels.ternary import shapes
    >>> [a.shape for a in shapes((64, 256), block_size=128)]
    [(64, 2, 26), (64, 2, 1)]
    >>> [a.shape for a in shapes((100, 30), block_size=128, packing="2bit")]
    [(24, 32), (24, 1)]
  """
  check_block_size(block_size)
  layout = packing_layout(packing)
  blocks = blocks_shape(tuple(shape), block_size)
  return TernaryArray(
    jax.ShapeDtypeStruct((*blocks, bytes_per_block(block_size, layout)), jnp.uint8),
    jax.ShapeDtypeStruct((*blocks, 1), jnp.float32),
  )


def zeros(shape: tuple[int, ...], *, block_size: int, packing: str = "base3") -> TernaryArray:
  """Trits of zeros (zero trits, zero scales) for a tensor of ``shape``.

  Examples:
    >>> from pallas_kernels.ternary import zeros
    >>> t = zeros((3,), block_size=32)
    >>> t.packed.tolist(), t.scales.tolist()  # Code 1 in all 5 places: 121.
    ([[121, 121, 121, 121, 121, 121, 121]], [[0.0]])
  """
  layout = packing_layout(packing)
  packed, scales = shapes(shape, block_size=block_size, packing=packing)
  # Every plane holds code 1: the byte sum(base**p).
  zero_trits = sum(layout.base**p for p in range(layout.planes))
  return TernaryArray(jnp.full(packed.shape, zero_trits, jnp.uint8), jnp.zeros(scales.shape, jnp.float32))


# Codes per row of the padded view pack_blocks writes out; every block size
# (32, 64 or a multiple of 128) is whole rows, and one more row covers the
# at most planes - 1 slots past a block's end.
_PACKING_ROW = 16


def pack_blocks(codes: jax.Array, layout: Layout) -> jax.Array:
  """Codes ``(..., block_size)`` in ``[0, base)`` to bytes ``(..., bytes_per_block)``.

  Byte ``j`` is ``sum_p base**p code[j + p w]`` (``packing.combine_planes``
  of the plane slices), code 1 (a zero trit) in the slots past the block's
  end. The codes are viewed as rows of 16 and padded with one more row of
  code 1, which covers the slots past the block's end; XLA:CPU writes that
  padded view out in one vectorized loop, and the sums read whole bytes (it
  would otherwise compute each code inside loops over rows of ``w`` bytes,
  which do not vectorize).
  """
  block_size = codes.shape[-1]
  width = bytes_per_block(block_size, layout)
  blocks = codes.shape[:-1]
  rows = codes.astype(jnp.uint8).reshape(*blocks, block_size // _PACKING_ROW, _PACKING_ROW)
  slots = jnp.pad(rows, [(0, 0)] * len(blocks) + [(0, 1), (0, 0)], constant_values=1)
  slots = slots.reshape(*blocks, block_size + _PACKING_ROW)
  return combine_planes([slots[..., p * width : (p + 1) * width] for p in range(layout.planes)], layout.base)


# The largest row of blocks whose place values unpack_blocks tiles (a
# constant of 256 KiB).
_MAX_TILED_PLACES = 65536


def digits(byte: jax.Array, place: Any, base: int) -> jax.Array:
  """Digit ``p`` in base ``base`` of uint8 bytes, given integers ``place = base**p``, as float32.

  By multiplies and shifts of uint32, which XLA:CPU vectorizes where it does
  not vectorize integer division: the quotient ``q = floor(byte / base**p)``
  is ``(byte ceil(2**16 / base**p)) >> 16`` and ``floor(q / base)`` is
  ``(q ceil(2**17 / base)) >> 17``, both exact for bytes below 256 (the
  tests check every byte and place).
  """
  if not isinstance(place, jax.Array):
    place = np.asarray(place, np.int64)
  quotient = (byte.astype(jnp.uint32) * (-(-(2**16) // place)).astype(jnp.uint32)) >> 16
  whole = (quotient * np.uint32(-(-(2**17) // base))) >> 17
  return (quotient - whole * np.uint32(base)).astype(jnp.float32)


def unpack_blocks(packed: jax.Array, block_size: int, layout: Layout) -> jax.Array:
  """Inverse of ``pack_blocks``: the codes ``(..., block_size)``, as float32.

  Each element reads its byte (the block's bytes repeated once per plane,
  one byte per element) and takes its digit (``digits``).
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
