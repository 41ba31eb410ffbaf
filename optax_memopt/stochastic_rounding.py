"""Stochastic rounding of the parameter update, for bfloat16 and float16 parameters.

bfloat16 keeps 8 significant bits: at a weight of 0.02 its spacing is 6e-5,
about one AdamW step at a fine-tuning learning rate, so rounding ``p + u`` to
the nearest bfloat16 loses most small updates and training stalls.
Stochastic rounding (Gupta et al., 2015) rounds ``x`` to one of its two
neighbours ``lo <= x < hi`` in the parameter's format,

.. math::

  \\operatorname{SR}(x) = \\begin{cases} hi & \\text{with probability } (x - lo) / (hi - lo), \\\\
  lo & \\text{otherwise,} \\end{cases}
  \\qquad \\mathbb{E}[\\operatorname{SR}(x)] = x,

so the parameters follow the float32 trajectory in expectation, and a
sequence of updates far below the spacing moves them as their sum would
(Zamirai et al., 2020: bfloat16 parameters with stochastic rounding train
as float32 ones; torchao's optimizers offer it as ``bf16_stochastic_round``).

:func:`stochastic_rounding` is the last transformation of a chain: given the
parameters, it returns for each bfloat16 or float16 parameter ``p`` the
update ``u'`` with which ``optax.apply_updates(p, u')`` lands exactly on
``t = SR(float32(p) + float32(u))``. ``optax.apply_updates`` and
``nnx.Optimizer`` work unchanged; in a jitted step XLA fuses the rounding
into the parameter update (no pass of its own, no float32 copy of the
parameters in memory).

The update is float32 (for a bfloat16 or float16 parameter):
``u' = float32(t) - float32(p)``. ``optax.apply_updates`` computes
``(p + u').astype(p.dtype)``, here ``p + u'`` in float32. Why exactly ``t``:

* When ``t - p`` is a float32 number, ``p + u' = t`` exactly, and the cast
  back is exact. Two numbers of 8 (bfloat16) or 11 (float16) significant
  bits whose exponents differ by at most 15 (resp. 12) have a difference of
  at most 24 significant bits: this covers every update smaller than the
  parameter by fewer than 15 binades and every larger one.
* When ``|p|`` is below ``2**-15 |t|`` (an update that jumps far beyond a
  small parameter: a zero-initialized bias's first step), ``u'`` and then
  ``p + u'`` are each rounded to float32, two errors of at most ``2**-24 |t|``,
  far inside ``t``'s rounding interval (``2**-9 |t|``): the cast returns ``t``.
* When ``|t|`` is far below ``|p|`` (the update cancels the parameter),
  ``float32(p) + float32(u)`` is exact (Sterbenz's lemma: ``u`` is within a
  factor 2 of ``-p``) and keeps the bits of ``p``'s and ``u``'s grids, on
  which ``t`` falls too; ``t - p = u + (t - x)`` is then a float32 number.

``tests/test_stochastic_rounding.py`` checks this for every finite bfloat16
``p`` against targets spread over all exponents. A bfloat16 update would not
do: the difference of two bfloat16 numbers need not be one (``p = 1``,
``t = 2**-20``), and ``p + u'`` would be rounded to bfloat16.

bfloat16 rounding is the bit trick of torchao's ``_fp32_to_bf16_sr``: add 16
uniform random bits to the low half of the float32 bit pattern, then clear
it; the carry into the high half happens with probability equal to the
remainder, exactly (the remainder is those 16 bits). float16 rounding
compares a uniform of 24 bits with the remainder ``(x - lo) / (hi - lo)``.
Non-finite values stay as they are; values beyond the largest finite
float16 round as to nearest. Parameters of other dtypes (float32, float64)
pass through: their updates are returned as they are. Where the platform
flushes float32 subnormals to zero (XLA:CPU does), so do the sums and
differences above: parameters and targets below about ``2**-118`` in
magnitude (bfloat16's exponent range is float32's) may land on a flushed
value instead.

The float32 update is never written to memory when the optimizer's update
and ``optax.apply_updates`` are in one jitted step: XLA fuses the rounding,
the subtraction and the addition into the parameter's update pass. A step
that returns the updates from one ``jit`` and applies them in another
writes and reads them as float32 (4 bytes per parameter, against a
bfloat16 update's 2). What each optimizer keeps in bfloat16 and in float32
for bfloat16 parameters is in ``README.md`` ("bfloat16 parameters").

The random bits come from a key kept in the state, as ternary Adam's do:
split every step into the next key and the step's key, which draws one
uint32 seed per parameter; each element's bits are an integer hash of its
row-major index and that seed (:func:`element_bits`). A run replays exactly
from the same seed. The hash, unlike ``jax.random.bits`` over the
parameter's shape, is a few integer operations that XLA fuses into the
update on every backend (threefry's 20 rounds left 16 bytes of temporaries
per parameter in an XLA:CPU step) and compiles in no time.

References:
  Gupta et al., 2015, Deep Learning with Limited Numerical Precision
  (https://arxiv.org/abs/1502.02551); Zamirai et al., 2020, Revisiting
  BFloat16 Training (https://arxiv.org/abs/2010.06192); torchao,
  ``torchao/optim/quant_utils.py`` (``_fp32_to_bf16_sr``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_memopt import hyperparameters, sharding

#: Parameter dtypes whose updates are rounded stochastically.
ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class StochasticRoundingState(NamedTuple):
  """State of ``stochastic_rounding``."""

  count: jax.typing.ArrayLike  # shape=(), dtype=jnp.int32.
  key: jax.Array  # uint32 key data of the rounding key, shape of the key's impl.

  field_layouts = {"count": sharding.Layout.REPLICATED, "key": sharding.Layout.REPLICATED}


def element_bits(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform random uint32 bits for each element of an array of ``shape``.

  Wellons' ``lowbias32`` integer hash (two multiply-xorshift rounds, full
  avalanche) of ``index ^ seed``, ``index`` the element's row-major index:
  a sum of per-axis iotas, so the SPMD partitioner computes each device's
  part in place. Indices wrap past ``2**32`` elements.

  Args:
    seed: a uint32 scalar.
    shape: the array's shape.
  """
  index = jnp.zeros(shape, jnp.uint32)
  for axis in range(len(shape)):
    stride = jnp.uint32(math.prod(shape[axis + 1 :]) % 2**32)
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * stride
  bits = index ^ seed
  bits = (bits ^ (bits >> 16)) * jnp.uint32(0x7FEB352D)
  bits = (bits ^ (bits >> 15)) * jnp.uint32(0x846CA68B)
  return bits ^ (bits >> 16)


