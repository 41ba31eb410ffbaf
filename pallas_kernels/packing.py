"""The planar byte layout of ``pallas_kernels.quantize``'s packed codes.

Several small codes share one byte: ``planes`` codes of ``base`` levels each
(4-bit: 2 of 16; 8-bit: 1 of 256). A flat array of codes is cut into rows of
``planes * 128`` codes; each row is ``planes`` planes of 128 consecutive codes,
and byte ``j`` of the row holds code ``j`` of every plane::

    byte[j] = sum_p code[p * 128 + j] * base**p        (p = 0 is least significant)

so a 4-bit row pairs element ``j`` with element ``j + 128``, never ``2j`` with
``2j + 1``: Mosaic GPU can slice two 128-wide halves of a row but cannot
de-interleave neighbours, and this layout is one that every backend produces.
A last, shorter row of ``r`` codes uses planes of ``ceil(r / planes)`` codes
(zero padded), so ``n`` codes always take exactly ``ceil(n / planes)`` bytes.

The library packs two other formats, each laid out beside its format's code:
ternary Adam's trits in planes of ``ceil(block_size / planes)`` bytes per
scale block (``pallas_kernels.ternary``, which shares ``combine_planes``),
and 4-bit AdamW's two moments in one byte per element, ``m`` in the low
nibble and ``v`` in the high (``pallas_kernels.lowbit_adamw_update``).

``combine_planes``/``split_planes`` work on loaded values, so the same code
runs inside a Pallas kernel body and in the XLA implementations.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

PLANE_WIDTH = 128


def combine_planes(planes: Sequence[jax.Array], base: int) -> jax.Array:
  """Packs ``len(planes)`` equally shaped code arrays into one uint8 array.

  Arithmetic runs in uint32: Mosaic GPU only shifts and multiplies 32-bit
  integers, and the result is cast to bytes at the end.
  """
  packed = planes[-1].astype(jnp.uint32)
  for plane in reversed(planes[:-1]):
    packed = packed * jnp.uint32(base) + plane.astype(jnp.uint32)
  return packed.astype(jnp.uint8)


def split_planes(packed: jax.Array, base: int, count: int) -> list[jax.Array]:
  """Inverse of ``combine_planes``: ``count`` uint8 code arrays."""
  rest = packed.astype(jnp.uint32)
  planes = []
  for _ in range(count):
    planes.append((rest % jnp.uint32(base)).astype(jnp.uint8))
    rest = rest // jnp.uint32(base)
  return planes


def packed_size(size: int, planes: int) -> int:
  """Bytes that ``size`` codes take at ``planes`` codes per byte."""
  return math.ceil(size / planes)


def _row_split(size: int, planes: int) -> tuple[int, int]:
  row = planes * PLANE_WIDTH
  return size // row, size % row


def _place_values(base: int, planes: int) -> jax.Array:
  """``base**p`` for each plane ``p``, as a uint32 column."""
  return (jnp.uint32(base) ** jnp.arange(planes, dtype=jnp.uint32))[:, None]


def _append_in_place(body: jax.Array, last: jax.Array) -> jax.Array:
  """``concatenate([body, last])`` with ``body`` written in place into the result.

  XLA:CPU fuses the producers of a ``concatenate`` into it and then picks the
  operand element by element, which stops vectorization: a costly ``body``
  (a fused optimizer step) would then run without vector instructions.
  Dynamic updates of a buffer are emitted as plain loops over the update
  instead.
  """
  if not last.size:
    return body
  result = jnp.zeros((body.size + last.size,), body.dtype)
  result = lax.dynamic_update_slice(result, last, (body.size,))
  return lax.dynamic_update_slice(result, body, (0,))


def pack(codes: jax.Array, *, base: int, planes: int) -> jax.Array:
  """Packs a flat array of integer codes in ``[0, base)`` into the planar layout."""
  codes = codes.reshape(-1)
  full_rows, tail = _row_split(codes.size, planes)
  body = codes[: full_rows * planes * PLANE_WIDTH].reshape(full_rows, planes, PLANE_WIDTH)
  # A sum over the plane axis, not combine_planes over strided plane slices:
  # the same bytes, but XLA:CPU vectorizes the reduction far better when the
  # codes are computed in the same fusion.
  body = jnp.sum(body.astype(jnp.uint32) * _place_values(base, planes), axis=1)
  body = body.astype(jnp.uint8).reshape(-1)
  if not tail:
    return body
  width = math.ceil(tail / planes)
  last = jnp.pad(codes[codes.size - tail :], (0, planes * width - tail))
  last = last.reshape(planes, width)
  return _append_in_place(body, combine_planes([last[p] for p in range(planes)], base))


def unpack(packed: jax.Array, size: int, *, base: int, planes: int) -> jax.Array:
  """Recovers ``size`` uint8 codes from ``pack``'s output."""
  if packed.shape != (packed_size(size, planes),):
    raise ValueError(
      f"packed must have shape ({packed_size(size, planes)},) for size={size}"
      f" at {planes} codes per byte; got {packed.shape}."
    )
  full_rows, tail = _row_split(size, planes)
  rows = full_rows + bool(tail)
  # Every row, the last one zero padded, is unpacked as a whole row; the last
  # row's codes are then replaced in place. No concatenate: see _append_in_place.
  body = jnp.pad(packed, (0, rows * PLANE_WIDTH - packed.size)).reshape(rows, PLANE_WIDTH)
  codes = jnp.stack(split_planes(body, base, planes), axis=1).reshape(-1)
  if tail:
    last = jnp.stack(split_planes(packed[full_rows * PLANE_WIDTH :], base, planes))
    last_start = full_rows * planes * PLANE_WIDTH
    codes = lax.dynamic_update_slice(codes, last.reshape(-1)[:tail], (last_start,))
  return codes[:size]
