r"""One step of 8-bit, 4-bit or fp8 AdamW for one tensor: decode, update, re-encode.

The moments ``m`` and ``v`` of a tensor are stored as codes with one absmax
scale per block of ``block_size`` consecutive elements of the flattened
tensor (:func:`pallas_kernels.map_codes.map_scales`, ``map_encode``; the last block may be
shorter). One step reads the gradient ``g`` and the stored moments once,
and writes the new codes, scales and the direction once:

.. math::

  m' = \mathrm{lerp}(\hat m, g, 1 - \beta_1), \qquad
  v' = \mathrm{lerp}(\hat v, g^2, 1 - \beta_2), \qquad
  u = \frac{m' / (1 - \beta_1^t)}{\sqrt{v'} / \sqrt{1 - \beta_2^t} + \epsilon},

with ``m_hat``, ``v_hat`` the decoded stored moments and torch's
``lerp(a, b, w)`` (``a + w (b - a)`` for ``w < 0.5``, else
``b - (b - a)(1 - w)``), all in float32 as in the reference (torchao's
``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``). The direction uses this step's
unrounded ``m'``, ``v'``; only the stored moments are rounded.

State formats (:data:`STATE_FORMATS`):

=========  =========================  ==========================  =====
format     ``m`` code                 ``v`` code                  block
=========  =========================  ==========================  =====
``8bit``   dynamic, signed, 256       dynamic, unsigned, 256      256
``4bit``   dynamic, signed, 16        linear ``{1/16, ..., 1}``   128
``fp8``    float8 e4m3fn, scale/448   float8 e4m3fn, scale/448    256
=========  =========================  ==========================  =====

Layout (:func:`moment_shapes`): the codes of ``m`` and ``v`` have the
tensor's own shape (uint8, or float8_e4m3fn for ``fp8``), so they shard
like the tensor. In ``4bit`` one uint8 holds both codes of an element (``m``
in the low nibble, ``v`` in the high nibble: one byte per element, read and
written by one load and one store, and no pairing of neighbours, which
Mosaic GPU cannot do); ``nu`` is then None. The scales are
float32 of shape ``(*shape[:-1], shape[-1] // block_size, 1)`` when the
blocks tile the last axis (sharded with the tensor's leading axes), else
``(ceil(size / block_size), 1)``. A zero state (codes 0, scales 0) decodes
to exactly zero, as the reference's initial state.

Implementations (``implementation=``):

* ``"xla"``: :func:`lowbit_adamw_update_reference`. In a GPU program the
  new moments are computed twice (:func:`_codes_zero`): one pass over
  memory reads ``g`` and the codes for the blocks' absmax and the direction,
  a second reads them again and writes the codes, and no float32 moment is
  written between them.
* ``"pallas"``: one Mosaic GPU kernel (``plgpu.kernel``), one program per
  block: per row of the block it decodes both moments, updates them, writes
  the direction and keeps the new moments in shared memory, then, once the
  block's new absmax is known, encodes them in a second pass over the rows. Gathers from a
  table do not lower in Mosaic GPU, so the nearest map entry is found by a
  scan over the map's entries (compare and select per entry), which is
  compute-heavy for 256-entry maps. ``block_size`` must be a multiple of
  128 (whole rows); a shorter last block runs in the reference and is
  joined to the kernel's blocks by XLA. Every product is rounded on its own
  (:func:`_rounded`) and divisions are true divisions, so the stored
  moments equal the reference's bit for bit; the direction takes the square
  root as ``x * rsqrt(x)`` (Mosaic GPU on JAX 0.10 has no ``sqrt``) and
  agrees to a few float32 ulps.
* ``"interpret"``: the same kernel in the Mosaic GPU interpreter (CPU).
* ``None``: ``"xla"`` until the kernel measures faster on a Hopper GPU
  (``dispatch.FASTER_ON_HOPPER``).

References:
  Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022
  (https://arxiv.org/abs/2110.02861).
  Li, Chen and Zhu, "Memory Efficient Optimizers with 4-bit States", NeurIPS
  2023 (https://arxiv.org/abs/2309.01507).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _backend
from pallas_kernels import dispatch
from pallas_kernels import map_codes
from pallas_kernels import static_args
from pallas_kernels.blocks import blocks_shape, from_blocks, to_blocks


class StateFormat(NamedTuple):
  """How a format codes ``m`` and ``v``: names of ``map_codes`` codes, and its default block."""

  mu_code: str
  nu_code: str
  block_size: int


STATE_FORMATS: dict[str, StateFormat] = {
    "8bit": StateFormat("dynamic_8bit_signed", "dynamic_8bit_unsigned", 256),
    "4bit": StateFormat("dynamic_4bit_signed", "linear_4bit_unsigned", 128),
    "fp8": StateFormat(map_codes.FLOAT8_CODE, map_codes.FLOAT8_CODE, 256),
}


class LowbitMoments(NamedTuple):
  """The stored moments of one tensor (shapes in the module docstring)."""

  mu: jax.Array  # The tensor's shape: m's codes (4bit: m's and v's), uint8 or float8_e4m3fn.
  nu: jax.Array | None  # The tensor's shape: v's codes; None for 4bit.
  mu_scales: jax.Array  # float32, (*blocks, 1).
  nu_scales: jax.Array  # float32, (*blocks, 1).


def check_state_format(state_format: Any) -> StateFormat:
  """The ``StateFormat`` named ``state_format``, or a ``ValueError`` naming the argument."""
  static_args.check_static("state_format", state_format)
  if not isinstance(state_format, str) or state_format not in STATE_FORMATS:
    raise ValueError(
        f"state_format must be one of {', '.join(map(repr, STATE_FORMATS))}; got {state_format!r}."
    )
  return STATE_FORMATS[state_format]


def _paired(state_format: str) -> bool:
  """Whether one byte holds both moments' codes (4-bit)."""
  return state_format == "4bit"


