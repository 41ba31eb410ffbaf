"""The fused ternary-Adam step against the formulas, and its implementations against the reference.

Expectations are written here in numpy from the documented math and layout:
the step's moment, ``nu`` and direction; the scale bound; stochastic rounding
with the documented counter hash ``u = (h(seed ^ i) >> 8) / 2**24``,
``h(x) = y ^ (y >> 16)``, ``y = x * 0x9E3779B1 mod 2**32``; and the
block-major bytes ``sum_p base**p (t[j + p w] + 1)``. The plain-jnp
``ternary_adam_update_reference`` and the XLA path must give the same trits,
scales and ``nu`` exactly and directions to float32 rounding. Inputs are
drawn fresh; the seed is in every failure message. The byte layout itself is
tested in ``test_ternary.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ternary
from pallas_kernels.ternary_adam_update import (
  ternary_adam_update,
  ternary_adam_update_reference,
)
from tests import oracles

pytestmark = pytest.mark.kernels

# With these decays and the dyadic inputs of _inputs, the new moment and nu
# are exact in float32 however XLA fuses or contracts their arithmetic (fused
# multiply-adds differ between jit, eager and the interpreter, and between
# JAX versions), so trits, scales and nu can be compared bit for bit.
B1, B2, EPS, COUNT = 0.5, 0.75, 1e-8, 3
# A few float32 ulps: divisions and square roots that XLA's fused code may
# evaluate with other approximations than the reference's.
DIRECTION_RTOL = 2e-6


def _decode(packed, scales, size, block_size, packing) -> np.ndarray:
  """Trits times their block scales, from the documented block-major bytes (float64)."""
  base, planes = oracles.LAYOUTS[packing]
  packed = np.asarray(packed, np.int64)
  width = packed.shape[-1]
  packed = packed.reshape(-1, 1, width)
  codes = packed // base ** np.arange(planes)[:, None] % base
  codes = codes.reshape(packed.shape[0], planes * width)[:, :block_size].reshape(-1)[:size]
  return (codes - 1) * np.repeat(np.asarray(scales, np.float64).reshape(-1), block_size)[:size]


def _inputs(seed, shape, *, block_size, packing, grad_dtype=jnp.float32):
  """A gradient, a stored moment with spread-out scales (and a zero block), and nu.

  Values are multiples of 2**-8 (the gradient below 8 in magnitude, so that
  ``g**2 / 4`` keeps its bits), for exact arithmetic with ``B1`` and ``B2``.
  """
  size = math.prod(shape)
  rng = np.random.default_rng(seed)
  grad = rng.standard_normal(size) * np.exp(rng.uniform(-2, 2, size))
  grad = np.clip(np.round(grad * 256) / 256, -8, 8).astype(np.float32)
  blocks = oracles.blocks(shape, block_size)
  scales = (np.round(np.exp(rng.uniform(-3, 1, math.prod(blocks))) * 256) / 256).astype(np.float32)
  scales[0] = 0.0  # A block whose stored scale is 0.
  trits = rng.integers(-1, 2, size)
  stored = ternary.TernaryArray(
    jnp.asarray(oracles.block_major_bytes(trits, shape, block_size, packing)),
    jnp.asarray(scales.reshape(*blocks, 1)),
  )
  nu = (np.round(rng.uniform(0.0, 2.0, size) * 256) / 256).astype(np.float32)
  nu[-7:] = 0.0  # Roots of zero.
  return (jnp.asarray(grad.reshape(shape), grad_dtype), stored, jnp.asarray(nu.reshape(shape)))


def _step(grad, stored, nu, seed, *, block_size, packing, update_nu, implementation):
  """The step with ``nu`` updated in it, or with ``nu`` as the root of this step's (``nu_root``).

  ``implementation="reference"`` runs ``ternary_adam_update_reference``.
  """
  arguments = dict(
    **{"nu" if update_nu else "nu_root": nu},
    seed=seed,
    count=COUNT,
    b1=B1,
    b2=B2,
    eps=EPS,
    block_size=block_size,
    packing=packing,
  )
  if implementation == "reference":
    return jax.jit(functools.partial(ternary_adam_update_reference, **arguments))(grad, stored)
  return ternary_adam_update(grad, stored, **arguments)


def _assert_steps_equal(actual, expected, message):
  np.testing.assert_array_equal(actual.mu.packed, expected.mu.packed, err_msg=message)
  np.testing.assert_array_equal(actual.mu.scales, expected.mu.scales, err_msg=message)
  if expected.nu is None:
    assert actual.nu is None
  else:
    np.testing.assert_array_equal(actual.nu, expected.nu, err_msg=message)
  assert actual.direction.dtype == expected.direction.dtype
  np.testing.assert_allclose(
    np.asarray(actual.direction, np.float32),
    np.asarray(expected.direction, np.float32),
    rtol=DIRECTION_RTOL if expected.direction.dtype == jnp.float32 else 1e-2,
    atol=0,
    err_msg=message,
  )


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("packing", ["base3", "2bit"])
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("update_nu", [True, False])
# A vector with a partial last block, a matrix whose rows are whole blocks,
# and one whose rows are not (the flat layout).
@pytest.mark.parametrize("shape", [(3000,), (6, 512), (5, 200)])
def test_step_follows_the_formulas(implementation, packing, block_size, update_nu, shape, seed):
  size = math.prod(shape)
  grad, stored, nu = _inputs(seed, shape, block_size=block_size, packing=packing)
  rounding_seed = seed + 1
  step = _step(
    grad,
    stored,
    nu,
    jnp.uint32(rounding_seed),
    block_size=block_size,
    packing=packing,
    update_nu=update_nu,
    implementation=implementation,
  )
  message = f"seed={seed}, {implementation}"

  def per_block(x, reduce):
    padded = np.zeros(-(-size // block_size) * block_size, np.float32)
    padded[:size] = np.asarray(x).reshape(-1)
    return reduce(padded.reshape(-1, block_size), axis=1)

  g = np.asarray(grad, np.float32).reshape(-1)
  m = B1 * _decode(stored.packed, stored.scales, size, block_size, packing) + (1 - B1) * g
  m = m.astype(np.float32)  # Exact (see B1).
  # Exact too: B1 and 1 - B1 are powers of two, one rounding in the sum.
  old_scales = np.asarray(stored.scales).reshape(-1)
  bound = np.float32(B1) * old_scales + np.float32(1 - B1) * per_block(np.abs(g), np.max)
  np.testing.assert_array_equal(step.mu.scales.reshape(-1), bound, err_msg=message)
  assert np.all(per_block(np.abs(m), np.max) <= bound), message
  # |t| = [u s < |m|] with the documented uniforms.
  scale = np.repeat(bound, block_size)[:size]
  trits = np.where(oracles.uniforms(rounding_seed, size) * scale < np.abs(m), np.sign(m), 0)
  np.testing.assert_array_equal(
    step.mu.packed, oracles.block_major_bytes(trits, shape, block_size, packing), err_msg=message
  )

  g, nu64 = np.asarray(grad, np.float64), np.asarray(nu, np.float64)
  new_nu = B2 * nu64 + (1 - B2) * g * g if update_nu else nu64**2
  direction = (np.asarray(m, np.float64).reshape(shape) / (1 - B1**COUNT)) / (np.sqrt(new_nu / (1 - B2**COUNT)) + EPS)
  np.testing.assert_allclose(step.direction, direction, rtol=2e-6, err_msg=message)
  if update_nu:
    np.testing.assert_array_equal(step.nu, new_nu, err_msg=message)
  else:
    assert step.nu is None


# packing, block_size, shape, grad dtype, update_nu: blocks of 64, 128 and
# 256 elements, a partial last block, bfloat16 gradients, block-major
# matrices with and without a tail.
_PARITY_CASES = [
  ("base3", 64, (640 * 2 + 77,), jnp.float32, True),
  ("base3", 256, (1280 + 300,), jnp.float32, False),
  ("2bit", 128, (512 * 2 + 5,), jnp.bfloat16, True),
  ("base3", 128, (10, 384), jnp.float32, True),
  ("2bit", 64, (4, 512), jnp.float32, False),
  ("base3", 128, (12, 200), jnp.float32, False),
]


@pytest.mark.parametrize("packing, block_size, shape, dtype, update_nu", _PARITY_CASES)
def test_xla_equals_the_reference(packing, block_size, shape, dtype, update_nu, seed):
  grad, stored, nu = _inputs(seed, shape, block_size=block_size, packing=packing, grad_dtype=dtype)
  rounding_seed = jnp.uint32(seed + 1)
  options = dict(block_size=block_size, packing=packing, update_nu=update_nu)
  expected = _step(grad, stored, nu, rounding_seed, **options, implementation="reference")
  actual = _step(grad, stored, nu, rounding_seed, **options, implementation="xla")
  _assert_steps_equal(actual, expected, f"seed={seed}")


def test_short_input_equals_the_reference(seed):
  """300 elements in 2-bit blocks of 32, the last one partial."""
  grad, stored, nu = _inputs(seed, (300,), block_size=32, packing="2bit")
  options = dict(block_size=32, packing="2bit", update_nu=True)
  expected = _step(grad, stored, nu, jnp.uint32(seed), **options, implementation="reference")
  actual = _step(grad, stored, nu, jnp.uint32(seed), **options, implementation="xla")
  _assert_steps_equal(actual, expected, f"seed={seed}")


def test_direction_keeps_the_gradient_shape_and_dtype():
  step = ternary_adam_update(
    **_good_arguments()
    | dict(
      grad=jnp.ones((40, 50), jnp.bfloat16),
      mu=ternary.zeros((40, 50), block_size=64),
      nu=jnp.zeros((40, 50)),
      block_size=64,
    )
  )
  assert step.direction.shape == (40, 50) and step.direction.dtype == jnp.bfloat16
  assert step.nu.shape == (40, 50) and step.nu.dtype == jnp.float32
  # Adam's first step is sign(g).
  np.testing.assert_allclose(np.asarray(step.direction, np.float32), 1.0, rtol=1e-2)


def _good_arguments():
  return dict(
    grad=jnp.ones(100),
    mu=ternary.zeros((100,), block_size=32),
    nu=jnp.zeros(100),
    seed=jnp.uint32(0),
    count=1,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    block_size=32,
  )


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(grad=jnp.ones(100, jnp.int32)), "grad"),
    (dict(block_size=48), "block_size"),
    (dict(packing="base5"), "packing"),
    (dict(mu=ternary.zeros((200,), block_size=32)), "mu.packed"),
    # A flat byte layout is not the step's.
    (dict(mu=ternary.TernaryArray(jnp.zeros(20, jnp.uint8), jnp.zeros(4))), "mu.packed"),
    (dict(mu=ternary.zeros((100,), block_size=32)._replace(scales=jnp.zeros(4))), "mu.scales"),
    (dict(mu=(jnp.zeros(20, jnp.uint8), jnp.zeros(4))), "mu must be a TernaryArray"),
    (dict(mu=None), "mu, the stored first moment, is missing"),
    (dict(nu=jnp.zeros(101)), "nu"),
    (dict(nu=None, nu_root=jnp.zeros(101)), "nu_root"),
    (dict(nu=None), "exactly one of nu"),
    (dict(nu_root=jnp.zeros(100)), "exactly one of nu"),
    (dict(seed=0), "seed"),
    (dict(seed=jnp.zeros(2, jnp.uint32)), "seed"),
    (dict(b1=1.5), "b1"),
    (dict(b2=1.0), "b2"),
    (dict(eps=-1e-8), "eps"),
  ],
)
def test_bad_arguments_raise(change, match):
  arguments = {**_good_arguments(), **change}
  grad, mu, nu = (arguments.pop(k) for k in ("grad", "mu", "nu"))
  with pytest.raises(ValueError, match=match):
    ternary_adam_update(grad, mu, nu, **arguments)


def test_momentum_is_the_deprecated_name_of_mu():
  arguments = _good_arguments() | dict(grad=jnp.linspace(-1.0, 1.0, 100), seed=jnp.uint32(3))
  mu = ternary_adam_update(**arguments).mu  # Not all zeros.
  arguments.pop("mu")
  with pytest.warns(DeprecationWarning, match="pass mu instead"):
    old = ternary_adam_update(momentum=mu, **arguments)
  new = ternary_adam_update(mu=mu, **arguments)
  _assert_steps_equal(old, new, "momentum= against mu=")
  with pytest.raises(ValueError, match="momentum is the old name of mu; pass mu only"):
    ternary_adam_update(mu=mu, momentum=mu, **arguments)
