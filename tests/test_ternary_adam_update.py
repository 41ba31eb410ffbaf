"""The fused ternary-Adam step: interpret-mode kernel against XLA, XLA against the formulas.

The XLA reference must equal the step composed from ``ternary_decode``, a
numpy re-derivation of Adam's update and of the scale bound, and stochastic
rounding with the random bits of ``ternary_encode`` for the key whose seed
the step is given (same trits and scales exactly, directions to float32
rounding), for ``nu`` updated in the step and for the root of ``nu`` given
to it; the
kernel, run by the Mosaic GPU interpreter, must equal the reference: trits,
scales and ``nu`` bit for bit, the direction to a few float32 ulps
(the kernel takes the square root as ``x * rsqrt(x)``, the reference as
``sqrt``, and XLA's fused CPU code and the interpreter may evaluate the
division differently). Inputs are drawn fresh; the seed is in every failure
message. Lowering for CUDA is checked by ``test_check_lowering.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ternary
from pallas_kernels import ternary_adam_update as update_module
from pallas_kernels.ternary_adam_update import from_flat, ternary_adam_update, to_flat, zero_momentum

pytestmark = pytest.mark.kernels

# With these decays and the dyadic inputs of _inputs, the new moment and nu
# are exact in float32 however XLA fuses or contracts their arithmetic (fused
# multiply-adds differ between jit, eager and the interpreter, and between
# JAX versions), so trits, scales and nu can be compared bit for bit.
B1, B2, EPS, COUNT = 0.5, 0.75, 1e-8, 3
# A few float32 ulps: the kernel's x * rsqrt(x) against the reference's
# sqrt, and divisions that XLA's CPU code and the interpreter may evaluate
# with different approximations.
DIRECTION_RTOL = 2e-6


def _fresh_seed() -> int:
  return int(np.random.SeedSequence().entropy % 2**31)


def _inputs(seed, shape, *, block_size, packing, grad_dtype=jnp.float32):
  """A gradient, a stored moment with spread-out scales (and a zero block), and nu.

  Values are multiples of 2**-8 (the gradient below 8 in magnitude, so that
  ``g**2 / 4`` keeps its bits), for exact arithmetic with ``B1`` and ``B2``.
  The moment is ``ternary_encode``'s, in the block-major layout of ``shape``.
  """
  shape = (shape,) if isinstance(shape, int) else shape
  size = math.prod(shape)
  rng = np.random.default_rng(seed)
  grad = rng.standard_normal(size) * np.exp(rng.uniform(-2, 2, size))
  moment = rng.standard_normal(size) * np.exp(rng.uniform(-3, 1, size))
  grad = np.clip(np.round(grad * 256) / 256, -8, 8).astype(np.float32)
  moment = np.round(moment * 256) / 256
  moment[:block_size] = 0.0  # A block whose stored scale is 0.
  stored = ternary.ternary_encode(
      jnp.asarray(moment, jnp.float32), block_size=block_size, packing=packing,
      key=jax.random.key(seed), implementation="xla",
  )
  stored = from_flat(stored, shape, block_size=block_size, packing=packing)
  nu = (np.round(rng.uniform(0.0, 2.0, size) * 256) / 256).astype(np.float32)
  nu[-7:] = 0.0  # Roots of zero.
  return (
      jnp.asarray(grad.reshape(shape), grad_dtype), stored, jnp.asarray(nu.reshape(shape))
  )


def _step(grad, stored, nu, seed, *, block_size, packing, update_nu, implementation):
  """The step with ``nu`` updated in it, or with ``nu`` as the root of this step's (``nu_root``)."""
  return ternary_adam_update(
      grad, stored, **{"nu" if update_nu else "nu_root": nu}, seed=seed, count=COUNT, b1=B1,
      b2=B2, eps=EPS, block_size=block_size, packing=packing, implementation=implementation,
  )


def _assert_steps_equal(actual, expected, message):
  np.testing.assert_array_equal(actual.momentum.packed, expected.momentum.packed, err_msg=message)
  np.testing.assert_array_equal(actual.momentum.scales, expected.momentum.scales, err_msg=message)
  if expected.nu is None:
    assert actual.nu is None
  else:
    np.testing.assert_array_equal(actual.nu, expected.nu, err_msg=message)
  assert actual.direction.dtype == expected.direction.dtype
  np.testing.assert_allclose(
      np.asarray(actual.direction, np.float32), np.asarray(expected.direction, np.float32),
      rtol=DIRECTION_RTOL if expected.direction.dtype == jnp.float32 else 1e-2, atol=0, err_msg=message,
  )