def round_stochastically(x: jax.Array, bits: jax.Array, dtype) -> jax.Array:
  """``x`` (float32) rounded to ``dtype`` (bfloat16 or float16), up with probability equal to the remainder.

  Args:
    x: float32 values.
    bits: uniform random uint32 of ``x``'s shape.
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.

  Returns:
    ``dtype`` values: each ``x`` rounded to one of its two neighbours in
    ``dtype``, the larger with probability ``(x - lo) / (hi - lo)``; ``x``
    itself where it is a ``dtype`` number or not finite.
  """
  dtype = jnp.dtype(dtype)
  x = x.astype(jnp.float32)
  if dtype == jnp.bfloat16:
    pattern = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type((pattern + (bits >> 16)) & jnp.uint32(0xFFFF0000), jnp.float32)
    # The carry could turn a NaN's payload into the sign bit.
    return jnp.where(jnp.isnan(x), x, rounded).astype(dtype)
  if dtype != jnp.float16:
    raise ValueError(f"dtype must be bfloat16 or float16; got {dtype.name}.")
  nearest = x.astype(dtype)
  other = jnp.nextafter(nearest, jnp.where(nearest.astype(jnp.float32) > x, -jnp.inf, jnp.inf).astype(dtype))
  lo, hi = jnp.minimum(nearest, other), jnp.maximum(nearest, other)
  # Both differences are exact in float32 (neighbouring float16 numbers).
  remainder = (x - lo.astype(jnp.float32)) / (hi.astype(jnp.float32) - lo.astype(jnp.float32))
  uniform = (bits >> 8).astype(jnp.float32) * 2.0**-24
  rounded = jnp.where(uniform < remainder, hi, lo)
  return jnp.where((nearest.astype(jnp.float32) == x) | ~jnp.isfinite(nearest), nearest, rounded)


