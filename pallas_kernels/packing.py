"""The planar byte layout shared by every packed code in the library.

Several small codes share one byte: ``planes`` codes of ``base`` levels each
(4-bit: 2 of 16; 8-bit: 1 of 256; 2-bit ternary: 4 of 4; base-3 ternary:
5 of 3, since 3**5 = 243 <= 256). A flat array of codes is cut into rows of
``planes * 128`` codes; each row is ``planes`` planes of 128 consecutive codes,
and byte ``j`` of the row holds code ``j`` of every plane::

    byte[j] = sum_p code[p * 128 + j] * base**p        (p = 0 is least significant)

so a 4-bit row pairs element ``j`` with element ``j + 128``, never ``2j`` with
``2j + 1``: Mosaic GPU can slice two 128-wide halves of a row but cannot
de-interleave neighbours, and this layout is one that every backend produces.
A last, shorter row of ``r`` codes uses planes of ``ceil(r / planes)`` codes
(zero padded), so ``n`` codes always take exactly ``ceil(n / planes)`` bytes.

``combine_planes``/``split_planes`` work on loaded values, so the same code
runs inside a Pallas kernel body and in the XLA implementations.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

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


def pack(codes: jax.Array, *, base: int, planes: int) -> jax.Array:
  """Packs a flat array of integer codes in ``[0, base)`` into the planar layout."""
  codes = codes.reshape(-1)
  full_rows, tail = _row_split(codes.size, planes)
  body = codes[: full_rows * planes * PLANE_WIDTH].reshape(
      full_rows, planes, PLANE_WIDTH
  )
  parts = [combine_planes([body[:, p] for p in range(planes)], base).reshape(-1)]
  if tail:
    width = math.ceil(tail / planes)
    last = jnp.pad(codes[codes.size - tail :], (0, planes * width - tail))
    last = last.reshape(planes, width)
    parts.append(combine_planes([last[p] for p in range(planes)], base))
  return jnp.concatenate(parts)


def unpack(packed: jax.Array, size: int, *, base: int, planes: int) -> jax.Array:
  """Recovers ``size`` uint8 codes from ``pack``'s output."""
  if packed.shape != (packed_size(size, planes),):
    raise ValueError(
        f"packed must have shape ({packed_size(size, planes)},) for size={size}"
        f" at {planes} codes per byte; got {packed.shape}."
    )
  full_rows, tail = _row_split(size, planes)
  body = packed[: full_rows * PLANE_WIDTH].reshape(full_rows, PLANE_WIDTH)
  parts = [jnp.stack(split_planes(body, base, planes), axis=1).reshape(-1)]
  if tail:
    last = packed[full_rows * PLANE_WIDTH :]
    parts.append(jnp.stack(split_planes(last, base, planes)).reshape(-1)[:tail])
  return jnp.concatenate(parts)
