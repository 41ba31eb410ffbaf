"""Ternary codes: blockwise absmax quantization to {-1, 0, +1}, packed.

A flat array ``x`` (any input shape, flattened) is cut into blocks of
``block_size`` consecutive elements (the last block may be shorter). Each
block ``b`` keeps one float32 scale, its absmax, and each element one trit:

.. math::
  s_b = \\max_{i \\in b} |x_i|, \\qquad
  \\hat x_i = t_i \\, s_b, \\qquad t_i \\in \\{-1, 0, +1\\}

* deterministic rounding (no key): round to nearest,
  ``t_i = sign(x_i) [2 |x_i| > s_b]``. This is ``round(x_i / s_b)`` in exact
  arithmetic with ties (``|x_i| = s_b / 2``) going to 0 as in round-half-even,
  and it needs no division, so every backend gets the same trits. The error is
  at most ``s_b / 2`` per element.
* stochastic rounding (with a key): ``t_i = sign(x_i) [u_i s_b < |x_i|]``
  with ``u_i`` uniform on ``[0, 1)``, so ``P(t_i = sign(x_i)) = |x_i| / s_b``
  and ``E[t_i s_b] = x_i``: unbiased.

A block of zeros has ``s_b = 0`` and all trits 0. Non-finite inputs give
unspecified results.

Random bits. Mosaic GPU has no random number generator inside kernels, so the
uniforms are a counter-based hash, not ``jax.random``'s stream: one uint32
seed is drawn from ``key`` per call (``jax.random.bits``), and element ``i``
gets ``u_i = (h(seed XOR i) >> 8) / 2**24`` with ``h(x) = y XOR (y >> 16)``,
``y = x * 0x9E3779B1`` (an odd multiplier, 2**32 over the golden ratio): one
multiply and one xor-shift in uint32, plain jnp arithmetic shared by the
kernel body and the XLA code, so both give identical trits for the same key.
The seed is uniform, so each ``u_i`` is exactly uniform over the 2**24 values
and the rounding is unbiased whatever the mixing; one round rather than the
three of a full-avalanche hash (``triple32``) because the hash was a large
share of the step's arithmetic on CPUs. Neighbouring elements get
evenly spread top bits (a Weyl sequence), which only evens out the rounding
of a block. ``h`` is a bijection, so within a call no two elements share
their bits; indices are taken modulo ``2**32``.

Packing (``packing=``), both in the planar layout of
:mod:`pallas_kernels.packing` with codes ``t + 1`` in ``{0, 1, 2}``:

* ``"base3"``: 5 trits per byte (``3**5 = 243 <= 256``), 1.6 bits per element,
  ``packing.pack(codes, base=3, planes=5)``: rows of 640 trits.
* ``"2bit"``: 4 trits per byte, 2 bits per element, cheaper to unpack,
  ``packing.pack(codes, base=4, planes=4)``: rows of 512 trits.

``n`` trits take exactly ``ceil(n / 5)`` or ``ceil(n / 4)`` bytes.

Block sizes. ``block_size`` must be 32, 64 or a positive multiple of 128, so
that each 128-element slice the kernels read holds whole blocks or lies in one
(:mod:`pallas_kernels._ternary_chunks`).

Use. ``ternary_adam`` stores its first moment with this rounding and these
random bits, in its own block-major byte layout
(:mod:`pallas_kernels.ternary_blocks`), through the fused
:mod:`pallas_kernels.ternary_adam_update`. ``ternary_encode`` and
``ternary_decode`` are the codec on its own, in the flat layout: a tensor at
1.6 bits per element plus a scale per block, for instance a gradient sent
between hosts as TernGrad does, or a checkpoint of a moment.

Implementations (``implementation=``):

* ``"xla"``: the reference, in plain jnp.
* ``"pallas"``: Mosaic GPU kernels (``plgpu.kernel``), a grid over runs of
  whole chunks. Encoding computes each chunk's scales, rounds and packs in
  one pass over the input; decoding unpacks and scales in one pass. The last
  partial chunk (and the few chunks that do not fill a grid step) run in XLA
  and are written into the kernel's output in place; chunk boundaries are
  block and row boundaries, so the result is bit-identical to ``"xla"``.
* ``"interpret"``: the same kernels run by the Mosaic GPU interpreter (CPU).
* ``None``: ``"pallas"`` on a Hopper-or-newer GPU, ``"xla"`` elsewhere.

Inputs up to ``2**31 - 1`` elements (the kernels address with int32).

References:
  Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
  Quantization and Encoding", 2017 (https://arxiv.org/abs/1610.02132).
  Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
  Distributed Deep Learning", 2017 (https://arxiv.org/abs/1705.07878).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels import _ternary_chunks as chunks
from pallas_kernels import dispatch
from pallas_kernels import packing
from pallas_kernels import static_args

PACKINGS = ("base3", "2bit")

PLANE_WIDTH = packing.PLANE_WIDTH
# Blocks smaller than a slice of PLANE_WIDTH elements: each slice holds
# PLANE_WIDTH // block_size of them, reduced one masked slice at a time.
_SUB_SLICE_BLOCK_SIZES = (32, 64)
# Dtypes the kernels read directly (converted to float32 in registers);
# other floats are converted to float32 first.
_KERNEL_INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8)


class TernaryArray(NamedTuple):
  """Packed trits and their block scales."""

  packed: jax.Array  # uint8, shape (ceil(size / trits_per_byte),)
  scales: jax.Array  # float32, shape (ceil(size / block_size),)


class _Layout(NamedTuple):
  """How trits are stored: codes ``t + 1`` of ``base`` levels, ``planes`` per element."""

  base: int
  planes: int


_PACKED_LAYOUTS = {
    "base3": _Layout(base=3, planes=5),
    "2bit": _Layout(base=4, planes=4),
}
# ternary_round's output: one trit per int8 element.
_UNPACKED = _Layout(base=3, planes=1)


def check_block_size(block_size: int) -> int:
  """``block_size`` as an ``int``; ``ValueError`` unless it is 32, 64 or a positive multiple of 128."""
  hint = " (32, 64 or a multiple of 128)"
  block_size = static_args.check_int("block_size", block_size, 1, hint=hint)
  if block_size not in _SUB_SLICE_BLOCK_SIZES and block_size % PLANE_WIDTH:
    raise ValueError(f"block_size must be 32, 64 or a positive multiple of 128; got {block_size}.")
  return block_size


def packing_layout(packing_name: str) -> _Layout:
  """The base and planes of packing ``"base3"`` or ``"2bit"``; ``ValueError`` otherwise."""
  if packing_name not in _PACKED_LAYOUTS:
    raise ValueError(f"packing must be one of {PACKINGS}; got {packing_name!r}.")
  return _PACKED_LAYOUTS[packing_name]


def _check_size(size: int) -> int:
  return static_args.check_int("size", size, 0)


def _num_blocks(size: int, block_size: int) -> int:
  return -(-size // block_size)


def _stored_shape(size: int, layout: _Layout) -> jax.ShapeDtypeStruct:
  if layout == _UNPACKED:
    return jax.ShapeDtypeStruct((size,), jnp.int8)
  return jax.ShapeDtypeStruct((packing.packed_size(size, layout.planes),), jnp.uint8)


# Math shared by the kernel bodies and the XLA reference.


def seed_from_key(key: jax.Array) -> jax.Array:
  """The uint32 seed of ``counter_hash_bits`` that one call draws from ``key``."""
  return jax.random.bits(key, (), jnp.uint32)


def counter_hash_bits(seed: jax.Array, index: jax.Array) -> jax.Array:
  """The uint32 random bits of elements ``index``: one multiply-xorshift of ``seed ^ index``.

  Plain uint32 multiply, xor and shift (all Mosaic GPU lowers), so the same
  function runs in kernel bodies and in XLA.
  """
  bits = (index ^ seed) * jnp.uint32(0x9E3779B1)
  return bits ^ (bits >> jnp.uint32(16))


def _uniforms(bits: jax.Array) -> jax.Array:
  """The top 24 bits as a float32 in ``[0, 1)``, exactly representable."""
  # Through int32: the value is below 2**24, and signed conversion lowers everywhere.
  top = (bits >> jnp.uint32(8)).astype(jnp.int32)
  return top.astype(jnp.float32) * jnp.float32(2.0**-24)


def ternary_codes(
    values: jax.Array, scale: jax.Array, bits: jax.Array | None
) -> jax.Array:
  """uint32 codes ``t + 1`` of float32 ``values`` in blocks of absmax ``scale``.

  Deterministic (``bits is None``): ``|t| = [2 |x| > s]``, exact. Stochastic:
  ``|t| = [u s < |x|]`` with ``u`` from ``bits``.
  """
  magnitude = jnp.abs(values)
  if bits is None:
    nonzero = jnp.float32(2) * magnitude > scale
  else:
    nonzero = _uniforms(bits) * scale < magnitude
  signed = jnp.where(values < 0, jnp.uint32(0), jnp.uint32(2))
  return jnp.where(nonzero, signed, jnp.uint32(1))


def _trits_from_codes(codes: jax.Array) -> jax.Array:
  return (codes.astype(jnp.int32) - 1).astype(jnp.int8)


def dequantize_codes(codes: jax.Array, scale: jax.Array) -> jax.Array:
  """``(code - 1) * scale`` in float32."""
  return (codes.astype(jnp.int32) - 1).astype(jnp.float32) * scale


# XLA reference.


def _scale_per_element(scales: jax.Array, size: int, block_size: int) -> jax.Array:
  n_blocks = scales.shape[0]
  return jnp.broadcast_to(scales[:, None], (n_blocks, block_size)).reshape(-1)[:size]


def encode_reference(
    x: jax.Array,
    *,
    block_size: int,
    layout: _Layout,
    seed: jax.Array | None,
    index_offset: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Stored trits (packed, or int8 for ``_UNPACKED``) and scales of flat ``x``.

  ``index_offset`` is the global index of ``x[0]``: a tail encoded on its own
  draws the same random bits as within the whole array.
  """
  values = x.astype(jnp.float32)
  size = values.shape[0]
  n_blocks = _num_blocks(size, block_size)
  magnitude = jnp.pad(jnp.abs(values), (0, n_blocks * block_size - size))
  scales = jnp.max(magnitude.reshape(n_blocks, block_size), axis=1, initial=0.0)
  bits = None
  if seed is not None:
    index = lax.iota(jnp.uint32, size) + jnp.uint32(index_offset)
    bits = counter_hash_bits(seed, index)
  codes = ternary_codes(values, _scale_per_element(scales, size, block_size), bits)
  if layout == _UNPACKED:
    return _trits_from_codes(codes), scales
  return packing.pack(codes, base=layout.base, planes=layout.planes), scales