def update_landing_on(start: jax.Array, target: jax.Array) -> jax.Array:
  """The float32 update with which ``optax.apply_updates`` takes a parameter from ``start`` exactly to ``target``.

  Args:
    start: the parameter (bfloat16 or float16) in float32.
    target: its new value, a number of the parameter's dtype, in float32.

  Returns:
    ``target - start`` (exact where it matters: the module docstring), 0
    where the two are equal (an infinite parameter would otherwise get
    ``inf - inf = NaN``).
  """
  return jnp.where(target == start, 0.0, target - start)


def stochastic_rounding(seed: int | jax.Array = 0) -> optax.GradientTransformation:
  """Turns the updates of bfloat16 and float16 parameters into stochastically rounded ones.

  Placed last in a chain. For each parameter ``p`` of dtype bfloat16 or
  float16 and its update ``u``, the returned update is the float32

  .. math::

    u' = t - p, \\qquad t = \\operatorname{SR}(p + u),

  with ``p + u`` in float32 and ``SR`` rounding to ``p``'s dtype, up with
  probability equal to the remainder (module docstring), so that
  ``optax.apply_updates(p, u')`` is exactly ``t`` and ``E[t] = p + u``.
  Updates of parameters of any other dtype are returned as they are.

  Args:
    seed: an int seed or a JAX PRNG key (typed, or legacy uint32 of shape
      ``(2,)``) for the rounding, kept in the state.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` requires ``params``.
    Its state is a ``StochasticRoundingState``: a step count and the key's
    uint32 data (8 bytes for the default threefry key), replicated under
    ``optax_memopt.state_shardings``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from optax_memopt import stochastic_rounding
    >>> params = {"w": jnp.full((4096,), 1.0, jnp.bfloat16)}  # spacing 2**-7 above 1
    >>> opt = optax.chain(optax.sgd(1.0), stochastic_rounding(seed=0))
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.full((4096,), -2.0**-9, jnp.float32)}  # a quarter of the spacing
    >>> updates, state = opt.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)["w"]
    >>> sorted(set(new.tolist()))  # each entry rounded up with probability 1/4
    [1.0, 1.0078125]
    >>> abs(float(jnp.mean(new.astype(jnp.float32))) - (1 + 2**-9)) < 3e-4
    True

  References:
    Gupta et al., 2015 (https://arxiv.org/abs/1502.02551); Zamirai et al.,
    2020 (https://arxiv.org/abs/2010.06192).
  """
  initial_key = hyperparameters.typed_key("seed", seed)
  key_impl = jax.random.key_impl(initial_key)

  def init_fn(params):
    del params
    return StochasticRoundingState(count=jnp.zeros([], jnp.int32), key=jax.random.key_data(initial_key))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "stochastic_rounding needs params: pass them to update (updates, state = tx.update(g, s, params))."
      )
    next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=key_impl))
    flat_updates, treedef = jax.tree.flatten(updates)
    flat_params = treedef.flatten_up_to(params)
    # Each seed a scalar of its own, as in ternary Adam (XLA:GPU's sibling
    # fusion would merge the passes of leaves that read one shared array).
    seeds = jax.lax.optimization_barrier(list(jax.random.bits(step_key, (len(flat_updates),), jnp.uint32)))

    def round_leaf(update, param, seed):
      if jnp.result_type(param) not in ROUNDED_DTYPES:
        return update
      bits = element_bits(seed, param.shape)
      start = param.astype(jnp.float32)
      target = round_stochastically(start + update.astype(jnp.float32), bits, param.dtype).astype(jnp.float32)
      return update_landing_on(start, target)

    rounded = [round_leaf(*leaf) for leaf in zip(flat_updates, flat_params, seeds)]
    new_state = StochasticRoundingState(count=optax.safe_increment(state.count), key=jax.random.key_data(next_key))
    return treedef.unflatten(rounded), new_state

  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def with_stochastic_rounding(
  optimizer: optax.GradientTransformation, seed: int | jax.Array = 0
) -> optax.GradientTransformation:
  """``optax.chain(optimizer, stochastic_rounding(seed))``: ``optimizer`` for bfloat16 or float16 parameters.

  Examples:
    >>> import optax
    >>> from optax_memopt import with_stochastic_rounding
    >>> opt = with_stochastic_rounding(optax.adamw(1e-4), seed=0)
  """
  return optax.chain(optimizer, stochastic_rounding(seed))