def moment_shapes(shape: tuple[int, ...], *, state_format: str, block_size: int) -> LowbitMoments:
  """The ``jax.ShapeDtypeStruct`` of each field of a tensor's ``LowbitMoments``.

  Examples:
    >>> from pallas_kernels.lowbit_adamw_update import moment_shapes
    >>> [a if a is None else (a.shape, a.dtype.name) for a in moment_shapes((64, 512), state_format="4bit", block_size=128)]
    [((64, 512), 'uint8'), None, ((64, 4, 1), 'float32'), ((64, 4, 1), 'float32')]
    >>> moment_shapes((100, 30), state_format="8bit", block_size=256).mu_scales.shape
    (12, 1)
  """
  state = check_state_format(state_format)
  block_size = static_args.check_int("block_size", block_size, 1)
  shape = tuple(shape)
  scales = jax.ShapeDtypeStruct((*blocks_shape(shape, block_size), 1), jnp.float32)
  codes = jax.ShapeDtypeStruct(shape, map_codes.code_dtype(state.mu_code))
  nu = None if _paired(state_format) else codes
  return LowbitMoments(codes, nu, scales, scales)


def zero_moments(shape: tuple[int, ...], *, state_format: str, block_size: int) -> LowbitMoments:
  """Moments that decode to zero: codes 0 and scales 0."""
  shapes = moment_shapes(shape, state_format=state_format, block_size=block_size)
  return LowbitMoments(*(None if a is None else jnp.zeros(a.shape, a.dtype) for a in shapes))


# Elementwise math shared by the kernel body and the reference.


