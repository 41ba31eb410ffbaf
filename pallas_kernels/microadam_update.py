"""MicroAdam's window update: Adam's step rebuilt from a ring of sparse gradients.

MicroAdam keeps no dense moments. Its state holds the last ``window`` sparse
gradients, each the block top-k of one step: ``indices[window, K]`` (block-local,
int16) and ``values[window, K]`` (bf16), with ``K = topk.selection_size(d,
density=density, block_size=D)`` entries laid out block-major as
``topk.block_topk`` returns them (full block ``b`` owns entries ``[b k, (b + 1)
k)``, ``k = topk.entries_kept(D, density)``; a tail block the last ones). At
step ``t`` (1-based) ring row ``r`` was written at step ``t - e_r``, ``e_r =
(t - 1 - r) mod window``, and only rows ``r < min(t, window)`` have been
written. This op computes, densely over the ``d`` elements of the tensor,

.. math::
  M = c_1 \\sum_r \\beta_1^{e_r}\\, \\mathrm{scatter}(idx_r, val_r), \\qquad
  S = c_2 \\sum_r \\beta_2^{e_r}\\, \\mathrm{scatter}(idx_r, val_r^2),

  u = \\frac{M}{\\sqrt{S} + \\epsilon}, \\qquad
  c_1 = \\frac{1 - \\beta_1}{1 - \\beta_1^t}, \\quad
  c_2 = \\frac{1 - \\beta_2}{1 - \\beta_2^t},

with ``u = 0`` where no row has an entry (``S = 0``).

``microadam_update_reference`` is this formula in plain jnp, row by row.
``microadam_update`` computes it without a dense ``M`` or ``S``, on every
platform: each block's ``window * k`` entries are sorted by index (a row
holds an index at most once, so an index's entries are at most ``window``
adjacent ones), summed per index with per-row weights folded with ``c_1``
and ``c_2`` (``window_weights``). The finished directions are compacted, one
per distinct index in index order, and the dense update reads them through
a rank structure: a bitmap of the indices present and, per 32-element word,
how many are present before it (``offsets[w] + popcount(bitmap[w] &
below)``): a quarter of a byte per element (a bit, and an int32 per 32),
where a map of int16 slots would take 2.

References:
  Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
  Overhead and Provable Convergence", NeurIPS 2024,
  https://arxiv.org/abs/2405.15593
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import static_args, topk


def window_weights(
  count: jax.typing.ArrayLike,
  b1: jax.typing.ArrayLike,
  b2: jax.typing.ArrayLike,
  *,
  window: int,
) -> jax.Array:
  """Per ring row, the weights of its values in ``M`` and of their squares in ``S``.

  .. math::
    w_{1,r} = c_1 \\beta_1^{e_r}, \\quad w_{2,r} = c_2 \\beta_2^{e_r}
    \\quad (r < \\min(t, m)), \\qquad 0 \\text{ otherwise},

  with ``e_r = (t - 1 - r) mod m``, ``m = window``, ``t = count``.

  Args:
    count: the step ``t >= 1`` whose update is computed (the ring row
      ``(t - 1) mod window`` already holds this step's gradient).
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    window: number of ring rows.

  Returns:
    A float32 array ``[2, window]``: row 0 the weights ``w1``, row 1 ``w2``.

  Examples:
    >>> from pallas_kernels.microadam_update import window_weights
    >>> window_weights(2, 0.5, 0.5, window=3)  # rows 0 and 1 written, row 1 newest
    Array([[0.33333334, 0.6666667 , 0.        ],
           [0.33333334, 0.6666667 , 0.        ]], dtype=float32)
  """
  t = jnp.asarray(count, jnp.int32)
  b1 = jnp.asarray(b1, jnp.float32)
  b2 = jnp.asarray(b2, jnp.float32)
  rows = jnp.arange(window, dtype=jnp.int32)
  age = jnp.mod(t - 1 - rows, window).astype(jnp.float32)
  written = rows < jnp.minimum(t, window)
  t = t.astype(jnp.float32)
  c1 = (1 - b1) / (1 - b1**t)
  c2 = (1 - b2) / (1 - b2**t)
  weights = jnp.stack([c1 * b1**age, c2 * b2**age])
  return jnp.where(written, weights, 0.0)


def _update_from_moments(first: jax.Array, second: jax.Array, eps: jax.Array) -> jax.Array:
  """``M / (sqrt(S) + eps)``, 0 where ``S = 0``.

  ``S = 0`` means no ring row has the entry, so ``M = 0`` too: the ``where``
  gives it 0 even with ``eps = 0`` while letting NaNs through.
  """
  return jnp.where(second == 0, 0.0, first / (jnp.sqrt(second) + eps))


def flat_positions(indices: jax.Array, *, k: int, block_size: int) -> jax.Array:
  """Positions in the flattened tensor of block-local, block-major top-k indices.

  Full blocks own ``k`` entries each and a tail block at most ``k``, so entry
  ``j`` of a row lies in block ``j // k`` at ``(j // k) * block_size +
  indices[..., j]``.

  Args:
    indices: block-local indices ``[..., K]``, as ``topk.block_topk`` returns.
    k: entries per full block.
    block_size: elements per block.

  Returns:
    int32 positions, shaped like ``indices``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.microadam_update import flat_positions
    >>> flat_positions(jnp.array([1, 3, 1, 3, 0], jnp.int16), k=2, block_size=4)
    Array([1, 3, 5, 7, 8], dtype=int32)
  """
  block = jnp.arange(indices.shape[-1], dtype=jnp.int32) // k
  return block * block_size + indices.astype(jnp.int32)


def microadam_update_reference(
  indices: jax.Array,
  values: jax.Array,
  count: jax.typing.ArrayLike,
  b1: jax.typing.ArrayLike,
  b2: jax.typing.ArrayLike,
  eps: jax.typing.ArrayLike,
  *,
  size: int,
  density: float,
  block_size: int,
) -> jax.Array:
  """``microadam_update`` in plain jnp: the module docstring's formula, ring row by ring row."""
  window = indices.shape[0]
  t = jnp.asarray(count, jnp.int32)
  b1, b2, eps = (jnp.asarray(h, jnp.float32) for h in (b1, b2, eps))
  positions = flat_positions(indices, k=topk.entries_kept(block_size, density), block_size=block_size)
  values = values.astype(jnp.float32)
  first = jnp.zeros((size,), jnp.float32)
  second = jnp.zeros((size,), jnp.float32)
  for row in range(window):
    age = jnp.mod(t - 1 - row, window).astype(jnp.float32)
    written = row < jnp.minimum(t, window)
    first = first.at[positions[row]].add(jnp.where(written, b1**age, 0.0) * values[row])
    second = second.at[positions[row]].add(jnp.where(written, b2**age, 0.0) * values[row] ** 2)
  t = t.astype(jnp.float32)
  first = first * (1 - b1) / (1 - b1**t)
  second = second * (1 - b2) / (1 - b2**t)
  return jnp.where(second == 0, 0.0, first / (jnp.sqrt(second) + eps))


def _as_blocks(ring: jax.Array, n_blocks: int) -> jax.Array:
  """Ring columns of ``n_blocks`` blocks, ``[window, n_blocks * keep]``, as ``[n_blocks, window * keep]``.

  Entry ``r * keep + j`` of a block is entry ``j`` of that block in ring row ``r``.
  """
  window = ring.shape[0]
  return ring.reshape(window, n_blocks, -1).transpose(1, 0, 2).reshape(n_blocks, -1)


def _sorted_by_index(
  local: jax.Array, values: jax.Array, *, window: int, block_size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each block's entries ordered by (block-local index, ring row): the indices, the rows and the values.

  Entry ``r * keep + j`` of a block is entry ``j`` of ring row ``r``, and a
  row holds an index at most once: the pair is unique, and equal indices end
  up adjacent, in ring-row order. The values travel with the sort rather
  than being gathered after it, and the pair is packed in one int32 key
  (the row in its low bits) where it fits, which XLA sorts as plain
  integers: the index and the row are then a shift and a mask of the sorted
  key, cheap enough to recompute where they are used.
  """
  shift = max(window - 1, 1).bit_length()
  row = lax.broadcasted_iota(jnp.int32, local.shape, 1) // (local.shape[1] // window)
  if block_size << shift <= jnp.iinfo(jnp.int32).max:
    bits = jnp.asarray(shift, local.dtype)  # lax's shifts take no Python int (an int64 one with x64 enabled).
    # Unique keys: no stability asked for, which XLA would buy with an iota operand sorted along.
    key, values = lax.sort(
      (lax.shift_left(local, bits) | row.astype(local.dtype), values), dimension=1, num_keys=1, is_stable=False
    )
    return lax.shift_right_logical(key, bits), key & ((1 << shift) - 1), values
  return lax.sort((local, row, values), dimension=1, num_keys=1, is_stable=True)


_WORD = 32
# The dtypes an update may take (the parameters' of at most 32 bits).
UPDATE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _compact_by_index(
  local: jax.Array, direction: jax.Array, width: int, first_block: jax.typing.ArrayLike, directions, bitmap
) -> tuple[jax.Array, jax.Array]:
  """Blocks' directions, one per distinct index in index order, written into a tensor's buffers.

  ``local`` holds the entries of blocks ``first_block, ...`` sorted by index,
  ``direction`` the finished direction at the first entry of each index's
  run. The bitmap of the indices present (one bit per element, 32 per word)
  and, per word, the number of indices present before it in its block
  (``_rank_offsets``) give an index's rank among the distinct ones,
  ``offsets[w] + popcount(bitmap[w] & below)``: a quarter of a byte per
  element, where a map of int16 slots would take 2.

  Args:
    local: ``[blocks, n]`` sorted block-local indices.
    direction: ``[blocks, n]`` directions, used at the first entry of each run.
    width: elements per block.
    first_block: the tensor's block that ``local``'s first row is.
    directions: the tensor's ``[all blocks * n + 1]`` float32 directions;
      block ``b``'s start at ``b * n``, beyond its distinct indices (and the
      last element) left as they are.
    bitmap: the tensor's ``[all blocks * words]`` uint32 bitmap, 0 for these
      blocks (their bits are added).

  Returns:
    ``(directions, bitmap)`` with these blocks written.
  """
  n_blocks, n_entries = local.shape
  words = -(-width // _WORD)
  previous = jnp.pad(local[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  first = local != previous
  block = lax.broadcasted_iota(jnp.int32, local.shape, 0)
  word = block * words + local // _WORD
  bit = lax.shift_left(jnp.uint32(1), (local % _WORD).astype(jnp.uint32))
  # Flat indices: XLA materializes the index tuples of a two-dimensional
  # gather or scatter. Distinct indices set distinct bits, so adding them is
  # or-ing them; later entries of a run aim past the end and are dropped.
  first_word = first_block * words
  bitmap = bitmap.at[jnp.where(first, first_word + word, bitmap.size)].add(bit, mode="drop")
  chunk_bitmap = lax.dynamic_slice_in_dim(bitmap, first_word, n_blocks * words)
  offsets = _rank_offsets(chunk_bitmap, words)
  below = lax.population_count(chunk_bitmap[word] & (bit - jnp.uint32(1))).astype(jnp.int32)
  rank = (first_block + block) * n_entries + offsets.reshape(-1)[word] + below
  directions = directions.at[jnp.where(first, rank, directions.size)].set(
    direction.astype(directions.dtype), mode="drop"
  )
  return directions, bitmap


def _rank_offsets(bitmap: jax.Array, words: int) -> jax.Array:
  """Per word of a flat bitmap of blocks of ``words`` words, the bits set before it in its block.

  Returns:
    int32 ``[blocks, words]``.
  """
  counts = lax.population_count(bitmap).reshape(-1, words).astype(jnp.int32)
  return jnp.cumsum(counts, axis=1) - counts


def _read_dense(directions: jax.Array, bitmap: jax.Array, offsets: jax.Array, width: int) -> jax.Array:
  """The dense ``[blocks, width]`` update: an element's direction where its index is present, else 0.

  ``directions`` ends with one 0 past the blocks' ``n_entries`` each, which
  absent elements read: the test of presence then has one use, which
  XLA:GPU fuses into the parameters' update (with two uses it wrote it out
  for the largest tensors, a byte per element).
  """
  n_blocks, words = bitmap.shape
  n_entries = (directions.size - 1) // n_blocks
  shape = (n_blocks, words, _WORD)
  lane = lax.broadcasted_iota(jnp.uint32, shape, 2)
  bits = jnp.broadcast_to(bitmap[:, :, None], shape)
  present = (lax.shift_right_logical(bits, lane) & jnp.uint32(1)) != 0
  below = lax.population_count(bits & (lax.shift_left(jnp.uint32(1), lane) - jnp.uint32(1))).astype(jnp.int32)
  block = lax.broadcasted_iota(jnp.int32, shape, 0)
  rank = jnp.where(present, block * n_entries + offsets[:, :, None] + below, directions.size - 1)
  dense = directions[rank]
  return dense.reshape(n_blocks, words * _WORD)[:, :width]


def _block_directions(local, ring_values, weights, eps, first_block, buffers, *, block_size: int, width: int):
  """The directions of blocks of the window's entries ``[blocks, window * keep]``, into the tensor's buffers.

  ``M`` and ``S`` are summed per block-local index over the entries of a
  block (sorted by index, equal indices adjacent: a row holds an index at
  most once, so an index's entries are at most ``window`` consecutive
  ones; the first holds the sums).

  Returns:
    ``buffers``, ``(directions, bitmap)``, written by ``_compact_by_index``.
  """
  window = weights.shape[1]
  local, row, value = _sorted_by_index(local.astype(jnp.int32), ring_values, window=window, block_size=block_size)
  value = value.astype(jnp.float32)
  first, second = weights[0][row] * value, weights[1][row] * value * value
  # The run of an index starts at its first entry and spans at most the
  # window; sums in ring-row order, as the reference adds its rows.
  pad = ((0, 0), (0, window - 1))
  padded_local = jnp.pad(local, pad, constant_values=-1)
  padded_first, padded_second = jnp.pad(first, pad), jnp.pad(second, pad)
  moments = [jnp.zeros_like(first), jnp.zeros_like(second)]
  for shift in range(window):
    same = lax.slice_in_dim(padded_local, shift, shift + local.shape[1], axis=1) == local
    for m, padded in enumerate((padded_first, padded_second)):
      term = lax.slice_in_dim(padded, shift, shift + local.shape[1], axis=1)
      moments[m] = moments[m] + jnp.where(same, term, 0.0)
  return _compact_by_index(local, _update_from_moments(*moments, eps), width, first_block, *buffers)


# Window entries whose directions are computed at once. A tensor with more
# goes through a loop over chunks of its blocks, writing into its compacted
# directions and bitmap in place, so that the sort's and the sums' arrays
# (tens of bytes per entry) stay a bounded size rather than grow with the
# tensor: a large embedding's would otherwise be the step's largest
# temporaries. Chunks this small also keep XLA:GPU from writing each entry's
# two float32 terms out before summing them (with 2**21 it did, for the
# tensors under the bound in one fusion whose outputs were live together,
# and a Llama-2-7B layer's step moved 2 to 3 bytes per parameter more).
WINDOW_ENTRIES_AT_ONCE = 1 << 18


def _zeros_after(local: jax.Array, n_blocks: int) -> jax.Array:
  """int32 zeros, one per block, computed from the ring's block-local indices (all ``>= 0``): XLA cannot fold them.

  The compacted directions and the bitmap are filled with them, so that
  their creation waits for the tensor's ring. Built from constants alone (or
  left uninitialized) they depend on nothing, and XLA:GPU makes them with a
  training step's arguments, before the forward pass, holding every
  tensor's through the backward pass (``docs/performance-notes.md``,
  "MicroAdam's step on a GPU"). One zero per block, read from the block's
  own columns, keeps a sharded ring's blocks on their devices.
  """
  return jnp.minimum(local[0, :: local.shape[1] // n_blocks].astype(jnp.int32), 0)


def _dense_update(
  ring, weights, eps, *, n_blocks: int, width: int, block_size: int, dtype, entries_at_once: int | None = None
) -> jax.Array:
  """The flat dense update of ``n_blocks`` blocks of ``width`` elements from their ring columns.

  ``ring`` is ``(indices, values)``, ``[window, n_blocks * keep]`` each.
  More than ``entries_at_once`` entries go through a loop over chunks of
  blocks of one size, and the blocks left over after the loop's last chunk
  through one more, shorter. The compacted directions, which wait for the
  parameters' update that reads them, are stored in ``dtype``.
  """
  window, n_columns = ring[0].shape
  keep = n_columns // n_blocks
  n_entries, words = window * keep, -(-width // _WORD)
  if entries_at_once is None:
    entries_at_once = WINDOW_ENTRIES_AT_ONCE
  n_chunks = -(-n_blocks // max(1, entries_at_once // n_entries))
  chunk = -(-n_blocks // n_chunks)
  looped, left = divmod(n_blocks, chunk)

  def chunk_directions(first_block, count, buffers):
    ring_blocks = [
      _as_blocks(lax.dynamic_slice_in_dim(r, first_block * keep, count * keep, axis=1), count) for r in ring
    ]
    return _block_directions(*ring_blocks, weights, eps, first_block, buffers, block_size=block_size, width=width)

  # Zeros computed from the ring: the buffers are made where the step's data
  # is (_zeros_after). The directions' slots past a block's distinct indices
  # are never read, but an uninitialized buffer (lax.empty) depends on nothing,
  # and XLA:GPU made it at the start of the step.
  zeros = _zeros_after(ring[0], n_blocks)
  directions = jnp.concatenate([jnp.broadcast_to(zeros[:, None], (n_blocks, n_entries)).reshape(-1), zeros[-1:]])
  bitmap = jnp.broadcast_to(zeros[:, None].astype(jnp.uint32), (n_blocks, words)).reshape(-1)
  buffers = (directions.astype(dtype), bitmap)
  if looped == 1:
    buffers = chunk_directions(0, chunk, buffers)
  else:
    buffers = lax.fori_loop(0, looped, lambda c, b: chunk_directions(c * chunk, chunk, b), buffers)
  if left:
    buffers = chunk_directions(looped * chunk, left, buffers)
  directions, bitmap = buffers
  return _read_dense(directions, bitmap.reshape(n_blocks, words), _rank_offsets(bitmap, words), width).reshape(-1)


def _update_xla(indices, values, weights, eps, *, size, block_size, k, dtype, entries_at_once=None):
  """The direction at the window's entries only, read densely through a bitmap rank.

  The only dense array is the update, gathered from each block's compacted
  directions (``_block_directions``): the full blocks, then the tail block.
  """
  full_blocks, tail = divmod(size, block_size)
  dense = []
  if full_blocks:
    ring = [r[:, : full_blocks * k] for r in (indices, values)]
    dense.append(
      _dense_update(
        ring,
        weights,
        eps,
        n_blocks=full_blocks,
        width=block_size,
        block_size=block_size,
        dtype=dtype,
        entries_at_once=entries_at_once,
      )
    )
  if tail:
    ring = [r[:, full_blocks * k :] for r in (indices, values)]
    dense.append(_dense_update(ring, weights, eps, n_blocks=1, width=tail, block_size=block_size, dtype=dtype))
  if not dense:
    return jnp.zeros((0,), dtype)
  return jnp.concatenate(dense)


@functools.partial(jax.jit, static_argnames=("size", "density", "block_size", "dtype", "entries_at_once"))
def _microadam_update(
  indices, values, count, b1, b2, eps, *, size, density, block_size, dtype=jnp.dtype(jnp.float32), entries_at_once=None
):
  weights = window_weights(count, b1, b2, window=indices.shape[0])
  return _update_xla(
    indices,
    values,
    weights,
    jnp.asarray(eps, jnp.float32),
    size=size,
    block_size=block_size,
    k=topk.entries_kept(block_size, density),
    dtype=dtype,
    entries_at_once=entries_at_once,
  )


def microadam_update(
  indices: jax.Array,
  values: jax.Array,
  count: jax.typing.ArrayLike,
  b1: jax.typing.ArrayLike,
  b2: jax.typing.ArrayLike,
  eps: jax.typing.ArrayLike,
  *,
  size: int,
  density: float,
  block_size: int,
  dtype: jax.typing.DTypeLike = jnp.float32,
  entries_at_once: int | None = None,
) -> jax.Array:
  """MicroAdam's dense update from its ring of sparse gradients.

  .. math::
    u = \\frac{c_1 \\sum_r \\beta_1^{e_r} g_r}
             {\\sqrt{c_2 \\sum_r \\beta_2^{e_r} g_r^2} + \\epsilon},
    \\qquad e_r = (t - 1 - r) \\bmod m,

  over the written rows ``r < min(t, m)``, ``g_r`` the sparse gradient of
  ring row ``r`` scattered densely (see the module docstring); ``u = 0``
  where no row has an entry.

  Args:
    indices: block-local indices ``[window, K]``, in ``[0, block_size)``
      (int16 or int32), each row block-major as ``topk.block_topk`` returns it.
    values: the selected values ``[window, K]`` (any float dtype).
    count: the step ``t >= 1``; ring row ``(t - 1) mod window`` holds its
      gradient.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to ``sqrt(S)``, ``>= 0``.
    size: number of elements ``d`` of the (flattened) tensor.
    density: the top-k's fraction kept per block; ``K =
      topk.selection_size(size, density=density, block_size=block_size)``.
    block_size: elements per top-k block.
    dtype: the update's dtype, one of :data:`UPDATE_DTYPES` (default
      float32). The arithmetic is float32 whatever it is; a narrower one (the
      parameters' bfloat16) rounds each direction once, where it is
      computed, which gives the float32 update's values rounded, and halves
      the per-index directions that wait for the parameters' update.
    entries_at_once: window entries whose directions are computed at once
      (default ``WINDOW_ENTRIES_AT_ONCE``); more go through a loop over
      chunks of blocks (the same numbers, with temporaries of a bounded
      size).

  Returns:
    The update in ``dtype``, flat, of shape ``(size,)``.

  Raises:
    ValueError: for shapes that do not match ``size``, ``density`` and
      ``block_size``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.microadam_update import microadam_update
    >>> indices = jnp.array([[1, 0], [0, 0]], jnp.int16)  # one block of 2 per row
    >>> values = jnp.array([[-2.0, 4.0], [0.0, 0.0]], jnp.bfloat16)
    >>> microadam_update(indices, values, 1, 0.9, 0.999, 0.0, size=3,
    ...                  density=0.5, block_size=2)  # step 1: Adam's sign(g)
    Array([ 0., -1.,  1.], dtype=float32)

  References:
    Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
    Overhead and Provable Convergence", NeurIPS 2024,
    https://arxiv.org/abs/2405.15593
  """
  density = static_args.check_fraction("density", density)
  n_entries = topk.selection_size(size, density=density, block_size=block_size)
  if indices.ndim != 2 or indices.shape[1] != n_entries:
    raise ValueError(
      f"indices must have shape [window, {n_entries}] for size={size},"
      f" density={density}, block_size={block_size}; got {indices.shape}."
    )
  if values.shape != indices.shape:
    raise ValueError(f"values must have the shape of indices {indices.shape}; got {values.shape}.")
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise ValueError(f"indices must have an integer dtype; got {indices.dtype}.")
  dtype = static_args.check_dtype("dtype", dtype, UPDATE_DTYPES)
  return _microadam_update(
    indices,
    values,
    count,
    b1,
    b2,
    eps,
    size=size,
    density=density,
    block_size=block_size,
    dtype=dtype,
    entries_at_once=entries_at_once,
  )