@pytest.mark.parametrize("packing", ["base3", "2bit"])
@pytest.mark.parametrize("block_size", [32, 128, 256])
@pytest.mark.parametrize("update_nu", [True, False])
# A vector with a partial last block, a matrix whose rows are whole blocks,
# and one whose rows are not (the flat layout).
@pytest.mark.parametrize("shape", [(3000,), (6, 512), (5, 200)])
def test_xla_step_equals_the_formulas(packing, block_size, update_nu, shape):
  seed = _fresh_seed()
  size = math.prod(shape)
  grad, stored, nu = _inputs(seed, shape, block_size=block_size, packing=packing)
  rounding_seed = ternary.seed_from_key(jax.random.key(seed + 1))
  step = _step(grad, stored, nu, rounding_seed, block_size=block_size, packing=packing,
               update_nu=update_nu, implementation="xla")

  def decode(t):
    flat = to_flat(t, size=size, block_size=block_size, packing=packing)
    return np.asarray(ternary.ternary_decode(flat, size=size, block_size=block_size, packing=packing))

  def per_block(x, reduce):
    padded = np.zeros(-(-size // block_size) * block_size, np.float32)
    padded[:size] = np.asarray(x).reshape(-1)
    return reduce(padded.reshape(-1, block_size), axis=1)

  m = (B1 * decode(stored) + (1 - B1) * np.asarray(grad).reshape(-1)).astype(np.float32)  # Exact (see B1).
  old_scales = np.asarray(stored.scales).reshape(-1)
  # Exact too: B1 and 1 - B1 are powers of two, one rounding in the sum.
  bound = np.float32(B1) * old_scales + np.float32(1 - B1) * per_block(np.abs(grad), np.max)
  np.testing.assert_array_equal(step.momentum.scales.reshape(-1), bound, err_msg=f"seed={seed}")
  assert np.all(per_block(np.abs(m), np.max) <= bound), f"seed={seed}"
  # Stochastic rounding with ternary_encode's random bits for the key of
  # this seed: |t| = [u s < |m|], u the top 24 bits of the element's hash
  # over 2**24.
  bits = ternary.counter_hash_bits(rounding_seed, jnp.arange(size, dtype=jnp.uint32))
  uniform = (np.asarray(bits) >> 8).astype(np.float32) * np.float32(2.0**-24)
  scale = np.repeat(bound, block_size)[:size]
  expected = np.where(uniform * scale < np.abs(m), np.sign(m), 0.0) * scale
  np.testing.assert_array_equal(decode(step.momentum), expected, err_msg=f"seed={seed}")

  g, nu64 = np.asarray(grad, np.float64), np.asarray(nu, np.float64)
  new_nu = B2 * nu64 + (1 - B2) * g * g if update_nu else nu64**2
  direction = (np.asarray(m, np.float64).reshape(shape) / (1 - B1**COUNT)) / (
      np.sqrt(new_nu / (1 - B2**COUNT)) + EPS
  )
  np.testing.assert_allclose(step.direction, direction, rtol=2e-6, err_msg=f"seed={seed}")
  if update_nu:
    np.testing.assert_array_equal(step.nu, new_nu, err_msg=f"seed={seed}")
  else:
    assert step.nu is None


# packing, block_size, shape, grad dtype, update_nu: sub-slice blocks, one
# block per slice, blocks over two packed rows, a tail after whole chunks,
# an input shorter than a chunk (all XLA), bfloat16 gradients, block-major
# matrices with and without a tail.
_PARITY_CASES = [
    ("base3", 64, (640 * 2 + 77,), jnp.float32, True),
    ("base3", 256, (1280 + 300,), jnp.float32, False),
    ("2bit", 128, (512 * 2 + 5,), jnp.bfloat16, True),
    ("2bit", 32, (300,), jnp.float32, True),
    ("base3", 128, (10, 384), jnp.float32, True),
    ("2bit", 64, (4, 512), jnp.float32, False),
    ("base3", 128, (12, 200), jnp.float32, False),
]


@pytest.mark.parametrize("packing, block_size, shape, dtype, update_nu", _PARITY_CASES)
def test_interpret_kernel_equals_xla(packing, block_size, shape, dtype, update_nu):
  seed = _fresh_seed()
  grad, stored, nu = _inputs(seed, shape, block_size=block_size, packing=packing, grad_dtype=dtype)
  rounding_seed = jnp.uint32(seed + 1)
  options = dict(block_size=block_size, packing=packing, update_nu=update_nu)
  expected = _step(grad, stored, nu, rounding_seed, **options, implementation="xla")
  actual = _step(grad, stored, nu, rounding_seed, **options, implementation="interpret")
  _assert_steps_equal(actual, expected, f"seed={seed}")


def test_interpret_kernel_with_several_chunks_per_grid_step_equals_xla():
  seed = _fresh_seed()
  block_size, size, layout = 128, 640 * 4 + 33, ternary.packing_layout("base3")
  grad, stored, nu = _inputs(seed, (size,), block_size=block_size, packing="base3")
  seed_bits = jnp.uint32(seed)
  hyper = update_module._hyperparameters(COUNT, B1, B2, EPS)
  blocks = stored.packed.shape[:-1]
  new_scales = update_module._scale_bound(
      update_module._to_blocks(grad, blocks, block_size), stored.scales, hyper[update_module._B1]
  )
  args = (grad, stored.packed, stored.scales, new_scales, nu, seed_bits, hyper)
  options = dict(block_size=block_size, layout=layout, update_nu=True)
  expected = jax.jit(functools.partial(update_module._step_reference, **options))(*args)
  # Two grid steps of two chunks, then a tail in XLA.
  actual = jax.jit(
      functools.partial(
          update_module._step_pallas, **options, interpret=True, chunks_per_step=2
      )
  )(*args)
  for name, a, e in zip(("direction", "packed", "nu"), actual, expected):
    if name == "direction":
      np.testing.assert_allclose(a, e, rtol=DIRECTION_RTOL, err_msg=f"seed={seed}")
    else:
      np.testing.assert_array_equal(a, e, err_msg=f"{name}, seed={seed}")


@pytest.mark.parametrize("packing, trits_per_byte", [("base3", 5), ("2bit", 4)])
def test_block_major_moment_keeps_each_block_in_its_own_bytes(packing, trits_per_byte):
  """``from_flat`` and ``to_flat`` invert each other; negating one block changes its bytes only."""
  seed = _fresh_seed()
  shape, block_size = (6, 256), 64
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

  def block_major(values):
    flat = ternary.ternary_encode(values, block_size=block_size, packing=packing)
    return flat, from_flat(flat, shape, block_size=block_size, packing=packing)

  flat, moment = block_major(x)
  assert moment.packed.shape == (6, 4, math.ceil(block_size / trits_per_byte))
  assert moment.scales.shape == (6, 4, 1)
  round_trip = to_flat(moment, size=x.size, block_size=block_size, packing=packing)
  np.testing.assert_array_equal(round_trip.packed, flat.packed, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(round_trip.scales, flat.scales, err_msg=f"seed={seed}")

  y = x.copy()
  y[2, 64:128] *= -1  # Block (2, 1) only.
  _, other = block_major(y)
  changed = np.any(np.asarray(other.packed) != np.asarray(moment.packed), axis=-1)
  expected = np.zeros((6, 4), bool)
  expected[2, 1] = True
  np.testing.assert_array_equal(changed, expected, err_msg=f"seed={seed}")

  zeros = to_flat(zero_momentum(shape, block_size=block_size, packing=packing),
                  size=x.size, block_size=block_size, packing=packing)
  expected_zeros = ternary.ternary_encode(np.zeros(shape), block_size=block_size, packing=packing)
  np.testing.assert_array_equal(zeros.packed, expected_zeros.packed)


@pytest.mark.parametrize("packing, base, planes", [("base3", 3, 5), ("2bit", 4, 4)])
@pytest.mark.parametrize("block_size", [32, 64, 128, 640, 1024])
@pytest.mark.parametrize("tiles_rows", [True, False])
def test_block_bytes_follow_the_documented_layout(packing, base, planes, block_size, tiles_rows):
  """Byte ``j`` of a block is ``sum_p base**p (t[j + p w] + 1)``, code 1 past the block's end.

  Checked against numpy on ``ternary_encode``'s trits for every block size,
  and back through ``to_flat`` against ``ternary_encode``'s own packer.
  """
  seed = _fresh_seed()
  shape = (3, 2 * block_size) if tiles_rows else (3, block_size + 37)
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  flat = ternary.ternary_encode(x, block_size=block_size, packing=packing)
  moment = from_flat(flat, shape, block_size=block_size, packing=packing)

  trits = np.asarray(ternary.unpack_trits(flat.packed, size=x.size, packing=packing))
  width = math.ceil(block_size / planes)
  n_blocks = math.prod(moment.packed.shape[:-1])
  codes = np.ones(n_blocks * block_size, np.int64)
  codes[: x.size] = trits.astype(np.int64) + 1
  slots = np.ones((n_blocks, planes * width), np.int64)
  slots[:, :block_size] = codes.reshape(n_blocks, block_size)
  expected = np.einsum("bpj,p->bj", slots.reshape(n_blocks, planes, width), base ** np.arange(planes))
  np.testing.assert_array_equal(
      np.asarray(moment.packed).reshape(n_blocks, width), expected, err_msg=f"seed={seed}"
  )
  round_trip = to_flat(moment, size=x.size, block_size=block_size, packing=packing)
  np.testing.assert_array_equal(round_trip.packed, flat.packed, err_msg=f"seed={seed}")


@pytest.mark.parametrize("base, planes", [(3, 5), (4, 4)])
def test_digits_are_exact_for_every_byte_and_place(base, planes):
  # The decoder's multiply-shift division, for every uint8 byte (not only
  # those a packer writes) and every place, at once and one place at a time.
  byte = np.arange(256, dtype=np.uint8)
  place = base ** np.arange(planes)
  expected = (byte[:, None].astype(np.int64) // place) % base
  digits = jax.jit(lambda b: update_module._digits(b[:, None], place, base))(byte)
  assert digits.dtype == jnp.float32
  np.testing.assert_array_equal(digits, expected)
  for p in range(planes):
    one_place = jax.jit(lambda b: update_module._digits(b, base**p, base))(byte)
    np.testing.assert_array_equal(one_place, expected[:, p])


def test_direction_keeps_the_gradient_shape_and_dtype():
  grad = jnp.ones((40, 50), jnp.bfloat16)
  stored = zero_momentum((40, 50), block_size=64)
  step = ternary_adam_update(
      grad, stored, jnp.zeros((40, 50)), seed=jnp.uint32(0), count=1,
      b1=0.9, b2=0.999, eps=1e-8, block_size=64, implementation="xla",
  )
  assert step.direction.shape == (40, 50) and step.direction.dtype == jnp.bfloat16
  assert step.nu.shape == (40, 50) and step.nu.dtype == jnp.float32
  # Adam's first step is sign(g).
  np.testing.assert_allclose(np.asarray(step.direction, np.float32), 1.0, rtol=1e-2)


def _good_arguments():
  return dict(
      grad=jnp.ones(100), momentum=zero_momentum((100,), block_size=32),
      nu=jnp.zeros(100), seed=jnp.uint32(0), count=1, b1=0.9, b2=0.999, eps=1e-8,
      block_size=32,
  )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(grad=jnp.ones(100, jnp.int32)), "grad"),
        (dict(block_size=48), "block_size"),
        (dict(packing="base5"), "packing"),
        (dict(momentum=zero_momentum((200,), block_size=32)), "packed"),
        # The flat layout of ternary_encode is not the step's.
        (dict(momentum=ternary.ternary_encode(jnp.zeros(100), block_size=32)), "packed"),
        (dict(momentum=zero_momentum((100,), block_size=32)._replace(scales=jnp.zeros(4))), "scales"),
        (dict(momentum=(jnp.zeros(20, jnp.uint8), jnp.zeros(4))), "momentum"),
        (dict(nu=jnp.zeros(101)), "nu"),
        (dict(nu=None, nu_root=jnp.zeros(101)), "nu_root"),
        (dict(nu=None), "exactly one of nu"),
        (dict(nu_root=jnp.zeros(100)), "exactly one of nu"),
        (dict(seed=0), "seed"),
        (dict(seed=jnp.zeros(2, jnp.uint32)), "seed"),
        (dict(b1=1.5), "b1"),
        (dict(b2=1.0), "b2"),
        (dict(eps=-1e-8), "eps"),
        (dict(implementation="triton"), "implementation"),
    ],
)
def test_bad_arguments_raise(change, match):
  arguments = {**_good_arguments(), **change}
  grad, momentum, nu = (arguments.pop(k) for k in ("grad", "momentum", "nu"))
  with pytest.raises(ValueError, match=match):
    ternary_adam_update(grad, momentum, nu, **arguments)