def _rounded(x: jax.Array, zero: jax.Array) -> jax.Array:
  """``x`` as computed, rounded to float32: never fused into a following add.

  XLA and LLVM contract a multiply feeding an add into one fused
  multiply-add, which rounds once instead of twice and so differs from the
  reference (torch on the CPU rounds every operation) in the last bit, which
  can flip a code. An OR with ``zero``, an int32 zero the compiler cannot
  see through, makes the product a value of its own.
  """
  bits = lax.bitcast_convert_type(x, jnp.int32) | zero
  return lax.bitcast_convert_type(bits, jnp.float32)


def _opaque_zero(count: Any) -> jax.Array:
  """An int32 zero computed from the step count (``>= 1``), for :func:`_rounded`."""
  return jnp.minimum(jnp.asarray(count).astype(jnp.int32), 0)


def _lerp(start: jax.Array, end: jax.Array, weight: Any, zero: jax.Array) -> jax.Array:
  """torch's ``lerp``: the formula from the nearer end, so weights near 1 stay exact."""
  diff = end - start
  near_start = start + _rounded(weight * diff, zero)
  near_end = end - _rounded(diff * (1 - weight), zero)
  if isinstance(weight, (float, np.floating)):
    return near_start if weight < 0.5 else near_end
  # The weight compared per element (a vector predicate), which Mosaic GPU
  # on JAX 0.12 selects with where it does not broadcast a scalar one.
  return jnp.where(zero.astype(jnp.float32) + weight < 0.5, near_start, near_end)


def _one_minus(rate: Any) -> Any:
  """``1 - rate`` in float32: computed in float64 and rounded for Python numbers, as the reference."""
  if isinstance(rate, (int, float, np.number)) and not isinstance(rate, bool):
    return np.float32(1 - float(rate))
  return 1 - jnp.asarray(rate, jnp.float32)


def _bias_corrections(count: Any, b1: Any, b2: Any) -> tuple[jax.Array, jax.Array]:
  """``1 - b1**t`` and ``sqrt(1 - b2**t)`` in float32."""
  t = jnp.asarray(count).astype(jnp.float32)
  b1, b2 = (jnp.asarray(b, jnp.float32) for b in (b1, b2))
  return 1 - b1**t, jnp.sqrt(1 - b2**t)


def _direction(mu, nu_root, bias_correction_1, root_bias_correction_2, eps) -> jax.Array:
  return (mu / bias_correction_1) / (nu_root / root_bias_correction_2 + eps)


def adamw_moments(
    grad: jax.Array, mu: jax.Array, nu: jax.Array, *, count: Any, b1: Any, b2: Any
) -> tuple[jax.Array, jax.Array]:
  """The reference's float32 moment update: ``lerp(mu, g, 1 - b1)``, ``lerp(nu, g**2, 1 - b2)``.

  For moments kept in float32 (tensors below an optimizer's size threshold);
  the quantized step applies it to the decoded moments. Every product is
  rounded on its own, as in the reference, when ``count`` is an array (as in
  an optimizer's state); a Python ``count`` lets the compiler fuse them.
  """
  return _moments(grad, mu, nu, b1, b2, _opaque_zero(count))


def _moments(grad, mu, nu, b1, b2, zero) -> tuple[jax.Array, jax.Array]:
  g = grad.astype(jnp.float32)
  return (
      _lerp(_rounded(mu, zero), g, _one_minus(b1), zero),
      _lerp(_rounded(nu, zero), _rounded(g * g, zero), _one_minus(b2), zero),
  )


def adamw_direction(mu: jax.Array, nu: jax.Array, *, count: Any, b1: Any, b2: Any, eps: Any) -> jax.Array:
  """``(mu / (1 - b1**t)) / (sqrt(nu) / sqrt(1 - b2**t) + eps)`` in float32."""
  return _direction(mu, jnp.sqrt(nu), *_bias_corrections(count, b1, b2), eps)


