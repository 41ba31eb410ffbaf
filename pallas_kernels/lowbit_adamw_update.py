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

Non-finite moments (a NaN or Inf in ``g``) are stored as zero
(:func:`_stored`): that step's direction is non-finite at the element, later
steps restart it from zero moments, and the block's other elements are not
touched. The reference stores them, so that the block's absmax scale is NaN
and the whole block's direction NaN for good; on finite moments the two are
equal bit for bit.

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
written by one load and one store, elementwise in the tensor's shape);
``nu`` is then None. The scales are
float32 of shape ``(*shape[:-1], shape[-1] // block_size, 1)`` when the
blocks tile the last axis (sharded with the tensor's leading axes), else
``(ceil(size / block_size), 1)``. A zero state (codes 0, scales 0) decodes
to exactly zero, as the reference's initial state.

The step is XLA code (:func:`lowbit_adamw_update` is its reference and its
fast path), elementwise in the tensor's shape except for the blocks' absmax.
In a GPU program the new moments are computed twice (:func:`_codes_zero`):
one pass over memory reads ``g`` and both moments' codes for the blocks'
absmax of ``m'`` and ``v'`` (one reduction of the two:
:func:`pallas_kernels.map_codes.map_scales_together`; reduced apart, XLA:GPU
fused ``v'``'s into the second pass on the largest tensors and wrote ``v``'s
codes in a third), a second reads them again and writes the new codes over the old
ones (in place where decoding and encoding are elementwise: float8 and
4-bit codes; 8-bit codes are table reads, whose results XLA:GPU writes to a
new buffer and copies), and no float32 moment is written between them. A Mosaic GPU kernel
holding a block in shared memory moved more bytes than these two passes
(it writes the direction out before the parameters' update reads it), so
there is none.

References:
  Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022
  (https://arxiv.org/abs/2110.02861).
  Li, Chen and Zhu, "Memory Efficient Optimizers with 4-bit States", NeurIPS
  2023 (https://arxiv.org/abs/2309.01507).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import map_codes, static_args
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

  # The tensor's shape: m's codes, uint8 or float8_e4m3fn; in 4bit both
  # moments' codes paired in one uint8 (m's in the low nibble, v's in the high).
  mu_or_paired: jax.Array
  nu: jax.Array | None  # The tensor's shape: v's codes; None for 4bit.
  mu_scales: jax.Array  # float32, (*blocks, 1).
  nu_scales: jax.Array  # float32, (*blocks, 1).

  # What the next tensor's step waits for on XLA:CPU (``xla_cpu.tree_map``):
  # the scales, computed from all the new moments. Not the codes: a wait on
  # them gives their table read a second reader, and XLA writes it out.
  awaited_fields = ("mu_scales", "nu_scales")


def check_state_format(state_format: Any) -> StateFormat:
  """The ``StateFormat`` named ``state_format``, or a ``ValueError`` naming the argument."""
  static_args.check_static("state_format", state_format)
  if not isinstance(state_format, str) or state_format not in STATE_FORMATS:
    raise ValueError(f"state_format must be one of {', '.join(map(repr, STATE_FORMATS))}; got {state_format!r}.")
  return STATE_FORMATS[state_format]


def _paired(state_format: str) -> bool:
  """Whether one byte holds both moments' codes (4-bit)."""
  return state_format == "4bit"


def moment_shapes(shape: tuple[int, ...], *, state_format: str, block_size: int) -> LowbitMoments:
  """The ``jax.ShapeDtypeStruct`` of each field of a tensor's ``LowbitMoments``.

  Examples:
    >>> from pallas_kernels.lowbit_adamw_update import moment_shapes
    >>> shapes = moment_shapes((64, 512), state_format="4bit", block_size=128)
    >>> [a if a is None else (a.shape, a.dtype.name) for a in shapes]
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
  return jnp.where(weight < 0.5, near_start, near_end)


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


def _depending_on(codes: jax.Array, zero: jax.Array) -> jax.Array:
  """``codes``, decoded under ``zero`` (:func:`_codes_zero`): each pass decodes on its own.

  Otherwise XLA:GPU may write the decoded moments out once for both passes
  (8 bytes per element each way) instead of decoding twice.
  """
  if codes.dtype != jnp.uint8:  # float8 codes: decoded by a conversion.
    return codes
  return codes | zero.astype(jnp.uint8)


def _split_codes(moments: LowbitMoments, state_format: str) -> tuple[jax.Array, jax.Array]:
  if _paired(state_format):
    return moments.mu_or_paired & np.uint8(0xF), moments.mu_or_paired >> np.uint8(4)
  return moments.mu_or_paired, moments.nu


def _join_codes(mu_codes: jax.Array, nu_codes: jax.Array, state_format: str) -> tuple[jax.Array, jax.Array]:
  if _paired(state_format):
    return mu_codes | (nu_codes << np.uint8(4)), None
  return mu_codes, nu_codes


def _stored(moment: jax.Array) -> jax.Array:
  """``moment`` as it is stored: a non-finite entry as zero.

  A block's scale is the absmax of its entries: a NaN or Inf would make it
  non-finite, and every code of the block would decode to NaN from then on.
  Stored as zero, the faulty element restarts from zero moments (this step's
  direction, computed from the unstored moments, still shows the fault), and
  its neighbours keep their scale. Finite moments are stored as the
  reference stores them.
  """
  return jnp.where(jnp.isfinite(moment), moment, 0.0)


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

  Returns:
    ``(direction, moments)``: ``u`` in ``grad``'s shape and dtype, and the
    new ``LowbitMoments``.

  Raises:
    ValueError: for an unknown format or block size, or ``moments`` that
      does not fit ``grad``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.lowbit_adamw_update import lowbit_adamw_update, zero_moments
    >>> grad = jnp.linspace(-1.0, 1.0, 512).reshape(2, 256)
    >>> moments = zero_moments(grad.shape, state_format="8bit", block_size=256)
    >>> direction, moments = lowbit_adamw_update(
    ...     grad, moments, count=1, b1=0.9, b2=0.999, eps=1e-8, state_format="8bit", block_size=256)
    >>> bool(jnp.allclose(direction, jnp.sign(grad), atol=1e-4))  # Adam's first step.
    True
    >>> moments.mu_or_paired.dtype, moments.mu_scales.shape
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
  # The step in plain jnp (module docstring).
  state = STATE_FORMATS[state_format]
  shape = grad.shape
  blocks = blocks_shape(shape, block_size)

  def per_element(scales):
    """Each element's scale, in the tensor's shape: decoding and encoding are
    elementwise there, so the codes keep the tensor's layout and sharding."""
    return from_blocks(jnp.broadcast_to(scales, (*blocks, block_size)), shape)

  mu_codes, nu_codes = _split_codes(moments, state_format)

  def new_moments(zero, in_place):
    mu, nu = (
      map_codes.map_decode(_depending_on(codes, zero), per_element(scales), code=code, elementwise=in_place)
      for codes, scales, code in (
        (mu_codes, moments.mu_scales, state.mu_code),
        (nu_codes, moments.nu_scales, state.nu_code),
      )
    )
    return _moments(grad, mu, nu, b1, b2, zero)

  count = jnp.asarray(count)
  # Both moments' blocks' absmax in a first pass (decoding by table reads); the new
  # codes and the direction in a second, elementwise, that XLA:GPU fuses with
  # the parameters' update and that writes the codes in place.
  scales = map_codes.map_scales_together(
    [to_blocks(_stored(x), blocks, block_size) for x in new_moments(_opaque_zero(count), in_place=False)],
    codes=(state.mu_code, state.nu_code),
  )
  mu, nu = new_moments(_codes_zero(count), in_place=True)
  codes = [
    map_codes.map_encode(_stored(x), per_element(s), code=code)
    for x, s, code in ((mu, scales[0], state.mu_code), (nu, scales[1], state.nu_code))
  ]
  direction = adamw_direction(mu, nu, count=count, b1=b1, b2=b2, eps=eps)
  return direction.astype(grad.dtype), LowbitMoments(*_join_codes(*codes, state_format), *scales)
