"""Blocks of a tensor, as the blockwise states (ternary Adam, low-bit AdamW) lay them out.

A tensor of ``shape`` is cut into blocks of ``block_size`` consecutive
elements. When ``block_size`` divides the last axis, the blocks tile its
rows and keep the tensor's leading axes (so they shard with it); otherwise
they run over the flattened tensor, the last one padded with zeros.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def blocks_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  """The shape of the grid of blocks: ``(*shape[:-1], shape[-1] // block_size)`` or ``(ceil(size / block_size),)``."""
  if shape and shape[-1] % block_size == 0:
    return (*shape[:-1], shape[-1] // block_size)
  return (-(-math.prod(shape) // block_size),)


def to_blocks(x: jax.Array, blocks: tuple[int, ...], block_size: int) -> jax.Array:
  """``x`` as ``(*blocks, block_size)``: a reshape, after zero padding the flat tensor if needed."""
  padding = math.prod(blocks) * block_size - x.size
  if padding:
    x = jnp.pad(x.reshape(-1), (0, padding))
  return x.reshape(*blocks, block_size)


def from_blocks(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`to_blocks`: the first ``prod(shape)`` elements as ``shape``."""
  size = math.prod(shape)
  if x.size != size:
    x = x.reshape(-1)[:size]
  return x.reshape(shape)