def _codes_zero(count: jax.Array) -> jax.Array:
  """The zero under which the reference computes the moments it encodes.

  A block's codes need its absmax, so they are written in a second pass over
  memory. In a GPU program this zero is one that XLA cannot tell equal to
  :func:`_opaque_zero`'s: the moments are then computed twice, and XLA decodes
  and updates again in the pass that writes the codes (reading ``g`` and the
  codes again) rather than writing float32 moments out and reading them back.
  Elsewhere it is the same zero, and the moments are computed once: XLA:CPU's
  step is bound by the table reads of decoding, not by memory.
  """
  recomputed = lambda count: _opaque_zero(count >> 1)  # count >= 1: count >> 1 >= 0.
  return lax.platform_dependent(count, cuda=recomputed, rocm=recomputed, default=_opaque_zero)


def _split_codes(moments: LowbitMoments, state_format: str) -> tuple[jax.Array, jax.Array]:
  if _paired(state_format):
    return moments.mu & np.uint8(0xF), moments.mu >> np.uint8(4)
  return moments.mu, moments.nu


def _join_codes(mu_codes: jax.Array, nu_codes: jax.Array, state_format: str) -> tuple[jax.Array, jax.Array]:
  if _paired(state_format):
    return mu_codes | (nu_codes << np.uint8(4)), None
  return mu_codes, nu_codes


def lowbit_adamw_update_reference(
    grad: jax.Array,
    moments: LowbitMoments,
    *,
    count: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    state_format: str,
    block_size: int,
) -> tuple[jax.Array, LowbitMoments]:
  """The step in plain jnp (see the module docstring); also the ``"xla"`` implementation."""
  state = STATE_FORMATS[state_format]
  shape = grad.shape
  blocks = blocks_shape(shape, block_size)

  def per_element(scales):
    """Each element's scale, in the tensor's shape: decoding and encoding are
    elementwise there, so the codes keep the tensor's layout and sharding."""
    return from_blocks(jnp.broadcast_to(scales, (*blocks, block_size)), shape)

  mu_codes, nu_codes = _split_codes(moments, state_format)

  def new_moments(zero):
    mu = map_codes.map_decode(mu_codes, per_element(moments.mu_scales), code=state.mu_code)
    nu = map_codes.map_decode(nu_codes, per_element(moments.nu_scales), code=state.nu_code)
    return _moments(grad, mu, nu, b1, b2, zero)

  count = jnp.asarray(count)
  mu, nu = new_moments(_opaque_zero(count))
  scales = [
      map_codes.map_scales(to_blocks(x, blocks, block_size), code=code)
      for x, code in ((mu, state.mu_code), (nu, state.nu_code))
  ]
  codes = [
      map_codes.map_encode(x, per_element(s), code=code)
      for x, s, code in zip(new_moments(_codes_zero(count)), scales, (state.mu_code, state.nu_code))
  ]
  direction = adamw_direction(mu, nu, count=count, b1=b1, b2=b2, eps=eps)
  return direction.astype(grad.dtype), LowbitMoments(*_join_codes(*codes, state_format), *scales)


def _describe(array: Any) -> str:
  return "None" if array is None else f"{array.dtype}{list(array.shape)}"


