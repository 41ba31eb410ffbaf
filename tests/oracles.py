"""Expectations written from the documented formats, shared by the tests of ternary-state Adam.

Each is the documentation in numpy, independent of the code it checks.
"""

from __future__ import annotations

import math

import numpy as np

# Packing: (base, planes per byte).
LAYOUTS = {"base3": (3, 5), "2bit": (4, 4)}


def uniforms(seed: int, size: int) -> np.ndarray:
  """The documented rounding uniforms of elements ``0 .. size - 1``: ``(h(seed ^ i) >> 8) / 2**24``
  with ``h(x) = y ^ (y >> 16)``, ``y = x * 0x9E3779B1 mod 2**32``."""
  y = ((np.arange(size, dtype=np.uint64) ^ np.uint64(seed)) * np.uint64(0x9E3779B1)) % 2**32
  h = y ^ (y >> np.uint64(16))
  return (h >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)


def blocks(shape, block_size):
  """Blocks tile the last axis when they can, else the flat tensor."""
  if shape[-1] % block_size == 0:
    return (*shape[:-1], shape[-1] // block_size)
  return (-(-math.prod(shape) // block_size),)


def block_major_bytes(trits, shape, block_size, packing):
  """Byte ``j`` of a block: ``sum_p base**p (t[j + p w] + 1)``, code 1 past the block's end."""
  base, planes = LAYOUTS[packing]
  grid = blocks(shape, block_size)
  n_blocks, width = math.prod(grid), -(-block_size // planes)
  codes = np.ones(n_blocks * block_size, np.int64)
  codes[: trits.size] = np.asarray(trits, np.int64).reshape(-1) + 1
  slots = np.ones((n_blocks, planes * width), np.int64)
  slots[:, :block_size] = codes.reshape(n_blocks, block_size)
  packed = np.einsum("bpj,p->bj", slots.reshape(n_blocks, planes, width), base ** np.arange(planes))
  return packed.astype(np.uint8).reshape(*grid, width)
