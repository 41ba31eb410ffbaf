"""Kahan-compensated updates of bfloat16 and float16 parameters.

Rounding ``p + u`` to the nearest bfloat16 drops whatever of ``u`` is below
half the parameter's spacing, step after step. Compensated summation keeps
what was dropped in a buffer ``c`` of the parameter's shape and dtype and
adds it to the next step's update:

.. math::

  x = p + (u + c), \\qquad p' = \\operatorname{RN}(x), \\qquad c' = x - p',

in float32, ``RN`` rounding to nearest in the parameter's dtype. ``x - p'``
is exact in float32 (``p'`` is ``x`` rounded to fewer bits) and at most half
``p'``'s spacing, and ``c'`` keeps it to the dtype's relative precision
(``2**-9`` for bfloat16), so ``p + c`` follows the float32 sum of the updates
deterministically, to about ``2**-17`` of ``|p|``, where stochastic rounding
follows it in expectation with a random error of up to a spacing. The price
is the buffer: 2 bytes per parameter of state, read and written every step
(bfloat16 AdamW's step moves 14 bytes per parameter; with compensation 18).

:func:`kahan_summation` is the last transformation of a chain, as
:func:`~optax_memopt.stochastic_rounding` is: for each bfloat16 or float16
parameter it returns the float32 update with which ``optax.apply_updates``
lands exactly on ``p'`` (``stochastic_rounding``'s module docstring shows
why ``float32(p') - float32(p)`` does), so ``optax.apply_updates`` and
``nnx.Optimizer`` work unchanged. Parameters of other dtypes pass through,
with no buffer.

References:
  Kahan, 1965, Further remarks on reducing truncation errors
  (https://doi.org/10.1145/363707.363723); Zamirai et al., 2020, Revisiting
  BFloat16 Training (https://arxiv.org/abs/2010.06192), which trains
  bfloat16 parameters with Kahan summation and with stochastic rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_memopt import sharding, stochastic_rounding


class KahanSummationState(NamedTuple):
  """State of ``kahan_summation``."""

  # Per parameter: shape of the parameter, its dtype (bfloat16 or float16);
  # optax.MaskedNode() for a parameter of another dtype.
  compensation: optax.Updates

  field_layouts = {"compensation": sharding.Layout.PARAM}


def _compensated(param) -> bool:
  return jnp.result_type(param) in stochastic_rounding.ROUNDED_DTYPES


def kahan_summation() -> optax.GradientTransformation:
  """Turns the updates of bfloat16 and float16 parameters into compensated ones.

  Placed last in a chain. For each parameter ``p`` of dtype bfloat16 or
  float16, its update ``u`` and its compensation ``c`` (zero at first),

  .. math::

    x = p + (u + c), \\qquad p' = \\operatorname{RN}(x), \\qquad
    u' = p' - p, \\qquad c' = x - p',

  in float32, ``RN`` rounding to nearest in ``p``'s dtype, ``c'`` stored in
  it: ``optax.apply_updates(p, u')`` is exactly ``p'`` and ``p' + c'`` is
  the float32 ``p + u + c`` to within ``c'``'s rounding (module docstring).
  Updates of parameters of other dtypes are returned as they are.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` requires ``params``.
    Its state is a ``KahanSummationState``: a buffer shaped like each
    bfloat16 or float16 parameter, in its dtype (2 bytes per such
    parameter), laid out and sharded as the parameter
    (``optax_memopt.state_shardings``).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from optax_memopt import kahan_summation
    >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}  # spacing 2**-7 above 1
    >>> opt = optax.chain(optax.sgd(1.0), kahan_summation())
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.full((2,), -2.0**-10)}  # an eighth of the spacing
    >>> for _ in range(8):
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"].tolist()  # eight eighths: one spacing, where rounding to nearest stays at 1
    [1.0078125, 1.0078125]

  References:
    Kahan, 1965 (https://doi.org/10.1145/363707.363723); Zamirai et al.,
    2020 (https://arxiv.org/abs/2010.06192).
  """

  def init_fn(params):
    return KahanSummationState(
      compensation=jax.tree.map(
        lambda p: jnp.zeros(p.shape, p.dtype) if _compensated(p) else optax.MaskedNode(), params
      )
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("kahan_summation needs params: pass them to update (updates, state = tx.update(g, s, params)).")

    def compensate(update, param, compensation):
      if not _compensated(param):
        return update, compensation
      start = param.astype(jnp.float32)
      total = start + (update.astype(jnp.float32) + compensation.astype(jnp.float32))
      target = total.astype(param.dtype).astype(jnp.float32)
      return stochastic_rounding.update_landing_on(start, target), (total - target).astype(param.dtype)

    flat_updates, treedef = jax.tree.flatten(updates)
    flat_params = treedef.flatten_up_to(params)
    flat_compensation = treedef.flatten_up_to(state.compensation)
    leaves = [compensate(*leaf) for leaf in zip(flat_updates, flat_params, flat_compensation)]
    new_updates = treedef.unflatten([update for update, _ in leaves])
    return new_updates, KahanSummationState(treedef.unflatten([compensation for _, compensation in leaves]))

  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def with_kahan_summation(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """``optax.chain(optimizer, kahan_summation())``: ``optimizer`` for bfloat16 or float16 parameters.

  Examples:
    >>> import optax
    >>> from optax_memopt import with_kahan_summation
    >>> opt = with_kahan_summation(optax.adamw(1e-4))
  """
  return optax.chain(optimizer, kahan_summation())
