"""Block top-k of a gradient plus its quantized error feedback: MicroAdam's selection in one read.

MicroAdam adds its error feedback to the gradient and keeps the largest
magnitudes of each block of the sum:

.. math::
  a = y + \\mathrm{dequantize}(q), \\qquad (I, V) = \\text{block-top-}k(|a|),

with ``dequantize`` as in ``pallas_kernels.quantize`` and the selection,
order and ties exactly as ``topk.block_topk`` (block-local indices ascending
within a block, ties toward the lower index). ``feedback_topk_reference`` is
that composition of the two references.

Implementations (``implementation=``):

* ``"xla"``: ``quantize.dequantize_add`` then ``topk.block_topk``, both XLA;
  XLA fuses the decoding into the top-k's reads, but its exact two-stage
  top-k reads ``y`` and the codes twice (group maxima, then the candidate
  groups) and sorts.
* ``"pallas"``: a Triton kernel (``pl.pallas_call``), one program per full
  block held in registers. Mosaic GPU has no prefix sum, which compaction
  needs, so this kernel is Triton's. It decodes and adds, finds the k-th
  largest magnitude key ``T`` by a 31-step bisection on the key bits
  (``topk.magnitude_key``), takes the keys above ``T`` and the first
  ``k - #{key > T}`` keys equal to it in index order, and writes their
  indices and values at slots given by a prefix sum: ``y`` and the codes are
  read once. A tail block (``d mod block_size`` elements) takes the XLA
  path. ``block_size`` and ``bucket_size`` must be
  powers of two (Triton's block shapes), ``block_size >= 256`` a multiple
  of ``bucket_size``.
* ``"interpret"``: the same kernel in Pallas' interpreter (CPU).
* ``None``: ``dispatch.FASTER_ON_HOPPER["feedback_topk"]``.

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
from jax.experimental import pallas as pl

from pallas_kernels import _backend, dispatch, packing, quantize, static_args, topk

# Elements per row of a block as the kernel reads ``y``: one packed 4-bit row.
_ROW = quantize.ROW


def feedback_topk_reference(
  q: quantize.QuantizedArray,
  y: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int,
  bucket_size: int,
) -> tuple[jax.Array, jax.Array]:
  """``feedback_topk`` in plain jnp: the quantizer's and the top-k's references, composed."""
  flat = jnp.asarray(y).reshape(-1)
  codes = packing.unpack(q.codes, flat.size, base=2**bits, planes=8 // bits)
  decoded = quantize.dequantize_reference(codes, q.minimum, q.maximum, bits=bits, bucket_size=bucket_size)
  return topk.block_topk_reference(flat.astype(jnp.float32) + decoded, density=density, block_size=block_size)


def _kernel(y_ref, codes_ref, min_ref, max_ref, indices_ref, values_ref, *, k, bits, bucket_size, discard):
  """One block: ``a = y + decode(codes)``, its top ``k`` by magnitude key, compacted in index order.

  refs: y ``[1, rows, 256]``, codes ``[1, rows, 256 * bits / 8]``, minimum
  and maximum ``[1, buckets per block]``; the outputs indices and values
  ``[blocks * k + 1]``, block ``b`` at ``[b k, (b + 1) k)``. Entries not
  taken are written to the last element, ``discard``, which the wrapper
  drops: Pallas' interpreter ignores the mask of a scattering store.
  """
  block = pl.program_id(0)
  rows = y_ref.shape[1]
  position = lax.broadcasted_iota(jnp.int32, (rows * _ROW,), 0)
  row, lane = position // _ROW, position % _ROW
  if bits == 4:
    byte = codes_ref[0, row, lane % packing.PLANE_WIDTH].astype(jnp.uint32)
    code = jnp.where(lane < packing.PLANE_WIDTH, byte % jnp.uint32(16), byte // jnp.uint32(16))
  else:
    code = codes_ref[0, row, lane].astype(jnp.uint32)
  bucket = position // bucket_size
  decoded = quantize.decode_values(code, min_ref[0, bucket], max_ref[0, bucket], bits=bits)
  x = y_ref[0].reshape(rows * _ROW).astype(jnp.float32) + decoded
  key = topk.magnitude_key(x)
  threshold = topk.kth_largest_key(lambda candidate: jnp.sum((key >= candidate).astype(jnp.int32)), k)
  ties = k - jnp.sum((key > threshold).astype(jnp.int32))
  chosen = topk.chosen_by_threshold(key, threshold, ties)
  slot = jnp.where(chosen, block * k + jnp.cumsum(chosen.astype(jnp.int32)) - 1, discard)
  indices_ref[slot] = position
  values_ref[slot] = x


def _pallas_full_blocks(q, flat, *, full_blocks, k, block_size, bits, bucket_size, interpret):
  """The kernel over the first ``full_blocks`` blocks: int32 indices and float32 values, ``[full_blocks * k]``."""
  from jax.experimental.pallas import triton as pltriton

  rows = block_size // _ROW
  row_bytes = _ROW * bits // 8
  buckets = block_size // bucket_size
  y = flat[: full_blocks * block_size].reshape(full_blocks, rows, _ROW)
  codes = q.codes[: full_blocks * rows * row_bytes].reshape(full_blocks, rows, row_bytes)
  minimum, maximum = (s[: full_blocks * buckets].reshape(full_blocks, buckets) for s in (q.minimum, q.maximum))
  discard = full_blocks * k
  entries = functools.partial(jax.ShapeDtypeStruct, (discard + 1,))
  kernel = pl.pallas_call(
    functools.partial(_kernel, k=k, bits=bits, bucket_size=bucket_size, discard=discard),
    out_shape=(entries(jnp.int32), entries(jnp.float32)),
    grid=(full_blocks,),
    in_specs=[
      pl.BlockSpec((1, rows, _ROW), lambda b: (b, 0, 0)),
      pl.BlockSpec((1, rows, row_bytes), lambda b: (b, 0, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
      pl.BlockSpec((1, buckets), lambda b: (b, 0)),
    ],
    out_specs=(pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)),
    # A block's tensors spread over up to 1024 threads, 16 elements each:
    # the block lives in registers, and fewer threads would each hold more
    # of it and spill more.
    compiler_params=pltriton.CompilerParams(num_warps=max(1, min(32, block_size // 512))),
    interpret=interpret,
  )
  indices, values = kernel(y, codes, minimum, maximum)
  return indices[:discard], values[:discard]


@functools.partial(jax.jit, static_argnames=("density", "block_size", "bits", "bucket_size", "implementation"))
def _feedback_topk(q, y, *, density, block_size, bits, bucket_size, implementation):
  flat = y.reshape(-1)
  if implementation == "xla" or flat.size == 0:
    accumulated = quantize.dequantize_add(q, flat.astype(jnp.float32), bits=bits, bucket_size=bucket_size)
    return topk.block_topk(accumulated, density=density, block_size=block_size)
  full_blocks, tail = divmod(flat.size, block_size)
  indices, values = [], []
  if full_blocks:
    kernel_indices, kernel_values = _pallas_full_blocks(
      q,
      flat,
      full_blocks=full_blocks,
      k=topk.entries_kept(block_size, density),
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      interpret=implementation == "interpret",
    )
    indices.append(kernel_indices.astype(static_args.index_dtype(block_size)))
    values.append(kernel_values)
  if tail:
    # Blocks and buckets start on whole packed rows, so the tail's codes and
    # statistics are a quantized array of their own.
    start = full_blocks * block_size
    tail_q = quantize.QuantizedArray(
      q.codes[start * bits // 8 :], q.minimum[start // bucket_size :], q.maximum[start // bucket_size :]
    )
    tail_indices, tail_values = _feedback_topk(
      tail_q,
      flat[start:],
      density=density,
      block_size=block_size,
      bits=bits,
      bucket_size=bucket_size,
      implementation="xla",
    )
    indices.append(tail_indices)
    values.append(tail_values)
  return jnp.concatenate(indices), jnp.concatenate(values)


def _kernel_unsupported_reason(y: jax.Array, block_size: int, bucket_size: int) -> str | None:
  def power_of_two(n):
    return n & (n - 1) == 0

  if block_size < _ROW or not power_of_two(block_size):
    return (
      f"block_size must be a power of two of at least {_ROW} for the Triton kernel (its block shapes);"
      f" got {block_size}. Use implementation='xla' for other block sizes."
    )
  if not power_of_two(bucket_size) or block_size % bucket_size:
    return (
      f"bucket_size must be a power of two dividing block_size for the Triton kernel; got bucket_size={bucket_size},"
      f" block_size={block_size}. Use implementation='xla' for other sizes."
    )
  if jnp.dtype(y.dtype).itemsize > 4:
    return f"y must be a float type of at most 32 bits for the Triton kernel; got {y.dtype}. Use implementation='xla'."
  return None


def feedback_topk(
  q: quantize.QuantizedArray,
  y: jax.Array,
  *,
  density: float,
  block_size: int,
  bits: int = 4,
  bucket_size: int,
  implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """The block top-k of ``y + dequantize(q)``, ``y`` and the codes read once by the kernel.

  .. math::
    a = y + \\mathrm{dequantize}(q), \\qquad
    S_b = \\operatorname{top\\text{-}keep(n)}_{0 \\le i < n} |a_{bD + i}|,

  computed in float32, each block ``b`` of ``D = block_size`` elements (a
  tail block of ``n = d mod D``) keeping ``keep(n) = min(n, max(1,
  ceil(n * density)))`` entries, ties toward the lower ``i`` (see
  ``topk.block_topk``).

  Args:
    q: the output of ``quantize.quantize`` for ``y.size`` elements.
    y: a float array (float32, bfloat16 or float16) of any shape; flattened.
    density: fraction of each block kept, in ``(0, 1]``.
    block_size: elements per block; the kernel needs a power of two
      ``>= 256``.
    bits: the ``bits`` passed to ``quantize``, 4 or 8.
    bucket_size: the ``bucket_size`` passed to ``quantize``; the kernel
      needs a power of two dividing ``block_size``.
    implementation: ``None`` (the op's default, ``dispatch``), ``"xla"``,
      ``"pallas"`` or ``"interpret"``; the kernel's raise for what it cannot
      do, ``None`` then takes XLA.

  Returns:
    ``(indices, values)`` as ``topk.block_topk(y + dequantize(q))`` returns
    them: block-local indices (int16 for ``block_size <= 32768``),
    block-major and ascending within a block, and the float32 values of
    ``a`` there.

  Raises:
    ValueError: for ``density``, ``block_size``, ``bits`` or
      ``bucket_size`` out of range, a ``q`` that does not match ``y``, a
      non-float ``y``, an unknown ``implementation``, or a kernel asked for
      sizes it does not support.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import quantize
    >>> from pallas_kernels.feedback_topk import feedback_topk
    >>> q = quantize.quantize(jnp.zeros(8), bits=4, bucket_size=32)
    >>> indices, values = feedback_topk(q, jnp.array([0.5, -3., 1., 2., -0.25, 4., 0., -1.]),
    ...                                 density=0.5, block_size=4, bucket_size=32)
    >>> indices, values
    (Array([1, 3, 1, 3], dtype=int16), Array([-3.,  2.,  4., -1.], dtype=float32))

  References:
    Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space
    Overhead and Provable Convergence", NeurIPS 2024,
    https://arxiv.org/abs/2405.15593
  """
  density = static_args.check_fraction("density", density)
  block_size = static_args.check_int("block_size", block_size, 1, topk.MAX_BLOCK_SIZE)
  y = jnp.asarray(y)
  if not jnp.issubdtype(y.dtype, jnp.floating):
    raise ValueError(f"y must have a floating dtype; got {y.dtype}.")
  quantize.check_quantized(q, size=y.size, bits=bits, bucket_size=bucket_size)
  return dispatch.run(
    "feedback_topk",
    implementation,
    lambda resolved: _feedback_topk(
      q, y, density=density, block_size=block_size, bits=bits, bucket_size=bucket_size, implementation=resolved
    ),
    unsupported=_kernel_unsupported_reason(y, block_size, bucket_size),
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """The kernel at MicroAdam's defaults (block 16384, 4-bit buckets of 1024), float32 and bfloat16, with a tail."""
  examples = []
  for dtype in (jnp.float32, jnp.bfloat16):
    size = 4 * 16384 + 1000
    q = quantize.QuantizedArray(
      jax.ShapeDtypeStruct((packing.packed_size(size, 2),), jnp.uint8),
      jax.ShapeDtypeStruct((quantize.num_buckets(size, 1024),), jnp.bfloat16),
      jax.ShapeDtypeStruct((quantize.num_buckets(size, 1024),), jnp.bfloat16),
    )
    fn = functools.partial(feedback_topk, density=0.01, block_size=16384, bucket_size=1024, implementation="pallas")
    examples.append(
      _backend.LoweringExample(
        name=f"feedback_topk_16384_{jnp.dtype(dtype).name}",
        backend=_backend.TRITON_CALL,
        fn=fn,
        args=(q, jax.ShapeDtypeStruct((size,), dtype)),
      )
    )
  return examples
