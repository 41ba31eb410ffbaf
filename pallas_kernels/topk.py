"""Block top-k by magnitude: MicroAdam's sparse gradient selection.

A flat array (any input shape, flattened) of ``d`` elements is cut into
blocks of ``D = block_size`` consecutive elements; the last, tail block of
``r = d mod D`` elements may be shorter. A block of ``n`` elements keeps its

.. math::
  \\operatorname{keep}(n) = \\min(n, \\max(1, \\lceil n \\cdot density \\rceil))

entries of largest ``|x|``: ``k = keep(D)`` per full block and ``keep(r)``
for the tail, as the reference implementation does (``k_block_size_many``
and ``k_block_size_few`` in ISTA-DASLab-Optimizers' ``micro_adam.py``). The
product is rounded to 9 decimals before the ceiling, so that float noise
(``100 * 0.07 = 7.000000000000001``) does not keep one entry more.

Order and ties. Entries are ranked by their *magnitude key*: the bits of
``|x|`` as float32, read as an int32 (``float32(x)`` bits with the sign bit
cleared). For non-negative floats this integer order is the float order, so
the key ranks like ``|x|``; ``-0.0`` ties with ``0.0``; NaNs rank above
infinities (they count as the largest magnitudes, ordered among themselves by
their bits). Equal keys break toward the lower index, so every implementation
selects exactly the same set. Narrower floats (bf16, fp16, fp8) are ranked by
the key of their exact float32 upcast; float64 (only with ``jax_enable_x64``)
by its float32 rounding, and only the XLA implementation takes it.

``block_topk_reference`` states the selection in a few lines (``lax.top_k``
per block). The implementations of ``block_topk`` (``implementation=``):

* ``"xla"``: the reference's selection, tuned: ``lax.top_k`` sees the keys
  as float32 bit patterns (the same order; XLA:CPU's partial-sort top-k is
  for floats only), and at low density runs in two exact stages: the top
  ``k`` groups of ``g`` entries by their maximum key, then the top ``k`` of
  those ``k g`` candidates.
* ``"pallas"``: neither Mosaic GPU nor Triton lowers sort or top-k inside a
  kernel, so the selection is split in two. A Mosaic GPU kernel (a grid over
  blocks, each block read as rows of 256) finds each block's threshold ``T``,
  the k-th largest key, by a 31-step bisection on the key bits, and how many
  entries equal to ``T`` are taken (``k - #{key > T}``). Compacting the
  selected entries densely needs a prefix sum, which Mosaic GPU lacks, so it
  runs in XLA from the per-block thresholds (cumsum + scatter). Block sizes
  must be multiples of ``KERNEL_ROW = 256``; a tail is zero padded to whole
  rows, which never changes its selection. Float64 input is refused.
* ``"interpret"``: the same kernel run by the Mosaic GPU interpreter (CPU).
* ``None``: the default of ``dispatch.FASTER_ON_HOPPER["block_topk"]``: XLA,
  whose ``TopK`` was about 3x faster than the kernel's 31 sweeps per block on
  an H200 (``benchmarks/README.md``).

References:
  Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
  Overhead and Provable Convergence", NeurIPS 2024,
  https://arxiv.org/abs/2405.15593
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _backend, dispatch, static_args

KERNEL_ROW = 256
# Block-local indices (0 .. block_size - 1) must fit in int32.
MAX_BLOCK_SIZE = 2**31
# Keys are non-negative int32: bisecting bits 30 .. 0 reaches every key.
_KEY_BITS = 31


def _check_block_params(density, block_size) -> tuple[float, int]:
  """``(density, block_size)`` as Python numbers, or a ``ValueError`` naming the culprit."""
  density = static_args.check_fraction("density", density)
  block_size = static_args.check_int(
    "block_size", block_size, 1, MAX_BLOCK_SIZE, hint=" (block-local indices fit in int32)"
  )
  return density, block_size


def _float_array(x) -> jax.Array:
  """``x`` as a JAX array, or a ``ValueError`` if it is not floating point."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must have a floating dtype; got {x.dtype}.")
  return x