def lowbit_adamw_update(
    grad: jax.Array,
    moments: LowbitMoments,
    *,
    count: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    state_format: str,
    block_size: int,
    implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, LowbitMoments]:
  r"""One step of low-bit AdamW for one tensor: the direction and the new stored moments.

  .. math::
    m' = \mathrm{lerp}(\hat m, g, 1 - \beta_1), \quad
    v' = \mathrm{lerp}(\hat v, g^2, 1 - \beta_2), \quad
    u = \frac{m' / (1 - \beta_1^t)}{\sqrt{v'} / \sqrt{1 - \beta_2^t} + \epsilon}

  and ``m'``, ``v'`` stored again as codes with block absmax scales.

  Args:
    grad: the gradient, any shape, a floating dtype (math in float32).
    moments: the stored moments (:func:`moment_shapes`, :func:`zero_moments`).
    count: the step ``t``, 1-based.
    b1: decay of ``m``, in ``[0, 1)``.
    b2: decay of ``v``, in ``[0, 1)``.
    eps: added to the denominator.
    state_format: ``"8bit"``, ``"4bit"`` or ``"fp8"``.
    block_size: elements per scale.
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``
      (module docstring).

  Returns:
    ``(direction, moments)``: ``u`` in ``grad``'s shape and dtype, and the
    new ``LowbitMoments``.

  Raises:
    ValueError: for an unknown format, a block size, implementation or
      ``moments`` that does not fit ``grad``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.lowbit_adamw_update import lowbit_adamw_update, zero_moments
    >>> grad = jnp.linspace(-1.0, 1.0, 512).reshape(2, 256)
    >>> moments = zero_moments(grad.shape, state_format="8bit", block_size=256)
    >>> direction, moments = lowbit_adamw_update(
    ...     grad, moments, count=1, b1=0.9, b2=0.999, eps=1e-8, state_format="8bit", block_size=256)
    >>> bool(jnp.allclose(direction, jnp.sign(grad), atol=1e-4))  # Adam's first step.
    True
    >>> moments.mu.dtype, moments.mu_scales.shape
    (dtype('uint8'), (2, 1, 1))
  """
  grad = jnp.asarray(grad)
  if not jnp.issubdtype(grad.dtype, jnp.floating):
    raise ValueError(f"grad must have a floating dtype; got {grad.dtype}.")
  expected = moment_shapes(grad.shape, state_format=state_format, block_size=block_size)
  if not isinstance(moments, LowbitMoments):
    raise ValueError(f"moments must be a LowbitMoments; got {type(moments).__name__}.")
  for name, actual, wanted in zip(LowbitMoments._fields, moments, expected):
    if (actual is None) != (wanted is None) or (
        wanted is not None and (actual.shape != wanted.shape or actual.dtype != wanted.dtype)
    ):
      raise ValueError(
          f"moments.{name} must be {_describe(wanted)} for a gradient of shape"
          f" {grad.shape}, state_format={state_format!r} and block_size={block_size}; got"
          f" {_describe(actual)}."
      )
  args = dict(count=count, b1=b1, b2=b2, eps=eps, state_format=state_format, block_size=block_size)

  def path(resolved: str) -> tuple[jax.Array, LowbitMoments]:
    if resolved == "xla":
      return lowbit_adamw_update_reference(grad, moments, **args)
    return _kernel_step(grad, moments, interpret=resolved == "interpret", **args)

  return dispatch.run("lowbit_adamw_update", implementation, path)


# -- the Mosaic GPU kernel ---------------------------------------------------------

# Elements per kernel row: the lanes of one vector load.
KERNEL_ROW = 128
_GRID_AXIS = "blocks"
# Order of the scalars in the kernel's hyper-parameter input.
_W1, _W2, _BIAS_CORRECTION_1, _ROOT_BIAS_CORRECTION_2, _EPS, _FLOAT8_MAX = range(6)


def kernel_unsupported_reason(block_size: int) -> str | None:
  """Why the kernel cannot run blocks of ``block_size`` elements, or None."""
  if block_size % KERNEL_ROW:
    return (
        f"block_size must be a multiple of {KERNEL_ROW} for implementation='pallas' or"
        f" 'interpret' (the kernel reads blocks as rows of {KERNEL_ROW}); got {block_size}."
    )
  return None


def _kernel_decode(codes: jax.Array, scale: jax.Array, code: str, table_ref: Any, zero: jax.Array) -> jax.Array:
  """``map[codes] * scale`` by a scan over the map (Mosaic GPU has no gather)."""
  if code == map_codes.FLOAT8_CODE:
    return _rounded(codes.astype(jnp.float32) * scale, zero)
  index = codes.astype(jnp.int32)

  def select(j, entry):
    return jnp.where(index == j, table_ref[j], entry)

  # Carries start from the loaded zeros: a constant vector has another
  # layout in Mosaic GPU than the loop's results.
  entry = lax.fori_loop(1, map_codes.CODE_MAPS[code].size, select, zero.astype(jnp.float32) + table_ref[0])
  return _rounded(entry * scale, zero)


