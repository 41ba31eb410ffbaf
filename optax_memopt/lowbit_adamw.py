"""8-bit, 4-bit and fp8 AdamW: Adam's moments stored as codes with block scales.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022
(https://arxiv.org/abs/2110.02861), and Li, Chen and Zhu, "Memory Efficient
Optimizers with 4-bit States", NeurIPS 2023 (https://arxiv.org/abs/2309.01507),
as implemented by bitsandbytes and torchao (``AdamW8bit``, ``AdamW4bit``,
``AdamWFp8``), whose float32 arithmetic this module reproduces.

Each moment of a tensor of at least ``min_quantized_size`` elements is cut
into blocks of ``block_size`` consecutive elements (the last one may be
shorter); each block keeps its absmax as a float32 scale and each element the
code of the nearest entry of a map, or a float8 number:

* ``adamw_8bit``: bitsandbytes' dynamic maps (signed for ``m``, unsigned for
  ``v``), 256 entries, blocks of 256: 2 + 8/256 = 2.03 bytes per parameter.
* ``adamw_4bit``: a 16-entry signed dynamic map for ``m`` and a linear map
  without zero ``{1/16, ..., 1}`` for ``v`` (a zero code under the square
  root of the denominator would blow up the step), blocks of 128:
  1 + 8/128 = 1.06 bytes per parameter.
* ``adamw_fp8``: float8 e4m3fn with the scale ``absmax / 448``, blocks of
  256: 2.03 bytes per parameter.

Smaller tensors (biases, norm scales) keep float32 moments, as in the
reference: per-block scales would cost as much as the codes save. A model's
state is then about its parameter count times the bytes per parameter above
(float32 AdamW's: 8); ``optax_memopt.state_nbytes`` gives its exact size.

Each step decodes the stored moments, updates them in float32, computes the
direction from the unrounded moments and stores them again, in one pass
(``pallas_kernels.lowbit_adamw_update``). A non-finite moment (from a NaN or
Inf gradient entry) is stored as zero: the step's direction shows the fault at
that element, and its block's scale and other elements stay finite (the
reference's NaN scale would turn the whole block NaN for good).
"""

from __future__ import annotations

import textwrap
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_memopt import hyperparameters, leaves, sharding
from pallas_kernels import lowbit_adamw_update

_ALIASES = {"8bit": "adamw_8bit", "4bit": "adamw_4bit", "fp8": "adamw_fp8"}


class ScaleByLowbitAdamState(NamedTuple):
  """State of ``scale_by_lowbit_adam``: four trees like the parameters, one array per parameter.

  Per parameter of ``d >= min_quantized_size`` elements (``d > 0``), in
  ``n = ceil(d / block_size)`` blocks (shapes and the 4-bit byte layout in
  ``pallas_kernels.lowbit_adamw_update``); per smaller parameter, float32
  moments and None for the scales. A field a parameter has no array for
  holds None (not an empty array, which orbax cannot save).
  """

  count: jax.Array  # shape=(), dtype=jnp.int32; steps taken.
  # The param's shape: m's codes, uint8 (8bit) or float8_e4m3fn (fp8); in
  # 4bit both moments' codes paired in one uint8 (m's in the low nibble, v's in
  # the high nibble); float32 m when small. Release 0.1.0 named it mu
  # (optax_memopt.checkpoint restores its checkpoints).
  mu_or_paired: optax.Updates
  # The param's shape: v's codes, uint8 (8bit) or float8_e4m3fn (fp8); None
  # for 4bit (in mu_or_paired); float32 v when small.
  nu: optax.Updates
  # float32, (*param.shape[:-1], param.shape[-1] // block_size, 1) when blocks
  # tile the last axis, else (n, 1); None when small.
  mu_scales: optax.Updates
  nu_scales: optax.Updates  # As mu_scales.

  field_layouts = {
    "count": sharding.Layout.REPLICATED,
    "mu_or_paired": sharding.Layout.PARAM,
    "nu": sharding.Layout.PARAM,
    "mu_scales": sharding.Layout.BLOCK_SCALES,
    "nu_scales": sharding.Layout.BLOCK_SCALES,
  }


def _check_hyperparameters(b1, b2, eps, state_format, block_size, min_quantized_size):
  hyperparameters.check_decay_rate("b1", b1)
  hyperparameters.check_decay_rate("b2", b2)
  hyperparameters.check_non_negative("eps", eps)
  lowbit_adamw_update.check_state_format(state_format)
  hyperparameters.check_int("block_size", block_size, 1)
  hyperparameters.check_int("min_quantized_size", min_quantized_size, 0)


