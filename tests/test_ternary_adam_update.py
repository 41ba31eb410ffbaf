"""The fused ternary-Adam step against the formulas, and its implementations against the reference.

Expectations are written here in numpy from the documented math and layout:
the step's moment, ``nu`` and direction; the scale bound; stochastic rounding
with the documented counter hash ``u = (h(seed ^ i) >> 8) / 2**24``,
``h(x) = y ^ (y >> 16)``, ``y = x * 0x9E3779B1 mod 2**32``; and the
block-major bytes ``sum_p base**p (t[j + p w] + 1)``. The plain-jnp
``ternary_adam_update_reference`` and the XLA path must give the same trits,
scales and ``nu`` exactly and directions to float32 rounding; the kernel, run
by the Mosaic GPU interpreter, must equal the reference (trits, scales and
``nu`` bit for bit, directions to a few ulps: it takes the square root as
``x * rsqrt(x)``). Inputs are drawn fresh; the seed is in every failure
message. Lowering for CUDA is checked by ``test_check_lowering.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _ternary_chunks as chunks
from pallas_kernels import _backend, dispatch
from pallas_kernels import ternary
from pallas_kernels import ternary_adam_update as update_module
from pallas_kernels import ternary_blocks
from pallas_kernels.ternary_adam_update import ternary_adam_update, ternary_adam_update_reference

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
_LAYOUTS = {"base3": (3, 5), "2bit": (4, 4)}


def _uniforms(seed: int, size: int) -> np.ndarray:
  """The documented rounding uniforms of elements ``0 .. size - 1``."""
  y = ((np.arange(size, dtype=np.uint64) ^ np.uint64(seed)) * np.uint64(0x9E3779B1)) % 2**32
  h = y ^ (y >> np.uint64(16))
  return (h >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)


def _blocks(shape, block_size):
  """Blocks tile the last axis when they can, else the flat tensor."""
  if shape[-1] % block_size == 0:
    return (*shape[:-1], shape[-1] // block_size)
  return (-(-math.prod(shape) // block_size),)


def _block_major_bytes(trits, shape, block_size, packing):
  """Byte ``j`` of a block: ``sum_p base**p (t[j + p w] + 1)``, code 1 past the block's end."""
  base, planes = _LAYOUTS[packing]
  blocks = _blocks(shape, block_size)
  n_blocks, width = math.prod(blocks), -(-block_size // planes)
  codes = np.ones(n_blocks * block_size, np.int64)
  codes[: trits.size] = np.asarray(trits, np.int64).reshape(-1) + 1
  slots = np.ones((n_blocks, planes * width), np.int64)
  slots[:, :block_size] = codes.reshape(n_blocks, block_size)
  packed = np.einsum("bpj,p->bj", slots.reshape(n_blocks, planes, width), base ** np.arange(planes))
  return packed.astype(np.uint8).reshape(*blocks, width)


def _decode(packed, scales, size, block_size, packing) -> np.ndarray:
  """Trits times their block scales, from the documented block-major bytes (float64)."""
  base, planes = _LAYOUTS[packing]
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
  blocks = _blocks(shape, block_size)
  scales = (np.round(np.exp(rng.uniform(-3, 1, math.prod(blocks))) * 256) / 256).astype(np.float32)
  scales[0] = 0.0  # A block whose stored scale is 0.
  trits = rng.integers(-1, 2, size)
  stored = ternary.TernaryArray(
      jnp.asarray(_block_major_bytes(trits, shape, block_size, packing)),
      jnp.asarray(scales.reshape(*blocks, 1)),
  )
  nu = (np.round(rng.uniform(0.0, 2.0, size) * 256) / 256).astype(np.float32)
  nu[-7:] = 0.0  # Roots of zero.
  return (
      jnp.asarray(grad.reshape(shape), grad_dtype), stored, jnp.asarray(nu.reshape(shape))
  )


def _step(grad, stored, nu, seed, *, block_size, packing, update_nu, implementation):
  """The step with ``nu`` updated in it, or with ``nu`` as the root of this step's (``nu_root``).

  ``implementation="reference"`` runs ``ternary_adam_update_reference``.
  """
  arguments = dict(
      **{"nu" if update_nu else "nu_root": nu}, seed=seed, count=COUNT, b1=B1, b2=B2,
      eps=EPS, block_size=block_size, packing=packing,
  )
  if implementation == "reference":
    return jax.jit(functools.partial(ternary_adam_update_reference, **arguments))(grad, stored)
  return ternary_adam_update(grad, stored, **arguments, implementation=implementation)


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
  step = _step(grad, stored, nu, jnp.uint32(rounding_seed), block_size=block_size,
               packing=packing, update_nu=update_nu, implementation=implementation)
  message = f"seed={seed}, {implementation}"

  def per_block(x, reduce):
    padded = np.zeros(-(-size // block_size) * block_size, np.float32)
    padded[:size] = np.asarray(x).reshape(-1)
    return reduce(padded.reshape(-1, block_size), axis=1)

  g = np.asarray(grad, np.float32).reshape(-1)
  m = (B1 * _decode(stored.packed, stored.scales, size, block_size, packing) + (1 - B1) * g)
  m = m.astype(np.float32)  # Exact (see B1).
  # Exact too: B1 and 1 - B1 are powers of two, one rounding in the sum.
  old_scales = np.asarray(stored.scales).reshape(-1)
  bound = np.float32(B1) * old_scales + np.float32(1 - B1) * per_block(np.abs(g), np.max)
  np.testing.assert_array_equal(step.momentum.scales.reshape(-1), bound, err_msg=message)
  assert np.all(per_block(np.abs(m), np.max) <= bound), message
  # |t| = [u s < |m|] with the documented uniforms.
  scale = np.repeat(bound, block_size)[:size]
  trits = np.where(_uniforms(rounding_seed, size) * scale < np.abs(m), np.sign(m), 0)
  np.testing.assert_array_equal(
      step.momentum.packed, _block_major_bytes(trits, shape, block_size, packing), err_msg=message
  )

  g, nu64 = np.asarray(grad, np.float64), np.asarray(nu, np.float64)
  new_nu = B2 * nu64 + (1 - B2) * g * g if update_nu else nu64**2
  direction = (np.asarray(m, np.float64).reshape(shape) / (1 - B1**COUNT)) / (
      np.sqrt(new_nu / (1 - B2**COUNT)) + EPS
  )
  np.testing.assert_allclose(step.direction, direction, rtol=2e-6, err_msg=message)
  if update_nu:
    np.testing.assert_array_equal(step.nu, new_nu, err_msg=message)
  else:
    assert step.nu is None


# packing, block_size, shape, grad dtype, update_nu: sub-slice blocks, one
# block per slice, blocks over two packed rows, a tail after whole chunks,
# bfloat16 gradients, block-major matrices with and without a tail. Every
# case holds at least one whole kernel chunk.
_PARITY_CASES = [
    ("base3", 64, (640 * 2 + 77,), jnp.float32, True),
    ("base3", 256, (1280 + 300,), jnp.float32, False),
    ("2bit", 128, (512 * 2 + 5,), jnp.bfloat16, True),
    ("base3", 128, (10, 384), jnp.float32, True),
    ("2bit", 64, (4, 512), jnp.float32, False),
    ("base3", 128, (12, 200), jnp.float32, False),
]


@pytest.mark.parametrize("packing, block_size, shape, dtype, update_nu", _PARITY_CASES)
def test_interpret_kernel_and_xla_equal_the_reference(packing, block_size, shape, dtype, update_nu, seed):
  geometry = chunks.ChunkGeometry(block_size, _LAYOUTS[packing][1])
  assert chunks.grid_extent(math.prod(shape), geometry, None)[0] > 0, "the case must run the kernel"
  grad, stored, nu = _inputs(seed, shape, block_size=block_size, packing=packing, grad_dtype=dtype)
  rounding_seed = jnp.uint32(seed + 1)
  options = dict(block_size=block_size, packing=packing, update_nu=update_nu)
  expected = _step(grad, stored, nu, rounding_seed, **options, implementation="reference")
  for implementation in ("xla", "interpret"):
    actual = _step(grad, stored, nu, rounding_seed, **options, implementation=implementation)
    _assert_steps_equal(actual, expected, f"seed={seed}, {implementation}")


def test_input_shorter_than_a_kernel_chunk_is_stepped_by_every_implementation(seed):
  """No kernel runs on 300 elements (a 2-bit chunk is 512): every implementation takes XLA."""
  grad, stored, nu = _inputs(seed, (300,), block_size=32, packing="2bit")
  options = dict(block_size=32, packing="2bit", update_nu=True)
  expected = _step(grad, stored, nu, jnp.uint32(seed), **options, implementation="reference")
  for implementation in ("xla", "interpret"):
    actual = _step(grad, stored, nu, jnp.uint32(seed), **options, implementation=implementation)
    _assert_steps_equal(actual, expected, f"seed={seed}, {implementation}")


def test_interpret_kernel_with_several_chunks_per_grid_step_equals_xla(seed):
  block_size, size, layout = 128, 640 * 4 + 33, ternary.packing_layout("base3")
  grad, stored, nu = _inputs(seed, (size,), block_size=block_size, packing="base3")
  seed_bits = jnp.uint32(seed)
  hyper = update_module._hyperparameters(COUNT, B1, B2, EPS)
  blocks = stored.packed.shape[:-1]
  new_scales = update_module._scale_bound(
      ternary_blocks.to_blocks(grad, blocks, block_size), stored.scales, hyper[update_module._B1]
  )
  args = (grad, stored.packed, stored.scales, new_scales, nu, seed_bits, hyper)
  options = dict(block_size=block_size, layout=layout, update_nu=True)
  expected = jax.jit(functools.partial(update_module._step_xla, **options))(*args)
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


def _planar_bytes(codes, base, planes):
  """The flat planar layout of the kernel: rows of ``planes * 128`` codes, byte ``j``
  ``sum_p base**p code[p * 128 + j]``; a last row of ``r`` codes in planes of
  ``ceil(r / planes)``, zero padded."""
  codes, row, out = np.asarray(codes, np.int64).reshape(-1), planes * 128, []
  for start in range(0, codes.size, row):
    part = codes[start : start + row]
    width = -(-part.size // planes)
    padded = np.zeros(planes * width, np.int64)
    padded[: part.size] = part
    out.append(padded.reshape(planes, width).T @ base ** np.arange(planes))
  return np.concatenate(out).astype(np.uint8)


@pytest.mark.parametrize("packing", ["base3", "2bit"])
# Blocks smaller than a 128-slice, of one slice, over several packed rows.
@pytest.mark.parametrize("block_size", [32, 128, 640])
@pytest.mark.parametrize("tiles_rows", [True, False])
def test_block_bytes_follow_the_documented_layout(packing, block_size, tiles_rows, seed):
  """Packing, unpacking, shapes, zeros, and the conversion to the kernel's flat bytes."""
  base, planes = _LAYOUTS[packing]
  layout = ternary.packing_layout(packing)
  shape = (3, 2 * block_size) if tiles_rows else (3, block_size + 37)
  size = math.prod(shape)
  blocks = _blocks(shape, block_size)
  trits = np.random.default_rng(seed).integers(-1, 2, size)
  expected = _block_major_bytes(trits, shape, block_size, packing)
  codes = np.ones(math.prod(blocks) * block_size, np.uint32)
  codes[:size] = trits + 1
  codes = jnp.asarray(codes.reshape(*blocks, block_size))
  packed = jax.jit(lambda c: ternary_blocks.pack_blocks(c, layout))(codes)
  np.testing.assert_array_equal(packed, expected, err_msg=f"seed={seed}")
  unpacked = jax.jit(lambda p: ternary_blocks.unpack_blocks(p, block_size, layout))(packed)
  np.testing.assert_array_equal(unpacked, codes, err_msg=f"seed={seed}")
  assert [a.shape for a in ternary_blocks.shapes(shape, block_size=block_size, packing=packing)] == [
      expected.shape, (*blocks, 1)
  ]

  flat = jax.jit(lambda p: ternary_blocks.flat_bytes(p, size, block_size, layout))(packed)
  np.testing.assert_array_equal(flat, _planar_bytes(trits + 1, base, planes), err_msg=f"seed={seed}")
  back = jax.jit(lambda f: ternary_blocks.block_bytes(f, size, blocks, block_size, layout))(flat)
  np.testing.assert_array_equal(back, expected, err_msg=f"seed={seed}")

  zeros = ternary_blocks.zeros(shape, block_size=block_size, packing=packing)
  np.testing.assert_array_equal(
      zeros.packed, _block_major_bytes(np.zeros(size), shape, block_size, packing)
  )
  np.testing.assert_array_equal(zeros.scales, np.zeros((*blocks, 1), np.float32))


@pytest.mark.parametrize("base, planes", [(3, 5), (4, 4)])
def test_digits_are_exact_for_every_byte_and_place(base, planes):
  # The decoder's multiply-shift division, for every uint8 byte (not only
  # those a packer writes) and every place, at once and one place at a time.
  byte = np.arange(256, dtype=np.uint8)
  place = base ** np.arange(planes)
  expected = (byte[:, None].astype(np.int64) // place) % base
  digits = jax.jit(lambda b: ternary_blocks.digits(b[:, None], place, base))(byte)
  assert digits.dtype == jnp.float32
  np.testing.assert_array_equal(digits, expected)
  for p in range(planes):
    one_place = jax.jit(lambda b: ternary_blocks.digits(b, base**p, base))(byte)
    np.testing.assert_array_equal(one_place, expected[:, p])


def test_direction_keeps_the_gradient_shape_and_dtype():
  grad = jnp.ones((40, 50), jnp.bfloat16)
  stored = ternary_blocks.zeros((40, 50), block_size=64)
  step = ternary_adam_update(
      grad, stored, jnp.zeros((40, 50)), seed=jnp.uint32(0), count=1,
      b1=0.9, b2=0.999, eps=1e-8, block_size=64, implementation="xla",
  )
  assert step.direction.shape == (40, 50) and step.direction.dtype == jnp.bfloat16
  assert step.nu.shape == (40, 50) and step.nu.dtype == jnp.float32
  # Adam's first step is sign(g).
  np.testing.assert_allclose(np.asarray(step.direction, np.float32), 1.0, rtol=1e-2)


@pytest.mark.parametrize("on_hopper", [True, False])
def test_automatic_implementation_is_xla_while_the_kernel_is_slower(monkeypatch, on_hopper):
  """``implementation=None`` follows ``dispatch.FASTER_ON_HOPPER`` in a program lowered for a (faked) Hopper GPU."""
  monkeypatch.setattr(dispatch, "cuda_target_runs_mosaic_gpu", lambda: on_hopper)
  # Large enough for the kernel's whole chunks (a shorter tensor is all tail, done by XLA).
  arguments = _good_arguments() | dict(
      grad=jnp.ones(4096), momentum=ternary_blocks.zeros((4096,), block_size=32), nu=jnp.zeros(4096)
  )
  # A new function per lowering: jax.jit caches a function's trace.
  lowered = lambda: _backend.lower_for_cuda(lambda: ternary_adam_update(**arguments))
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "ternary_adam_update", False)
  assert _backend.MOSAIC_GPU_CALL not in lowered()
  # Once the kernel is faster, a Hopper GPU runs it.
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "ternary_adam_update", True)
  assert (_backend.MOSAIC_GPU_CALL in lowered()) == on_hopper


def _good_arguments():
  return dict(
      grad=jnp.ones(100), momentum=ternary_blocks.zeros((100,), block_size=32),
      nu=jnp.zeros(100), seed=jnp.uint32(0), count=1, b1=0.9, b2=0.999, eps=1e-8,
      block_size=32,
  )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(grad=jnp.ones(100, jnp.int32)), "grad"),
        (dict(block_size=48), "block_size"),
        (dict(packing="base5"), "packing"),
        (dict(momentum=ternary_blocks.zeros((200,), block_size=32)), "packed"),
        # The flat layout of ternary_encode is not the step's.
        (dict(momentum=ternary.ternary_encode(jnp.zeros(100), block_size=32)), "packed"),
        (dict(momentum=ternary_blocks.zeros((100,), block_size=32)._replace(scales=jnp.zeros(4))), "scales"),
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