def entries_kept(length: int, density: float) -> int:
  """``keep(n) = min(n, max(1, ceil(n * density)))`` entries of a block of ``n`` elements; 0 if ``n = 0``.

  Examples:
    >>> from pallas_kernels.topk import entries_kept
    >>> entries_kept(512, 0.05), entries_kept(456, 0.05), entries_kept(100, 0.07)
    (26, 23, 7)
  """
  if length == 0:
    return 0
  # Rounded first: 100 * 0.07 is 7.000000000000001 in floats.
  return min(length, max(1, math.ceil(round(length * density, 9))))


def selection_size(size: int, *, density: float, block_size: int) -> int:
  """Number of entries ``block_topk`` keeps from ``size`` elements.

  .. math::
    K = \\lfloor d / D \\rfloor \\operatorname{keep}(D) + \\operatorname{keep}(d \\bmod D),
    \\qquad \\operatorname{keep}(n) = \\min(n, \\max(1, \\lceil n \\cdot density \\rceil)),

  with ``d = size``, ``D = block_size`` and ``keep(0) = 0``.

  Args:
    size: number of elements of the flattened input, ``>= 0``.
    density: fraction of each block kept, in ``(0, 1]``.
    block_size: elements per block, in ``[1, 2**31]``.

  Returns:
    The length of the ``indices`` and ``values`` that ``block_topk`` returns.

  Examples:
    >>> from pallas_kernels.topk import selection_size
    >>> selection_size(1000, density=0.05, block_size=512)  # 26 + ceil(24.4)
    51
  """
  density, block_size = _check_block_params(density, block_size)
  size = static_args.check_int("size", size, 0)
  full_blocks, tail = divmod(size, block_size)
  return full_blocks * entries_kept(block_size, density) + entries_kept(tail, density)


def magnitude_key(x: jax.Array) -> jax.Array:
  """The int32 key that ranks entries: the bits of ``|float32(x)|``.

  Shared by the kernel body and the XLA code. The sign bit is masked in
  uint32 (Mosaic GPU only does bit operations on 32-bit unsigned integers);
  the result is below ``2**31``, so the cast to int32 is exact.
  """
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return (bits & jnp.uint32(0x7FFFFFFF)).astype(jnp.int32)


def _block_parts(flat: jax.Array, *, density: float, block_size: int) -> list[tuple[jax.Array, int]]:
  """The full blocks ``[n, block_size]`` and the tail block ``[1, r]`` of ``flat``, each with its keep."""
  full_blocks, tail = divmod(flat.size, block_size)
  parts = []
  if full_blocks:
    blocks = flat[: full_blocks * block_size].reshape(full_blocks, block_size)
    parts.append((blocks, entries_kept(block_size, density)))
  if tail:
    parts.append((flat[full_blocks * block_size :].reshape(1, tail), entries_kept(tail, density)))
  return parts


def block_topk_reference(x: jax.Array, *, density: float, block_size: int) -> tuple[jax.Array, jax.Array]:
  """``block_topk`` in plain jnp: ``lax.top_k`` of the magnitude keys, block by block.

  ``lax.top_k`` puts the lower index first among equal keys, which is the
  tie rule; the chosen indices are then sorted ascending within each block.
  """
  flat = jnp.asarray(x).reshape(-1)
  indices, values = [], []
  for blocks, keep in _block_parts(flat, density=density, block_size=block_size):
    _, chosen = lax.top_k(magnitude_key(blocks), keep)
    chosen = jnp.sort(chosen, axis=1)
    indices.append(chosen.reshape(-1))
    values.append(jnp.take_along_axis(blocks, chosen, axis=1).reshape(-1))
  if not indices:
    return jnp.zeros((0,), static_args.index_dtype(block_size)), jnp.zeros((0,), flat.dtype)
  return (
    jnp.concatenate(indices).astype(static_args.index_dtype(block_size)),
    jnp.concatenate(values),
  )