def _kernel_encode(values: jax.Array, scale: jax.Array, code: str, table_ref: Any, zero: jax.Array) -> jax.Array:
  """Codes of ``values / scale``: :func:`map_codes.nearest_map_code_reference` by a scan over the map.

  The last entry ``<= x`` (0 below the first) counts the entries above the
  first that are ``<= x``; the entry above it is the smallest one ``> x``.
  """
  # A true division by the scale also in the interpreter, where XLA would
  # multiply by the scale's reciprocal: the divisor is an array of its own.
  ratio = values / _rounded(jnp.broadcast_to(scale, values.shape), zero)
  if code == map_codes.FLOAT8_CODE:
    return ratio.astype(jnp.float8_e4m3fn)
  size = map_codes.CODE_MAPS[code].size

  def compare(j, carry):
    index, below, above = carry
    entry = table_ref[j]
    at_or_below = ratio >= entry
    return (
        index + at_or_below.astype(jnp.int32),
        jnp.where(at_or_below, entry, below),
        jnp.where(at_or_below, above, jnp.minimum(above, entry)),
    )

  start = (zero, zero.astype(jnp.float32) + table_ref[0], zero.astype(jnp.float32) + table_ref[size - 1])
  index, below, above = lax.fori_loop(1, size, compare, start)
  up = ratio - below >= (above - below) * 0.5
  return jnp.where(up, jnp.minimum(index + 1, size - 1), index).astype(jnp.uint8)


def _kernel_sqrt(x: jax.Array) -> jax.Array:
  """``sqrt`` as ``x * rsqrt(x)`` (Mosaic GPU on JAX 0.10 has no sqrt), 0 where ``x`` is."""
  return jnp.where(x != 0, x * lax.rsqrt(x), 0.0)