def scale_by_lowbit_adam(
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  *,
  state_format: str = "8bit",
  block_size: int | None = None,
  min_quantized_size: int = 4096,
) -> optax.GradientTransformation:
  r"""Rescales updates like Adam, with the moments stored in 8 bits, 4 bits or fp8.

  At step :math:`t` with gradient :math:`g`, for each tensor:

  .. math::
    m_t = \mathrm{lerp}(\hat m_{t-1}, g, 1 - \beta_1), \qquad
    v_t = \mathrm{lerp}(\hat v_{t-1}, g^2, 1 - \beta_2),

    u_t = \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon},
    \qquad \hat m_t = Q_m(m_t), \quad \hat v_t = Q_v(v_t),

  where ``lerp`` is torch's (``a + w (b - a)`` for ``w < 0.5``), computed
  in float32, and ``Q`` stores each block of ``block_size`` elements as its
  absmax ``s`` and, per element, the nearest entry of a map to ``x / s``
  (``pallas_kernels.map_codes.map_scales``, ``map_encode``). Tensors below
  ``min_quantized_size`` elements keep float32 ``m`` and ``v`` (``Q`` is the
  identity). The direction uses the unrounded moments of the step.

  Args:
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.
    state_format: ``"8bit"`` (dynamic maps), ``"4bit"`` (dynamic map for
      ``m``, linear map without zero for ``v``) or ``"fp8"`` (float8 e4m3fn).
    block_size: elements per scale, ``>= 1``; None: the format's default
      (256, 128, 256), the reference's.
    min_quantized_size: tensors with fewer elements keep float32 moments
      (4096, as bitsandbytes and torchao).

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: for a hyper-parameter out of range or traced where it fixes
      shapes (``state_format``, ``block_size``, ``min_quantized_size``), and,
      at ``init``, for a parameter that is not real floating point.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_memopt
    >>> opt = optax_memopt.scale_by_lowbit_adam(state_format="4bit")
    >>> params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros((128,))}
    >>> state = opt.init(params)
    >>> state.mu_or_paired["w"].dtype, state.mu_scales["w"].shape, state.mu_or_paired["b"].dtype
    (dtype('uint8'), (64, 1, 1), dtype('float32'))
    >>> updates, state = opt.update({"w": jnp.ones((64, 128)), "b": jnp.ones((128,))}, state)
    >>> bool(jnp.allclose(updates["w"], 1.0, atol=1e-4))  # Adam's first step: sign(g).
    True

  References:
    Dettmers et al., ICLR 2022 (https://arxiv.org/abs/2110.02861); Li, Chen
    and Zhu, NeurIPS 2023 (https://arxiv.org/abs/2309.01507).
  """
  state_spec = lowbit_adamw_update.check_state_format(state_format)
  if block_size is None:
    block_size = state_spec.block_size
  _check_hyperparameters(b1, b2, eps, state_format, block_size, min_quantized_size)
  optimizer_name = _ALIASES[state_format]

  def quantized(param) -> bool:
    return param.size >= min_quantized_size and param.size > 0

  def init_fn(params):
    leaves.check_param_dtypes(params, optimizer_name)

    def init_leaf(param):
      if quantized(param):
        return lowbit_adamw_update.zero_moments(param.shape, state_format=state_format, block_size=block_size)
      # Two buffers: one array in two state leaves cannot be donated.
      mu, nu = (jnp.zeros(param.shape, jnp.float32) for _ in range(2))
      return lowbit_adamw_update.LowbitMoments(mu, nu, None, None)

    per_leaf, treedef = jax.tree.flatten(params)
    fields = zip(*(init_leaf(p) for p in per_leaf)) if per_leaf else [()] * 4
    return ScaleByLowbitAdamState(jnp.zeros([], jnp.int32), *(treedef.unflatten(f) for f in fields))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)

    def update_leaf(grad, mu_or_paired, nu, mu_scales, nu_scales):
      if quantized(grad):
        direction, moments = lowbit_adamw_update.lowbit_adamw_update(
          grad,
          lowbit_adamw_update.LowbitMoments(mu_or_paired, nu, mu_scales, nu_scales),
          count=count,
          b1=b1,
          b2=b2,
          eps=eps,
          state_format=state_format,
          block_size=block_size,
        )
        return direction, moments
      mu, nu = lowbit_adamw_update.adamw_moments(grad, mu_or_paired, nu, count=count, b1=b1, b2=b2)
      direction = lowbit_adamw_update.adamw_direction(mu, nu, count=count, b1=b1, b2=b2, eps=eps)
      return direction.astype(grad.dtype), lowbit_adamw_update.LowbitMoments(mu, nu, mu_scales, nu_scales)

    per_leaf = leaves.map_steps(update_leaf, updates, *state[1:])
    directions, moments = leaves.unzip(updates, per_leaf, 2)
    return directions, ScaleByLowbitAdamState(count, *leaves.unzip(updates, moments, 4))

  # Reshapes into blocks split sharded axes: under explicit mesh axes the
  # update runs with them left to the partitioner, typed like its inputs.
  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def _alias(state_format: str, *, what: str, state_bytes: str, vocabulary: str, reference: str):
  """The alias of ``state_format`` (``adamw_8bit``, ...), documented by ``_ALIAS_DOC``."""
  name = _ALIASES[state_format]
  default_block_size = lowbit_adamw_update.STATE_FORMATS[state_format].block_size

  def alias(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: jax.typing.ArrayLike = 0.0,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    block_size: int = default_block_size,
    min_quantized_size: int = 4096,
  ) -> optax.GradientTransformation:
    hyperparameters.check_learning_rate(learning_rate)
    hyperparameters.check_non_negative("weight_decay", weight_decay)
    hyperparameters.check_mask("mask", mask)
    # None is scale_by_lowbit_adam's "the format's default"; here the default is explicit.
    hyperparameters.check_int("block_size", block_size, 1)
    return optax.chain(
      scale_by_lowbit_adam(
        b1,
        b2,
        eps,
        state_format=state_format,
        block_size=block_size,
        min_quantized_size=min_quantized_size,
      ),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
    )

  alias.__name__ = alias.__qualname__ = name
  alias.__doc__ = _ALIAS_DOC.format(
    what=what,
    fmt=state_format,
    bytes=state_bytes,
    # One paragraph of the docstring, wrapped as the rest of it.
    vocabulary=textwrap.fill(
      "Fine-tuning on text that shows few of the vocabulary's tokens: " + vocabulary, 76, subsequent_indent="  "
    ),
    block=default_block_size,
    name=name,
    reference=reference,
  )
  return alias