def kth_largest_key(count_at_least: Callable[[jax.Array], jax.Array], k: int) -> jax.Array:
  """The k-th largest magnitude key, by bisection on its bits from the top down.

  Keeps the largest ``T`` with ``count_at_least(T) = #{key >= T} >= k``. Shared
  by the kernels, which count over what they hold (rows of a block in
  memory, or a block in registers); shifts are on uint32, as Mosaic GPU
  wants them.
  """

  def bisect(step, threshold):
    bit = lax.shift_left(jnp.uint32(1), (_KEY_BITS - 1 - step).astype(jnp.uint32))
    candidate = threshold + bit.astype(jnp.int32)
    return jnp.where(count_at_least(candidate) >= k, candidate, threshold)

  return lax.fori_loop(0, _KEY_BITS, bisect, jnp.int32(0))


def chosen_by_threshold(keys: jax.Array, threshold: jax.Array, ties: jax.Array) -> jax.Array:
  """The selection along the last axis: keys above ``threshold``, and the first ``ties`` keys equal to it.

  ``threshold`` is the k-th largest key and ``ties = k - #{key > threshold}``
  (broadcast against ``keys``); ties go to the lower index.
  """
  at_threshold = keys == threshold
  tie_rank = jnp.cumsum(at_threshold.astype(jnp.int32), axis=-1)
  return (keys > threshold) | (at_threshold & (tie_rank <= ties))


def _threshold_kernel(x_ref, threshold_ref, ties_ref, *, k: int, rows: int):
  """Per block ``b`` of ``x_ref[n_blocks, rows, 256]``: its k-th largest key and ties.

  Bisection from the top bit down keeps the largest ``T`` with
  ``#{key >= T} >= k``, which is the k-th largest key; ``ties = k - #{key > T}``
  entries equal to ``T`` complete the selection. Every count is a loop over
  the block's rows with a full reduction of each 256-vector.
  """
  block = lax.axis_index("blocks")

  def count(predicate):
    def add_row(row, total):
      keys = magnitude_key(x_ref[block, row])
      return total + jnp.sum(predicate(keys).astype(jnp.int32))

    return lax.fori_loop(0, rows, add_row, jnp.int32(0))

  threshold = kth_largest_key(lambda candidate: count(lambda keys: keys >= candidate), k)
  threshold_ref[block] = threshold
  ties_ref[block] = k - count(lambda keys: keys > threshold)