def decode_reference(
    stored: jax.Array,
    scales: jax.Array,
    *,
    size: int,
    block_size: int,
    layout: _Layout,
    dtype: Any,
) -> jax.Array:
  """Flat ``dtype`` values of ``size`` elements: stored trits times their block scales."""
  codes = packing.unpack(stored, size, base=layout.base, planes=layout.planes)
  return dequantize_codes(codes, _scale_per_element(scales, size, block_size)).astype(dtype)


# Mosaic GPU kernels.


def _encode_kernel(
    *refs,
    geometry: chunks.ChunkGeometry,
    layout: _Layout,
    chunks_per_step: int,
    stochastic: bool,
    interpret: bool,
) -> None:
  """Per chunk: block absmax, rounding, packing of each row's planes."""
  if stochastic:
    x_ref, seed_ref, stored_ref, scales_ref = refs
    seed = seed_ref[0]
  else:
    x_ref, stored_ref, scales_ref = refs
    seed = None
  lane = chunks.lane_indices(interpret)
  first_chunk = lax.axis_index("steps") * chunks_per_step

  def encode_chunk(i):
    chunk = first_chunk + i
    start = chunk * geometry.chunk
    scales = chunks.chunk_absmax(x_ref, start, lane, geometry)
    for k, scale in enumerate(scales):
      scales_ref[chunk * geometry.blocks_per_chunk + k] = scale

    def encode_row(row):
      codes = []
      for plane in range(layout.planes):
        offset = row * geometry.row + plane * PLANE_WIDTH
        values = chunks.load_slice(x_ref, start + offset).astype(jnp.float32)
        bits = None
        if seed is not None:
          bits = counter_hash_bits(seed, (start + offset).astype(jnp.uint32) + lane)
        scale = chunks.slice_scale(scales, offset, lane, geometry)
        codes.append(ternary_codes(values, scale, bits))
      if layout == _UNPACKED:
        trits = _trits_from_codes(codes[0])
        stored_ref[pl.ds(start + row * PLANE_WIDTH, PLANE_WIDTH)] = trits
      else:
        byte = chunk * (geometry.chunk // layout.planes) + row * PLANE_WIDTH
        stored_ref[pl.ds(byte, PLANE_WIDTH)] = packing.combine_planes(codes, layout.base)

    chunks.for_each_index(geometry.rows_per_chunk, encode_row)

  chunks.for_each_index(chunks_per_step, encode_chunk)


def _decode_kernel(
    stored_ref,
    scales_ref,
    out_ref,
    *,
    geometry: chunks.ChunkGeometry,
    layout: _Layout,
    chunks_per_step: int,
    interpret: bool,
) -> None:
  """Per chunk: load the block scales, unpack each row's planes, scale them."""
  lane = chunks.lane_indices(interpret)
  first_chunk = lax.axis_index("steps") * chunks_per_step

  def decode_chunk(i):
    chunk = first_chunk + i
    start = chunk * geometry.chunk
    first_block = chunk * geometry.blocks_per_chunk
    scales = [scales_ref[first_block + k] for k in range(geometry.blocks_per_chunk)]

    def decode_row(row):
      byte = chunk * (geometry.chunk // layout.planes) + row * PLANE_WIDTH
      codes = packing.split_planes(chunks.load_slice(stored_ref, byte), layout.base, layout.planes)
      for plane, plane_codes in enumerate(codes):
        offset = row * geometry.row + plane * PLANE_WIDTH
        scale = chunks.slice_scale(scales, offset, lane, geometry)
        values = dequantize_codes(plane_codes, scale)
        out_ref[pl.ds(start + offset, PLANE_WIDTH)] = values.astype(out_ref.dtype)

    chunks.for_each_index(geometry.rows_per_chunk, decode_row)

  chunks.for_each_index(chunks_per_step, decode_chunk)


def _encode_pallas(
    x: jax.Array,
    *,
    block_size: int,
    layout: _Layout,
    seed: jax.Array | None,
    interpret: bool,
    chunks_per_step: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The encode kernel on whole grid steps of chunks, XLA on the rest."""
  size = x.shape[0]
  geometry = chunks.ChunkGeometry(block_size, layout.planes)
  steps, chunks_per_step = chunks.grid_extent(size, geometry, chunks_per_step)
  if steps == 0:
    return encode_reference(x, block_size=block_size, layout=layout, seed=seed)
  if x.dtype not in _KERNEL_INPUT_DTYPES:
    x = x.astype(jnp.float32)
  kernel = _backend.mosaic_gpu_kernel(
      functools.partial(
          _encode_kernel,
          geometry=geometry,
          layout=layout,
          chunks_per_step=chunks_per_step,
          stochastic=seed is not None,
          interpret=interpret,
      ),
      out_type=(
          _stored_shape(size, layout),
          jax.ShapeDtypeStruct((_num_blocks(size, block_size),), jnp.float32),
      ),
      grid=(steps,),
      grid_names=("steps",),
      interpret=interpret,
  )
  inputs = (x,) if seed is None else (x, seed.reshape(1))
  stored, scales = kernel(*inputs)
  done = steps * chunks_per_step * geometry.chunk
  if done < size:
    tail_stored, tail_scales = encode_reference(
        x[done:], block_size=block_size, layout=layout, seed=seed, index_offset=done
    )
    # In place: the kernel's outputs have no other use.
    stored = lax.dynamic_update_slice(stored, tail_stored, (done // layout.planes,))
    scales = lax.dynamic_update_slice(scales, tail_scales, (done // block_size,))
  return stored, scales


def _decode_pallas(
    stored: jax.Array,
    scales: jax.Array,
    *,
    size: int,
    block_size: int,
    layout: _Layout,
    dtype: Any,
    interpret: bool,
    chunks_per_step: int | None = None,
) -> jax.Array:
  """The decode kernel on whole grid steps of chunks, XLA on the rest."""
  geometry = chunks.ChunkGeometry(block_size, layout.planes)
  steps, chunks_per_step = chunks.grid_extent(size, geometry, chunks_per_step)
  if steps == 0:
    return decode_reference(
        stored, scales, size=size, block_size=block_size, layout=layout, dtype=dtype
    )
  kernel = _backend.mosaic_gpu_kernel(
      functools.partial(
          _decode_kernel,
          geometry=geometry,
          layout=layout,
          chunks_per_step=chunks_per_step,
          interpret=interpret,
      ),
      out_type=jax.ShapeDtypeStruct((size,), dtype),
      grid=(steps,),
      grid_names=("steps",),
      interpret=interpret,
  )
  values = kernel(stored, scales)
  done = steps * chunks_per_step * geometry.chunk
  if done < size:
    tail = decode_reference(
        stored[done // layout.planes :],
        scales[done // block_size :],
        size=size - done,
        block_size=block_size,
        layout=layout,
        dtype=dtype,
    )
    values = lax.dynamic_update_slice(values, tail, (done,))
  return values


# Entry points.


@functools.partial(jax.jit, static_argnames=("block_size", "layout", "implementation"))
def _encode(
    x: jax.Array,
    key: jax.Array | None,
    *,
    block_size: int,
    layout: _Layout,
    implementation: str,
) -> tuple[jax.Array, jax.Array]:
  x = x.reshape(-1)
  seed = None if key is None else seed_from_key(key)
  if implementation == "xla":
    return encode_reference(x, block_size=block_size, layout=layout, seed=seed)
  return _encode_pallas(
      x,
      block_size=block_size,
      layout=layout,
      seed=seed,
      interpret=implementation == "interpret",
  )


@functools.partial(
    jax.jit, static_argnames=("size", "block_size", "layout", "dtype", "implementation")
)
def _decode(
    stored: jax.Array,
    scales: jax.Array,
    *,
    size: int,
    block_size: int,
    layout: _Layout,
    dtype: Any,
    implementation: str,
) -> jax.Array:
  if implementation == "xla":
    return decode_reference(
        stored, scales, size=size, block_size=block_size, layout=layout, dtype=dtype
    )
  return _decode_pallas(
      stored,
      scales,
      size=size,
      block_size=block_size,
      layout=layout,
      dtype=dtype,
      interpret=implementation == "interpret",
  )


def _float_input(x: Any, name: str) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must have a floating dtype; got {x.dtype}.")
  return x


def _check_key(key: Any) -> None:
  if key is not None and not isinstance(key, jax.Array):
    raise ValueError(f"key must be None or a JAX PRNG key; got {type(key).__name__}.")


def ternary_encode(
    x: jax.typing.ArrayLike,
    *,
    block_size: int,
    key: jax.Array | None = None,
    packing: str = "base3",
    implementation: dispatch.Implementation = None,
) -> TernaryArray:
  """Quantizes ``x`` to blockwise-scaled trits and packs them, in one pass.

  .. math::
    s_b = \\max_{i \\in b} |x_i|, \\qquad
    t_i = \\operatorname{sign}(x_i)\\,[2|x_i| > s_b] \\ \\text{(no key)}, \\quad
    P(t_i = \\operatorname{sign}(x_i)) = |x_i| / s_b \\ \\text{(key)}

  Args:
    x: a floating array of any shape; it is flattened.
    block_size: elements per scale block: 32, 64 or a multiple of 128.
    key: ``None`` for deterministic round-to-nearest, or a JAX PRNG key for
      unbiased stochastic rounding. The random bits are a hash of one seed
      drawn from ``key`` and of the element index (see the module docstring),
      not ``jax.random``'s stream, so every implementation agrees.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    A ``TernaryArray``: ``packed`` uint8 of shape ``(ceil(x.size / 5),)``
    (``"base3"``) or ``(ceil(x.size / 4),)`` (``"2bit"``), and ``scales``
    float32 of shape ``(ceil(x.size / block_size),)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.ternary import ternary_decode, ternary_encode
    >>> x = jnp.array([0.9, -0.2, -1.0, 0.6] * 16)
    >>> t = ternary_encode(x, block_size=64)
    >>> t.packed.shape, t.scales.tolist()
    ((13,), [1.0])
    >>> ternary_decode(t, size=64, block_size=64)[:4].tolist()
    [1.0, 0.0, -1.0, 1.0]

  References:
    Wen et al., "TernGrad", 2017 (https://arxiv.org/abs/1705.07878).
  """
  x = _float_input(x, "x")
  check_block_size(block_size)
  layout = packing_layout(packing)
  _check_key(key)
  packed, scales = dispatch.run(
      "ternary",
      implementation,
      lambda resolved: _encode(x, key, block_size=block_size, layout=layout, implementation=resolved),
  )
  return TernaryArray(packed, scales)


def _check_ternary_array(packed, scales, *, size: int, block_size: int, layout: _Layout) -> None:
  """Raises ``ValueError`` unless ``packed`` (and ``scales``, unless None) fit ``size`` elements."""
  expected = (packing.packed_size(size, layout.planes),)
  if packed.shape != expected or packed.dtype != jnp.uint8:
    raise ValueError(
        f"t.packed must be uint8 of shape {expected} for size={size} at"
        f" {layout.planes} trits per byte; got {packed.dtype}{list(packed.shape)}."
    )
  if scales is None:
    return
  expected = (_num_blocks(size, block_size),)
  if scales.shape != expected:
    raise ValueError(
        f"t.scales must have shape {expected} for size={size},"
        f" block_size={block_size}; got {scales.shape}."
    )


def ternary_decode(
    t: TernaryArray,
    *,
    size: int,
    block_size: int,
    packing: str = "base3",
    dtype: Any = jnp.float32,
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """Unpacks ``t`` and scales each trit by its block's scale: ``t_i s_b``.

  Args:
    t: the ``TernaryArray`` of ``size`` elements.
    size: number of encoded elements, ``>= 0``.
    block_size: the block size ``t`` was encoded with.
    packing: the packing ``t`` was encoded with, ``"base3"`` or ``"2bit"``.
    dtype: a floating dtype for the result.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    A flat array of shape ``(size,)`` and dtype ``dtype``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.ternary import ternary_decode, ternary_encode
    >>> t = ternary_encode(jnp.array([0.5, -2.0, 0.0]), block_size=32, packing="2bit")
    >>> ternary_decode(t, size=3, block_size=32, packing="2bit").tolist()
    [0.0, -2.0, 0.0]
  """
  _check_size(size)
  check_block_size(block_size)
  layout = packing_layout(packing)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype; got {dtype!r}.")
  dispatch.check(implementation)
  packed, scales = (jnp.asarray(a) for a in t)
  _check_ternary_array(packed, scales, size=size, block_size=block_size, layout=layout)
  return dispatch.run(
      "ternary",
      implementation,
      lambda resolved: _decode(
          packed,
          scales,
          size=size,
          block_size=block_size,
          layout=layout,
          dtype=jnp.dtype(dtype),
          implementation=resolved,
      ),
  )


def ternary_round(
    x: jax.typing.ArrayLike,
    *,
    block_size: int,
    key: jax.Array | None = None,
    implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """``ternary_encode`` without packing: one int8 trit per element.

  Args:
    x: a floating array of any shape; it is flattened.
    block_size: elements per scale block: 32, 64 or a multiple of 128.
    key: ``None`` (round to nearest) or a JAX PRNG key (stochastic rounding);
      the same trits as ``ternary_encode`` with the same key.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    ``(trits, scales)``: int8 of shape ``(x.size,)`` with values in
    ``{-1, 0, 1}``, float32 of shape ``(ceil(x.size / block_size),)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.ternary import ternary_round
    >>> trits, scales = ternary_round(jnp.array([0.9, -0.2, -1.0, 0.6]), block_size=32)
    >>> trits.tolist(), scales.tolist()
    ([1, 0, -1, 1], [1.0])
  """
  x = _float_input(x, "x")
  check_block_size(block_size)
  _check_key(key)
  return dispatch.run(
      "ternary",
      implementation,
      lambda resolved: _encode(x, key, block_size=block_size, layout=_UNPACKED, implementation=resolved),
  )


def _row_block_size(layout: _Layout) -> int:
  # Trits are values whose blocks have absmax 1 (or 0): deterministic rounding
  # returns them unchanged, so packing is encoding with one block per row.
  return layout.planes * PLANE_WIDTH


def pack_trits(
    trits: jax.typing.ArrayLike,
    *,
    packing: str = "base3",
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """Packs trits in ``{-1, 0, 1}`` (codes ``t + 1``) into the planar layout.

  Runs the encode path on the trits themselves (each block's absmax is 1 or
  0, so rounding returns them unchanged); other values give unspecified
  bytes.

  Args:
    trits: an integer or floating array of any shape with values in
      ``{-1, 0, 1}``; it is flattened.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    uint8 of shape ``(ceil(trits.size / 5),)`` or ``(ceil(trits.size / 4),)``,
    equal to ``packing.pack(trits + 1, base=3, planes=5)`` or
    ``packing.pack(trits + 1, base=4, planes=4)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.ternary import pack_trits, unpack_trits
    >>> packed = pack_trits(jnp.array([1, -1, 0], jnp.int8), packing="2bit")
    >>> packed.shape, unpack_trits(packed, size=3, packing="2bit").tolist()
    ((1,), [1, -1, 0])
  """
  trits = jnp.asarray(trits)
  if not (
      jnp.issubdtype(trits.dtype, jnp.integer) or jnp.issubdtype(trits.dtype, jnp.floating)
  ):
    raise ValueError(f"trits must have an integer or floating dtype; got {trits.dtype}.")
  layout = packing_layout(packing)
  dispatch.check(implementation)
  if trits.dtype != jnp.int8:
    trits = trits.astype(jnp.float32)
  packed, _ = dispatch.run(
      "ternary",
      implementation,
      lambda resolved: _encode(
          trits, None, block_size=_row_block_size(layout), layout=layout, implementation=resolved
      ),
  )
  return packed


def unpack_trits(
    packed: jax.typing.ArrayLike,
    *,
    size: int,
    packing: str = "base3",
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """Inverse of ``pack_trits``: ``size`` int8 trits in ``{-1, 0, 1}``.

  Runs the decode path with every scale 1.

  Args:
    packed: uint8 of shape ``(ceil(size / 5),)`` (``"base3"``) or
      ``(ceil(size / 4),)`` (``"2bit"``).
    size: number of packed trits, ``>= 0``.
    packing: ``"base3"`` or ``"2bit"``.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    int8 of shape ``(size,)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.ternary import pack_trits, unpack_trits
    >>> trits = jnp.array([0, 1, -1, 1, 1, -1], jnp.int8)
    >>> unpack_trits(pack_trits(trits), size=6).tolist()
    [0, 1, -1, 1, 1, -1]
  """
  _check_size(size)
  layout = packing_layout(packing)
  dispatch.check(implementation)
  packed = jnp.asarray(packed)
  _check_ternary_array(packed, None, size=size, block_size=1, layout=layout)
  block_size = _row_block_size(layout)
  ones = jnp.ones((_num_blocks(size, block_size),), jnp.float32)
  return dispatch.run(
      "ternary",
      implementation,
      lambda resolved: _decode(
          packed,
          ones,
          size=size,
          block_size=block_size,
          layout=layout,
          dtype=jnp.dtype(jnp.int8),
          implementation=resolved,
      ),
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """The encode, round and decode kernels, both packings, for ``check_lowering``."""
  # Two base-3 chunks of 256-element blocks and a tail; five 2-bit rows and a tail.
  size = 2 * 1280 + 100
  x = jax.ShapeDtypeStruct((size,), jnp.float32)
  key = jax.random.key(0)
  examples = []
  for name, block_size in (("base3", 256), ("2bit", 64)):
    layout = _PACKED_LAYOUTS[name]
    t = TernaryArray(
        jax.ShapeDtypeStruct((packing.packed_size(size, layout.planes),), jnp.uint8),
        jax.ShapeDtypeStruct((_num_blocks(size, block_size),), jnp.float32),
    )
    examples += [
        _backend.LoweringExample(
            f"ternary_encode_{name}_stochastic",
            _backend.MOSAIC_GPU_CALL,
            functools.partial(
                ternary_encode,
                block_size=block_size,
                key=key,
                packing=name,
                implementation="pallas",
            ),
            (x,),
        ),
        _backend.LoweringExample(
            f"ternary_encode_{name}_nearest",
            _backend.MOSAIC_GPU_CALL,
            functools.partial(
                ternary_encode, block_size=block_size, packing=name, implementation="pallas"
            ),
            (x,),
        ),
        _backend.LoweringExample(
            f"ternary_decode_{name}",
            _backend.MOSAIC_GPU_CALL,
            functools.partial(
                ternary_decode,
                size=size,
                block_size=block_size,
                packing=name,
                implementation="pallas",
            ),
            (t,),
        ),
    ]
  # Enough chunks for several per grid step; bfloat16 read by the kernel.
  long_x = jax.ShapeDtypeStruct((2**24 + 3,), jnp.bfloat16)
  trits = jax.ShapeDtypeStruct((size,), jnp.int8)
  packed = jax.ShapeDtypeStruct((packing.packed_size(size, 5),), jnp.uint8)
  examples += [
      _backend.LoweringExample(
          "ternary_encode_base3_stochastic_long_bfloat16",
          _backend.MOSAIC_GPU_CALL,
          functools.partial(ternary_encode, block_size=128, key=key, implementation="pallas"),
          (long_x,),
      ),
      _backend.LoweringExample(
          "ternary_round_stochastic",
          _backend.MOSAIC_GPU_CALL,
          functools.partial(ternary_round, block_size=32, key=key, implementation="pallas"),
          (x,),
      ),
      _backend.LoweringExample(
          "ternary_pack_trits_2bit",
          _backend.MOSAIC_GPU_CALL,
          functools.partial(pack_trits, packing="2bit", implementation="pallas"),
          (trits,),
      ),
      _backend.LoweringExample(
          "ternary_unpack_trits_base3",
          _backend.MOSAIC_GPU_CALL,
          functools.partial(unpack_trits, size=size, implementation="pallas"),
          (packed,),
      ),
  ]
  return examples