def _step_kernel(*refs: Any, state_format: str, rows: int) -> None:
  """One program: one block of ``rows`` rows of 128 elements.

  refs: hyper-parameters ``[6]``, zeros ``[128]`` int32, the maps of ``m``
  and ``v`` (map codes only), grad, m's codes, v's codes (not paired),
  m's and v's scales ``[blocks, 1]``; then the outputs direction, codes,
  scales; then two float32 scratch buffers ``[rows, 128]`` for the new
  moments between the two passes.
  """
  state = STATE_FORMATS[state_format]
  paired = _paired(state_format)
  uses_maps = state.mu_code != map_codes.FLOAT8_CODE
  refs = list(refs)
  hyper_ref, zero_ref = refs.pop(0), refs.pop(0)
  mu_table_ref, nu_table_ref = (refs.pop(0), refs.pop(0)) if uses_maps else (None, None)
  grad_ref, mu_ref = refs.pop(0), refs.pop(0)
  nu_ref = None if paired else refs.pop(0)
  mu_scale_ref, nu_scale_ref, direction_ref, mu_out_ref = refs[:4]
  refs = refs[4:]
  nu_out_ref = None if paired else refs.pop(0)
  mu_scale_out_ref, nu_scale_out_ref, mu_buffer, nu_buffer = refs
  b = lax.axis_index(_GRID_AXIS)
  zero = zero_ref[...]
  w1, w2 = hyper_ref[_W1], hyper_ref[_W2]
  bias_correction_1, root_bias_correction_2 = hyper_ref[_BIAS_CORRECTION_1], hyper_ref[_ROOT_BIAS_CORRECTION_2]
  eps = hyper_ref[_EPS]
  mu_scale, nu_scale = mu_scale_ref[b, 0], nu_scale_ref[b, 0]

  def update_row(r, absmax):
    if paired:
      byte = mu_ref[b, r].astype(jnp.uint32)
      mu_codes, nu_codes = byte & jnp.uint32(0xF), byte >> jnp.uint32(4)
    else:
      mu_codes, nu_codes = mu_ref[b, r], nu_ref[b, r]
    g = grad_ref[b, r].astype(jnp.float32)
    mu = _lerp(_kernel_decode(mu_codes, mu_scale, state.mu_code, mu_table_ref, zero), g, w1, zero)
    nu = _lerp(_kernel_decode(nu_codes, nu_scale, state.nu_code, nu_table_ref, zero), _rounded(g * g, zero), w2, zero)
    mu_buffer[r] = mu
    nu_buffer[r] = nu
    direction = _direction(mu, _kernel_sqrt(nu), bias_correction_1, root_bias_correction_2, eps)
    direction_ref[b, r] = direction.astype(direction_ref.dtype)
    return jnp.maximum(absmax[0], jnp.abs(mu)), jnp.maximum(absmax[1], jnp.abs(nu))

  start = zero.astype(jnp.float32)
  mu_absmax, nu_absmax = lax.fori_loop(0, rows, update_row, (start, start))
  scales = []
  for absmax, code, out_ref in ((mu_absmax, state.mu_code, mu_scale_out_ref), (nu_absmax, state.nu_code, nu_scale_out_ref)):
    scale = jnp.maximum(jnp.max(absmax), map_codes.MAP_ZERO_BLOCK_SCALE)
    if code == map_codes.FLOAT8_CODE:
      # 448 read from an input: a division by a constant would be compiled
      # as a multiplication by its inexact reciprocal.
      scale = scale / hyper_ref[_FLOAT8_MAX]
    out_ref[b, 0] = scale
    scales.append(scale)

  def encode_row(r, carry):
    mu_codes = _kernel_encode(mu_buffer[r], scales[0], state.mu_code, mu_table_ref, zero)
    nu_codes = _kernel_encode(nu_buffer[r], scales[1], state.nu_code, nu_table_ref, zero)
    if paired:
      byte = mu_codes.astype(jnp.uint32) | (nu_codes.astype(jnp.uint32) << jnp.uint32(4))
      mu_out_ref[b, r] = byte.astype(jnp.uint8)
    else:
      mu_out_ref[b, r] = mu_codes
      nu_out_ref[b, r] = nu_codes
    return carry

  lax.fori_loop(0, rows, encode_row, 0)


def _kernel_hyperparameters(count: Any, b1: Any, b2: Any, eps: Any) -> jax.Array:
  bias_correction_1, root_bias_correction_2 = _bias_corrections(count, b1, b2)
  return jnp.stack(
      [
          jnp.asarray(x, jnp.float32)
          for x in (
              _one_minus(b1), _one_minus(b2), bias_correction_1, root_bias_correction_2, eps,
              map_codes.FLOAT8_MAX,
          )
      ]
  )