def _kernel_thresholds(blocks: jax.Array, k: int, *, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Runs ``_threshold_kernel`` on ``blocks[n_blocks, width]``, width a multiple of 256."""
  n_blocks, width = blocks.shape
  rows = width // KERNEL_ROW
  per_block = jax.ShapeDtypeStruct((n_blocks,), jnp.int32)
  kernel = _backend.mosaic_gpu_kernel(
    functools.partial(_threshold_kernel, k=k, rows=rows),
    out_type=(per_block, per_block),
    grid=(n_blocks,),
    grid_names=("blocks",),
    interpret=interpret,
  )
  return kernel(blocks.reshape(n_blocks, rows, KERNEL_ROW))


def _compact(keys: jax.Array, threshold: jax.Array, ties: jax.Array, k: int) -> jax.Array:
  """Ascending block-local indices of each block's selection, from its threshold.

  Takes every key above ``threshold`` and the first ``ties`` keys equal to it
  in index order, and writes their indices densely: a prefix sum gives each
  chosen entry its slot. Runs in XLA because Mosaic GPU has no prefix sum.
  """
  n_blocks, width = keys.shape
  chosen = chosen_by_threshold(keys, threshold[:, None], ties[:, None])
  slot = jnp.cumsum(chosen, axis=1, dtype=jnp.int32) - 1
  # Unchosen entries aim past the last slot and are dropped by the scatter.
  slot = jnp.where(chosen, slot, k)
  block = jnp.arange(n_blocks, dtype=jnp.int32)[:, None]
  position = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), keys.shape)
  return jnp.zeros((n_blocks, k), jnp.int32).at[block, slot].set(position, mode="drop")


def _as_float_key(keys: jax.Array) -> jax.Array:
  """Keys as float32 bit patterns, which ``lax.top_k`` ranks as the integers.

  Non-negative int32 keys are the bits of non-negative floats (a NaN key of a
  positive NaN), and ``lax.top_k`` orders floats totally, by their bits for
  non-negative ones: the same order and ties. XLA:CPU runs ``top_k`` on
  float32 as a partial sort, but on int32 as a full sort.
  """
  return lax.bitcast_convert_type(keys, jnp.float32)


def _candidate_group(width: int, k: int) -> int:
  """Group size for ``_select_xla``'s first stage; 1 when one stage is cheaper.

  The two stages rank ``width / g`` group maxima and ``k g`` candidates,
  least at ``g ~ sqrt(width / k)``; below half of ``width`` (about
  ``density <= 3%``) the two ``lax.top_k`` calls beat one.
  """
  cost, group = min((width // g + k * g, g) for g in (1, 2, 4, 8, 16, 32) if width % g == 0)
  return group if 2 * cost <= width else 1


def _select_xla(blocks: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The ascending indices of each block's selection and their values, in two exact stages.

  The top k entries lie in the k groups of largest maxima: ranking groups
  by (maximum key, lower group first), each of the k entries selected from
  a group outside the top k groups would be outranked by the maxima of
  those k groups (at least as large, and lower indexed when equal), which is
  k entries. Their members, gathered in index order, keep lax.top_k's tie
  rule (the lower position first) equal to the lower index first. The
  values are taken from the gathered members, so the block is read whole
  only once, for the group maxima.
  """
  n_blocks, width = blocks.shape
  group = _candidate_group(width, k)
  if group == 1:
    _, indices = lax.top_k(_as_float_key(magnitude_key(blocks)), k)
    indices = jnp.sort(indices, axis=1)
    return indices, jnp.take_along_axis(blocks, indices, axis=1)
  grouped = blocks.reshape(n_blocks, width // group, group)
  _, top_groups = lax.top_k(_as_float_key(magnitude_key(grouped).max(axis=2)), k)
  top_groups = jnp.sort(top_groups, axis=1)
  candidates = jnp.take_along_axis(grouped, top_groups[:, :, None], axis=1).reshape(n_blocks, k * group)
  # Gathered once: XLA would otherwise gather from the block again for the values.
  candidates = lax.optimization_barrier(candidates)
  _, chosen = lax.top_k(_as_float_key(magnitude_key(candidates)), k)
  # Candidates are in index order, so sorting positions among them sorts the indices.
  chosen = jnp.sort(chosen, axis=1)
  indices = jnp.take_along_axis(top_groups, chosen // group, axis=1) * group + chosen % group
  return indices, jnp.take_along_axis(candidates, chosen, axis=1)


def _select_pallas(blocks: jax.Array, k: int, *, interpret: bool) -> jax.Array:
  # A tail that is not whole rows is zero padded: the padding has the smallest
  # key and the highest indices, so with k <= width it is never selected.
  width = blocks.shape[1]
  padded = jnp.pad(blocks, ((0, 0), (0, -width % KERNEL_ROW)))
  threshold, ties = _kernel_thresholds(padded, k, interpret=interpret)
  return _compact(magnitude_key(blocks), threshold, ties, k)


@functools.partial(jax.jit, static_argnames=("density", "block_size", "implementation"))
def _block_topk(x: jax.Array, *, density: float, block_size: int, implementation: str) -> tuple[jax.Array, jax.Array]:
  index_dtype = static_args.index_dtype(block_size)
  indices, values = [], []
  for blocks, keep in _block_parts(x.reshape(-1), density=density, block_size=block_size):
    if implementation == "xla":
      selected, kept = _select_xla(blocks, keep)
    else:
      selected = _select_pallas(blocks, keep, interpret=implementation == "interpret")
      kept = jnp.take_along_axis(blocks, selected, axis=1)
    indices.append(selected.astype(index_dtype).reshape(-1))
    values.append(kept.reshape(-1))
  if not indices:
    return jnp.zeros((0,), index_dtype), jnp.zeros((0,), x.dtype)
  return jnp.concatenate(indices), jnp.concatenate(values)


def _kernel_unsupported_reason(x: jax.Array, block_size: int) -> str | None:
  if block_size % KERNEL_ROW:
    return (
      f"block_size must be a multiple of {KERNEL_ROW} for the Pallas kernel"
      f" (a block is whole rows of {KERNEL_ROW}); got {block_size}."
      " Use implementation='xla' for other block sizes."
    )
  if jnp.dtype(x.dtype).itemsize > 4:
    return f"x must be a float type of at most 32 bits for the Pallas kernel; got {x.dtype}. Use implementation='xla'."
  return None


def block_topk(
  x: jax.Array,
  *,
  density: float,
  block_size: int,
  implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """The ``density`` fraction of largest magnitudes in every block of ``block_size``.

  With ``x`` flattened to ``d`` elements and cut into blocks of ``D``, block
  ``b`` of ``n`` elements (``n = D``, or ``d mod D`` for the tail) keeps

  .. math::
    S_b = \\operatorname{top\\text{-}keep(n)}_{0 \\le i < n} |x_{bD + i}|,
    \\qquad \\operatorname{keep}(n) = \\min(n, \\max(1, \\lceil n \\cdot density \\rceil)),

  ties toward the lower ``i``. Magnitudes are ranked as float32 with NaNs
  above infinities (see the module docstring).

  Args:
    x: a float array of any shape; it is flattened.
    density: fraction of each block kept, in ``(0, 1]``.
    block_size: elements per block, in ``[1, 2**31]``; the Pallas kernel
      needs a multiple of 256.
    implementation: ``None`` (the op's default, ``dispatch``), ``"xla"``,
      ``"pallas"`` or ``"interpret"``; ``"pallas"`` and ``"interpret"``
      raise for what the kernel cannot do, ``None`` then takes XLA.

  Returns:
    ``(indices, values)``, both of shape ``(selection_size(x.size,
    density=density, block_size=block_size),)``, block-major and within a
    block by ascending index. ``indices`` are block-local (``0 <= i < D``),
    int16 when ``block_size <= 32768`` and int32 above; ``values = x[b * D +
    i]`` keep ``x.dtype`` and their sign.

  Raises:
    ValueError: for ``density`` or ``block_size`` out of range (or traced),
      non-float ``x``, an unknown ``implementation``, or a Pallas
      implementation asked for a block size or dtype the kernel does not
      support.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.topk import block_topk
    >>> x = jnp.array([0.5, -3., 1., 2., -0.25, 4., 0., -1., 7., -7.])
    >>> indices, values = block_topk(x, density=0.5, block_size=4)
    >>> indices
    Array([1, 3, 1, 3, 0], dtype=int16)
    >>> values
    Array([-3.,  2.,  4., -1.,  7.], dtype=float32)

  References:
    Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
    Overhead and Provable Convergence", NeurIPS 2024,
    https://arxiv.org/abs/2405.15593
  """
  density, block_size = _check_block_params(density, block_size)
  x = _float_array(x)
  return dispatch.run(
    "block_topk",
    implementation,
    lambda resolved: _block_topk(x, density=density, block_size=block_size, implementation=resolved),
    unsupported=_kernel_unsupported_reason(x, block_size),
  )


@functools.partial(jax.jit, static_argnames=("size", "density", "block_size"))
def _selection_bounds(indices: jax.Array, values: jax.Array, *, size: int, density: float, block_size: int):
  """Per block (full blocks, then the tail): its smallest selected key ``T``, its last selected index of key ``T``."""
  keys = magnitude_key(values)
  local = indices.astype(jnp.int32)
  thresholds, last_ties, start = [], [], 0
  full_blocks, tail = divmod(size, block_size)
  for count, keep in ((full_blocks, entries_kept(block_size, density)), (int(tail > 0), entries_kept(tail, density))):
    end = start + count * keep
    kept_keys = keys[start:end].reshape(count, keep)
    kept_local = local[start:end].reshape(count, keep)
    start = end
    threshold = kept_keys.min(axis=1, initial=jnp.iinfo(jnp.int32).max)
    thresholds.append(threshold)
    last_ties.append(jnp.max(jnp.where(kept_keys == threshold[:, None], kept_local, -1), axis=1, initial=-1))
  return jnp.concatenate(thresholds), jnp.concatenate(last_ties)


def selection_bounds(
  indices: jax.Array, values: jax.Array, *, size: int, density: float, block_size: int
) -> tuple[jax.Array, jax.Array]:
  """Per block, the rank bound that delimits ``block_topk``'s selection.

  Block ``b``'s selection is exactly the entries ``i`` (block-local) with

  .. math::
    \\mathrm{key}(x_i) > T_b \\;\\text{or}\\; (\\mathrm{key}(x_i) = T_b \\;\\text{and}\\; i \\le L_b),

  ``T_b`` its smallest selected magnitude key (``magnitude_key``) and ``L_b``
  the last selected index of key ``T_b`` (ties go to the lower index).

  Args:
    indices: the block-local indices ``block_topk`` returned for ``x``.
    values: the values ``block_topk`` returned for ``x`` (``x``'s dtype).
    size: ``x.size``.
    density: fraction of each block kept, as given to ``block_topk``.
    block_size: elements per block, as given to ``block_topk``.

  Returns:
    ``(T, L)``, int32 arrays of ``ceil(size / block_size)`` entries, the
    full blocks' then the tail's.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.topk import block_topk, magnitude_key, selection_bounds
    >>> x = jnp.array([0.5, -3., 1., 2., -0.25, 4., 0., -1., 7., -7.])
    >>> indices, values = block_topk(x, density=0.5, block_size=4)
    >>> threshold, last = selection_bounds(indices, values, size=10, density=0.5, block_size=4)
    >>> bool((threshold == magnitude_key(jnp.array([2., 1., 7.]))).all()), last.tolist()
    (True, [3, 3, 0])
  """
  density, block_size = _check_block_params(density, block_size)
  expected = (selection_size(size, density=density, block_size=block_size),)
  if jnp.shape(indices) != expected or jnp.shape(values) != expected:
    raise ValueError(
      f"indices and values must have shape {expected}, as block_topk returns for"
      f" x of size {size}, density={density}, block_size={block_size}; got"
      f" {jnp.shape(indices)} and {jnp.shape(values)}."
    )
  return _selection_bounds(indices, values, size=size, density=density, block_size=block_size)


@functools.partial(jax.jit, static_argnames=("density", "block_size"))
def _zero_selected(
  x: jax.Array, indices: jax.Array, values: jax.Array, *, density: float, block_size: int
) -> jax.Array:
  thresholds, last_ties = _selection_bounds(indices, values, size=x.size, density=density, block_size=block_size)
  masks, start = [], 0
  for blocks, _ in _block_parts(x.reshape(-1), density=density, block_size=block_size):
    end = start + blocks.shape[0]
    threshold, last_tie = thresholds[start:end, None], last_ties[start:end, None]
    start = end
    block_keys = magnitude_key(blocks)
    position = lax.broadcasted_iota(jnp.int32, blocks.shape, 1)
    selected = (block_keys > threshold) | ((block_keys == threshold) & (position <= last_tie))
    masks.append(selected.reshape(-1))
  if not masks:
    return x
  # The masks, not zeroed blocks, are put back together: the result is then a
  # select over x itself, which SPMD partitioning shards like x (zeroed
  # blocks put back together were replicated where blocks do not split over
  # the devices).
  return jnp.where(jnp.concatenate(masks).reshape(x.shape), jnp.zeros((), x.dtype), x)


def zero_selected(x: jax.Array, indices: jax.Array, values: jax.Array, *, density: float, block_size: int) -> jax.Array:
  """``x`` with the entries ``block_topk(x, density=density, block_size=block_size)`` selected set to 0.

  The selection of each block is exactly the keys above its smallest
  selected key ``T`` and the keys equal to ``T`` up to the last selected
  index (ties go to the lower index), so the zeroing is elementwise,

  .. math::
    x_i \\leftarrow 0 \\quad \\text{if} \\quad |x_i| > T_b \\;\\text{or}\\;
    (|x_i| = T_b \\;\\text{and}\\; i \\le i^{\\mathrm{tie}}_b),

  with ``T_b`` and ``i^tie_b`` read from the entries selected in block ``b``
  (magnitudes ranked as in ``block_topk``): the scatter of zeros at the
  selected positions without a scatter, for which XLA would copy ``x`` into
  a new buffer.

  Args:
    x: the float array ``block_topk`` ranked (any shape; flattened).
    indices: the block-local indices ``block_topk`` returned for ``x``.
    values: the values ``block_topk`` returned for ``x``.
    density: fraction of each block kept, as given to ``block_topk``.
    block_size: elements per block, as given to ``block_topk``.

  Returns:
    ``x`` with the selected entries replaced by 0, same shape and dtype.

  Raises:
    ValueError: for ``density`` or ``block_size`` out of range, a non-float
      ``x``, ``values`` of another dtype than ``x``, or ``indices`` and
      ``values`` not of the selection's size.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.topk import block_topk, zero_selected
    >>> x = jnp.array([0.5, -3., 1., 2., -0.25, 4., 0., -1., 7., -7.])
    >>> indices, values = block_topk(x, density=0.5, block_size=4)
    >>> zero_selected(x, indices, values, density=0.5, block_size=4).tolist()
    [0.5, 0.0, 1.0, 0.0, -0.25, 0.0, 0.0, 0.0, 0.0, -7.0]
  """
  density, block_size = _check_block_params(density, block_size)
  x = _float_array(x)
  if jnp.result_type(values) != x.dtype:
    # Thresholds read from rounded values would zero the wrong entries.
    raise ValueError(
      f"values must have x's dtype {x.dtype}, as block_topk returns them; got {jnp.result_type(values)}."
    )
  expected = (selection_size(x.size, density=density, block_size=block_size),)
  if jnp.shape(indices) != expected or jnp.shape(values) != expected:
    raise ValueError(
      f"indices and values must have shape {expected}, as block_topk returns for"
      f" x of size {x.size}, density={density}, block_size={block_size}; got"
      f" {jnp.shape(indices)} and {jnp.shape(values)}."
    )
  return _zero_selected(x, indices, values, density=density, block_size=block_size)


def lowering_examples() -> list[_backend.LoweringExample]:
  """The threshold kernel at MicroAdam's block sizes, at density 1%, with a tail."""
  examples = []
  for block_size, dtype in ((16384, jnp.float32), (28672, jnp.bfloat16)):
    size = 4 * block_size + 1000  # four full blocks and a padded tail block
    fn = functools.partial(block_topk, density=0.01, block_size=block_size, implementation="pallas")
    examples.append(
      _backend.LoweringExample(
        name=f"block_topk_threshold_{block_size}_{jnp.dtype(dtype).name}",
        backend=_backend.MOSAIC_GPU_CALL,
        fn=fn,
        args=(jax.ShapeDtypeStruct((size,), dtype),),
      )
    )
  return examples
