"""Block top-k by magnitude: MicroAdam's sparse gradient selection.

A flat array (any input shape, flattened) of ``d`` elements is cut into
blocks of ``D = block_size`` consecutive elements; the last, tail block of
``r = d mod D`` elements may be shorter. A block of ``n`` elements keeps its

.. math::
  \\operatorname{keep}(n) = \\min(n, \\max(1, \\lceil n \\cdot density \\rceil))

entries of largest ``|x|``: ``k = keep(D)`` per full block and ``keep(r)``
for the tail, as the reference implementation does (``k_block_size_many``
and ``k_block_size_few`` in ``ista_daslab_optimizers/micro_adam/micro_adam.py``
of https://github.com/IST-DASLab/ISTA-DASLab-Optimizers). The
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
own: on a GPU, MicroAdam selects with ``error_feedback.feedback_step``'s
Triton kernel, which reads the error feedback and the gradient once and
ranks by this module's ``magnitude_key``.

References:
  Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
  Overhead and Provable Convergence", NeurIPS 2024,
  https://arxiv.org/abs/2405.15593
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import static_args

# Block-local indices (0 .. block_size - 1) must fit in int32.
MAX_BLOCK_SIZE = 2**31


def check_block_params(density, block_size) -> tuple[float, int]:
  """``(density, block_size)`` as Python numbers, or a ``ValueError`` naming the culprit."""
  density = static_args.check_fraction("density", density)
  block_size = static_args.check_int(
    "block_size", block_size, 1, MAX_BLOCK_SIZE, hint=" (block-local indices fit in int32)"
  )
  return density, block_size


def float_array(x) -> jax.Array:
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
  density, block_size = check_block_params(density, block_size)
  size = static_args.check_int("size", size, 0)
  full_blocks, tail = divmod(size, block_size)
  return full_blocks * entries_kept(block_size, density) + entries_kept(tail, density)


def magnitude_key(x: jax.Array) -> jax.Array:
  """The int32 key that ranks entries: the bits of ``|float32(x)|``.

  Shared by the kernel (``error_feedback.feedback_step``'s) and the XLA
  code. The sign bit is masked in uint32; the result is below ``2**31``, so
  the cast to int32 is exact.
  """
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return (bits & jnp.uint32(0x7FFFFFFF)).astype(jnp.int32)


def block_parts(flat: jax.Array, *, density: float, block_size: int) -> list[tuple[jax.Array, int]]:
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
  for blocks, keep in block_parts(flat, density=density, block_size=block_size):
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
  for blocks, keep in block_parts(x.reshape(-1), density=density, block_size=block_size):
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
  density, block_size = check_block_params(density, block_size)
  return _block_topk(float_array(x), density=density, block_size=block_size)