def _kernel_step(
    grad: jax.Array,
    moments: LowbitMoments,
    *,
    count: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    state_format: str,
    block_size: int,
    interpret: bool,
) -> tuple[jax.Array, LowbitMoments]:
  """The kernel over the whole blocks; a shorter last block in the reference."""
  reason = kernel_unsupported_reason(block_size)
  if reason is not None:
    raise ValueError(reason)
  state = STATE_FORMATS[state_format]
  paired = _paired(state_format)
  shape, size = grad.shape, grad.size
  reference = functools.partial(
      lowbit_adamw_update_reference,
      count=count, b1=b1, b2=b2, eps=eps, state_format=state_format, block_size=block_size,
  )
  n_blocks, tail = divmod(size, block_size)
  if not n_blocks:  # All of it is the shorter last block.
    return reference(grad, moments)
  whole = n_blocks * block_size
  rows = block_size // KERNEL_ROW
  flat = lambda x: x.reshape(-1)
  as_rows = lambda x: flat(x)[:whole].reshape(n_blocks, rows, KERNEL_ROW)
  as_scales = lambda x: flat(x)[:n_blocks].reshape(n_blocks, 1)
  code_type = jax.ShapeDtypeStruct((n_blocks, rows, KERNEL_ROW), moments.mu.dtype)
  scale_type = jax.ShapeDtypeStruct((n_blocks, 1), jnp.float32)
  out_type = [jax.ShapeDtypeStruct((n_blocks, rows, KERNEL_ROW), grad.dtype), code_type]
  out_type += ([] if paired else [code_type]) + [scale_type, scale_type]
  from jax.experimental.pallas import mosaic_gpu as plgpu

  kernel = _backend.mosaic_gpu_kernel(
      functools.partial(_step_kernel, state_format=state_format, rows=rows),
      out_type=tuple(out_type),
      grid=(n_blocks,),
      grid_names=(_GRID_AXIS,),
      interpret=interpret,
      scratch_types=[plgpu.SMEM((rows, KERNEL_ROW), jnp.float32)] * 2,
  )
  inputs = [_kernel_hyperparameters(count, b1, b2, eps), _opaque_zero(count) + jnp.zeros((KERNEL_ROW,), jnp.int32)]
  if state.mu_code != map_codes.FLOAT8_CODE:
    inputs += [jnp.asarray(map_codes.CODE_MAPS[state.mu_code]), jnp.asarray(map_codes.CODE_MAPS[state.nu_code])]
  inputs += [as_rows(grad), as_rows(moments.mu)] + ([] if paired else [as_rows(moments.nu)])
  inputs += [as_scales(moments.mu_scales), as_scales(moments.nu_scales)]
  outputs = list(kernel(*inputs))
  direction, mu = outputs.pop(0), outputs.pop(0)
  nu = None if paired else outputs.pop(0)
  mu_scales, nu_scales = outputs
  new = [flat(direction), flat(mu), None if paired else flat(nu), flat(mu_scales), flat(nu_scales)]
  if tail:
    tail_direction, tail_moments = reference(
        flat(grad)[whole:],
        LowbitMoments(
            flat(moments.mu)[whole:],
            None if paired else flat(moments.nu)[whole:],
            flat(moments.mu_scales)[n_blocks:].reshape(1, 1),
            flat(moments.nu_scales)[n_blocks:].reshape(1, 1),
        ),
    )
    new = [
        None if part is None else jnp.concatenate([part, flat(extra)])
        for part, extra in zip(new, [tail_direction, *tail_moments])
    ]
  direction, *fields = new
  expected = moment_shapes(shape, state_format=state_format, block_size=block_size)
  return direction.reshape(shape), LowbitMoments(
      *(None if x is None else x.reshape(e.shape) for x, e in zip(fields, expected))
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """The fused step for each format, with a tail block and blocks of two rows."""

  def example(name, shape, grad_dtype, state_format, block_size):
    grad = jax.ShapeDtypeStruct(shape, grad_dtype)
    moments = moment_shapes(shape, state_format=state_format, block_size=block_size)

    def fn(grad, moments):
      return lowbit_adamw_update(
          grad, moments, count=jnp.int32(3), b1=0.9, b2=0.999, eps=1e-8,
          state_format=state_format, block_size=block_size, implementation="pallas",
      )

    return _backend.LoweringExample(name, _backend.MOSAIC_GPU_CALL, fn, (grad, moments))

  return [
      example("lowbit_adamw_update_8bit_256_tail", (4, 600), jnp.float32, "8bit", 256),
      example("lowbit_adamw_update_4bit_128", (3, 512), jnp.bfloat16, "4bit", 128),
      example("lowbit_adamw_update_fp8_256", (2, 1024), jnp.float32, "fp8", 256),
  ]
