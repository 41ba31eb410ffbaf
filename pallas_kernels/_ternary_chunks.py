"""Mosaic GPU helpers of the ternary kernels: how they cut a flat array into chunks.

The ternary kernels (``ternary`` and ``ternary_adam_update``) read their
input in slices of ``PLANE_WIDTH`` (128) elements, one plane of a packed row
of ``planes * 128`` elements, and work on *chunks* of
``lcm(block_size, row)`` elements, which are whole scale blocks and whole
packed rows at once (``block_size=64``: one base-3 row of 10 blocks; ``256``:
two base-3 rows of 5 blocks, or one 2-bit row of 2 blocks). A block size of
32, 64 or a multiple of 128 makes every slice either hold whole blocks or lie
inside one block, so a block's absmax is a reduction of masked slices or a
loop over slices. A grid step runs one or more whole chunks; the rest of the
array is left to the caller's XLA path.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.packing import PLANE_WIDTH

# Grid steps of one chunk each up to this many chunks, then several chunks
# per step (at most _MAX_STEP_ELEMENTS elements). Not yet tuned on a GPU.
_MIN_GRID_STEPS = 8192
_MAX_STEP_ELEMENTS = 16384


class ChunkGeometry(NamedTuple):
  """How the kernels cut a flat array: rows of ``planes`` slices, chunks of rows and blocks.

  A chunk of ``lcm(block_size, row)`` elements is whole rows and whole blocks.
  """

  block_size: int
  planes: int

  @property
  def row(self) -> int:
    return self.planes * PLANE_WIDTH

  @property
  def chunk(self) -> int:
    return math.lcm(self.block_size, self.row)

  @property
  def rows_per_chunk(self) -> int:
    return self.chunk // self.row

  @property
  def blocks_per_chunk(self) -> int:
    return self.chunk // self.block_size


def lane_indices(interpret: bool) -> jax.Array:
  """``0 .. PLANE_WIDTH - 1`` as uint32, laid out like a loaded 128-slice."""
  lane = lax.broadcasted_iota(jnp.uint32, (PLANE_WIDTH,), 0)
  if interpret:
    # JAX 0.10's interpreter has no rule for layout_cast (an identity there).
    return lane
  from jax.experimental.pallas import mosaic_gpu as plgpu

  # Mosaic GPU cannot infer the layout of an iota on JAX 0.10.
  return plgpu.layout_cast(lane, plgpu.Layout.WG_STRIDED((PLANE_WIDTH,), vec_size=1))


def for_each_index(count: int, body: Callable[[Any], None]) -> None:
  """``body(i)`` for ``i`` in ``range(count)``.

  A single Python call when ``count == 1``, so that offsets stay static (and
  sub-slice blocks can be picked by Python indexing); a ``fori_loop`` otherwise.
  """
  if count == 1:
    body(0)
    return

  def step(i, carry):
    body(i)
    return carry

  lax.fori_loop(0, count, step, 0)


def select_scalar(values: Sequence[jax.Array], index: Any) -> jax.Array:
  """``values[index]`` for a static or traced scalar ``index``."""
  if isinstance(index, int):
    return values[index]
  selected = values[0]
  for k in range(1, len(values)):
    selected = jnp.where(index == k, values[k], selected)
  return selected


def slice_scale(
    scales: Sequence[jax.Array], offset: Any, lane: jax.Array, geometry: ChunkGeometry
) -> jax.Array:
  """The scale of each element of the slice at ``offset`` within a chunk.

  A scalar when the slice lies in one block; a vector when it holds several
  (then the chunk is one row and ``offset`` is static).
  """
  if geometry.block_size >= PLANE_WIDTH:
    return select_scalar(scales, offset // geometry.block_size)
  first = offset // geometry.block_size
  lane_block = lane // jnp.uint32(geometry.block_size)
  scale = scales[first]
  for j in range(1, PLANE_WIDTH // geometry.block_size):
    scale = jnp.where(lane_block == j, scales[first + j], scale)
  return scale


def load_slice(ref, start) -> jax.Array:
  """The ``PLANE_WIDTH`` elements of ``ref`` from ``start`` on."""
  return ref[pl.ds(start, PLANE_WIDTH)]


def chunk_absmax(x_ref, start, lane: jax.Array, geometry: ChunkGeometry) -> list[jax.Array]:
  """The absmax of each block of the chunk that begins at element ``start``."""
  block_size = geometry.block_size
  if block_size >= PLANE_WIDTH:

    def block_absmax(block_start):
      def slice_max(i, running):
        values = load_slice(x_ref, block_start + i * PLANE_WIDTH).astype(jnp.float32)
        return jnp.maximum(running, jnp.max(jnp.abs(values)))

      return lax.fori_loop(0, block_size // PLANE_WIDTH, slice_max, jnp.float32(0))

    return [block_absmax(start + k * block_size) for k in range(geometry.blocks_per_chunk)]

  lane_block = lane // jnp.uint32(block_size)
  maxima = []
  for s in range(geometry.chunk // PLANE_WIDTH):
    magnitude = jnp.abs(load_slice(x_ref, start + s * PLANE_WIDTH).astype(jnp.float32))
    for j in range(PLANE_WIDTH // block_size):
      maxima.append(jnp.max(jnp.where(lane_block == j, magnitude, 0.0)))
  return maxima


def _default_chunks_per_step(full_chunks: int, geometry: ChunkGeometry) -> int:
  most = max(1, _MAX_STEP_ELEMENTS // geometry.chunk)
  return max(1, min(most, full_chunks // _MIN_GRID_STEPS))


def grid_extent(
    size: int, geometry: ChunkGeometry, chunks_per_step: int | None
) -> tuple[int, int]:
  """(grid steps, chunks per step) of the kernel part of ``size`` elements."""
  full_chunks = size // geometry.chunk
  if chunks_per_step is None:
    chunks_per_step = _default_chunks_per_step(full_chunks, geometry)
  return full_chunks // chunks_per_step, chunks_per_step