_ALIAS_DOC = """AdamW with {what}: ``scale_by_lowbit_adam(state_format={fmt!r})``, weight decay, learning rate.

  ``chain(scale_by_lowbit_adam(b1, b2, eps, state_format={fmt!r}, ...),
  add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``:
  the update is ``-lr * (u + weight_decay * p)``. {bytes} bytes of state per
  parameter (float32 AdamW: 8). The algorithm is in ``scale_by_lowbit_adam``.

  {vocabulary}

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.
    weight_decay: decoupled weight decay.
    mask: which params get weight decay, as in ``optax.adamw``.
    block_size: elements per scale ({block}, the reference's).
    min_quantized_size: tensors with fewer elements keep float32 moments.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {{"w": jnp.full((64, 128), 2.0), "b": jnp.ones((64,))}}
    >>> loss = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"] ** 2)
    >>> opt = optax_memopt.{name}(learning_rate=0.1, weight_decay=1e-4)
    >>> state = opt.init(params)
    >>> for _ in range(50):
    ...   updates, state = opt.update(jax.grad(loss)(params), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> bool(loss(params) < 0.01 * loss({{"w": jnp.full((64, 128), 2.0), "b": jnp.ones((64,))}}))
    True

  References:
    {reference}
  """

adamw_8bit = _alias(
  "8bit",
  what="8-bit moments (bitsandbytes' dynamic maps, blocks of 256)",
  state_bytes="2.03",
  vocabulary="give the embedding and the output head float32 AdamW state with ``optax.partition`` and"
  " :func:`optax_memopt.vocabulary_in_float32`. The head's entries for absent tokens get gradients under 1/1750"
  " of their block's largest, whose squares the 8-bit map stores as 0 while the first moment is kept: steps"
  " hundreds of times AdamW's there. Pre-training, or data that shows the whole vocabulary, does not need it.",
  reference='Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022 (https://arxiv.org/abs/2110.02861).',
)
adamw_4bit = _alias(
  "4bit",
  what="4-bit moments (dynamic map for m, linear map without zero for v, blocks of 128)",
  state_bytes="1.06",
  vocabulary="the second moment's map has no zero, so a tiny second moment is stored as the smallest code, not as"
  " 0, and the step there is smaller than AdamW's, not larger: :func:`optax_memopt.vocabulary_in_float32`,"
  " which 8-bit and fp8 AdamW need there, is not needed.",
  reference='Li, Chen and Zhu, "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023 (https://arxiv.org/abs/2309.01507).',
)
adamw_fp8 = _alias(
  "fp8",
  what="float8 e4m3fn moments (scale absmax / 448, blocks of 256)",
  state_bytes="2.03",
  vocabulary="give the embedding and the output head float32 AdamW state with ``optax.partition`` and"
  " :func:`optax_memopt.vocabulary_in_float32`. e4m3 stores values under 2**-9 / 448 = 4.4e-6 of the block's"
  " absmax as 0: the squared gradients of tokens the text never shows, while their first moment is kept, which"
  " makes steps hundreds of times AdamW's there. Pre-training, or data that shows the whole vocabulary, does not"
  " need it.",
  reference="torchao's ``AdamWFp8`` (https://github.com/pytorch/ao, torchao/optim).",
)
