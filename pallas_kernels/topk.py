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
by its float32 rounding.

``block_topk_reference`` states the selection in a few lines (``lax.top_k``
per block). ``block_topk`` is the same selection tuned for XLA:
``lax.top_k`` sees the keys as float32 bit patterns (the same order;
XLA:CPU's partial-sort top-k is for floats only), and at low density runs in
two exact stages: the top ``k`` groups of ``g`` entries by their maximum
key, then the top ``k`` of those ``k g`` candidates. It has no kernel of its
own: on a GPU, MicroAdam selects with ``feedback_topk``'s Triton kernel,
which reads the error feedback and the gradient once and uses this module's
selection rule (``kth_largest_key``, ``chosen_by_threshold``).

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

from pallas_kernels import static_args

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

  Shared by the kernels (``feedback_topk``, ``quantize.requantize_unselected``)
  and the XLA code. The sign bit is masked in uint32 (Mosaic GPU only does
  bit operations on 32-bit unsigned integers); the result is below
  ``2**31``, so the cast to int32 is exact.
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

  Keeps the largest ``T`` with ``count_at_least(T) = #{key >= T} >= k``, by
  31 counts over what the caller holds (``feedback_topk``'s kernel: a block
  in registers); shifts are on uint32.
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


@functools.partial(jax.jit, static_argnames=("density", "block_size"))
def _block_topk(x: jax.Array, *, density: float, block_size: int) -> tuple[jax.Array, jax.Array]:
  index_dtype = static_args.index_dtype(block_size)
  indices, values = [], []
  for blocks, keep in _block_parts(x.reshape(-1), density=density, block_size=block_size):
    selected, kept = _select_xla(blocks, keep)
    indices.append(selected.astype(index_dtype).reshape(-1))
    values.append(kept.reshape(-1))
  if not indices:
    return jnp.zeros((0,), index_dtype), jnp.zeros((0,), x.dtype)
  return jnp.concatenate(indices), jnp.concatenate(values)


def block_topk(
  x: jax.Array,
  *,
  density: float,
  block_size: int,
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
    block_size: elements per block, in ``[1, 2**31]``.

  Returns:
    ``(indices, values)``, both of shape ``(selection_size(x.size,
    density=density, block_size=block_size),)``, block-major and within a
    block by ascending index. ``indices`` are block-local (``0 <= i < D``),
    int16 when ``block_size <= 32768`` and int32 above; ``values = x[b * D +
    i]`` keep ``x.dtype`` and their sign.

  Raises:
    ValueError: for ``density`` or ``block_size`` out of range (or traced),
      or non-float ``x``.

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
  return _block_topk(_float_array(x), density=density, block_size=block_size)


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
