"""The fused low-bit AdamW step: the Mosaic GPU kernel (in the GPU interpreter)
against the reference, bit for bit in the stored moments, and its limits."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _backend, dispatch
from pallas_kernels import lowbit_adamw_update as fused_step

pytestmark = pytest.mark.kernels


def bitwise(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view(f"uint{8 * x.dtype.itemsize}")


# (format, shape, gradient dtype, block size): a tail block run by the
# reference beside the kernel's whole blocks (8bit), blocks of two rows
# (fp8), bfloat16 gradients with the paired 4-bit codes, 8-bit's default
# block of 256 (two rows) with a tail, 4-bit and fp8 tensors with a tail,
# 4-bit blocks of two rows. Every case holds at least one whole block.
CASES = [
    ("8bit", (2, 150), jnp.float32, 128),
    ("4bit", (2, 128), jnp.bfloat16, 128),
    ("fp8", (512,), jnp.float32, 256),
    ("8bit", (3, 300), jnp.float32, 256),
    ("4bit", (3, 100), jnp.float32, 128),
    ("fp8", (2, 300), jnp.float32, 256),
    ("4bit", (2, 512), jnp.float32, 256),
]


def step_arguments(state_format, block_size):
  return dict(b1=0.9, b2=0.999, eps=1e-8, state_format=state_format, block_size=block_size)


def second_step_inputs(state_format, shape, dtype, block_size, seed):
  """A gradient (a zero at its first entry) and moments of spread-out block scales from one reference step."""
  rng = np.random.default_rng(seed)
  scales = 10.0 ** rng.uniform(-3, 1, shape)
  first = jnp.asarray(rng.standard_normal(shape) * scales, dtype)
  _, moments = fused_step.lowbit_adamw_update(
      first, fused_step.zero_moments(shape, state_format=state_format, block_size=block_size),
      count=jnp.int32(1), implementation="xla", **step_arguments(state_format, block_size),
  )
  grad = jnp.asarray(rng.standard_normal(shape) * scales, dtype)
  return grad.at[(0,) * len(shape)].set(0), moments


def kernel_launches(monkeypatch) -> list[tuple[int, ...]]:
  """The grid of every Mosaic GPU kernel built from now on (interpreted or not)."""
  grids = []
  build = _backend.mosaic_gpu_kernel

  def spy(*args, grid, **kwargs):
    grids.append(grid)
    return build(*args, grid=grid, **kwargs)

  monkeypatch.setattr(_backend, "mosaic_gpu_kernel", spy)
  return grids


@pytest.mark.parametrize("state_format,shape,dtype,block_size", CASES)
def test_kernel_matches_the_reference(state_format, shape, dtype, block_size, seed, monkeypatch):
  grad, moments = second_step_inputs(state_format, shape, dtype, block_size, seed)
  args = step_arguments(state_format, block_size)
  expected = fused_step.lowbit_adamw_update(grad, moments, count=jnp.int32(2), implementation="xla", **args)
  grids = kernel_launches(monkeypatch)
  actual = fused_step.lowbit_adamw_update(grad, moments, count=jnp.int32(2), implementation="interpret", **args)
  # The kernel ran, over the whole blocks only: otherwise the reference is
  # compared with itself.
  assert grids == [(math.prod(shape) // block_size,)], grids
  message = f"{state_format} seed={seed}"
  direction, new_moments = actual
  assert direction.shape == grad.shape and direction.dtype == grad.dtype, message
  for name, got, want in zip(fused_step.LowbitMoments._fields, new_moments, expected[1]):
    assert (got is None) == (want is None), f"{name} {message}"
    if want is not None:
      assert got.shape == want.shape and got.dtype == want.dtype, f"{name} {message}"
      np.testing.assert_array_equal(bitwise(got), bitwise(want), err_msg=f"{name} {message}")
  # The kernel's square root is x * rsqrt(x): a few float32 ulps.
  np.testing.assert_allclose(
      np.asarray(direction, np.float32), np.asarray(expected[0], np.float32),
      rtol=4 * float(jnp.finfo(dtype).eps), atol=1e-6, err_msg=message,
  )


@pytest.mark.parametrize("state_format,shape", [("8bit", ()), ("4bit", (100,)), ("fp8", (255,))])
def test_tensors_shorter_than_a_block_are_stepped_by_the_reference(state_format, shape, seed, monkeypatch):
  """No whole block, no kernel: ``"interpret"`` returns the reference's step, bit for bit."""
  block_size = 256
  grad, moments = second_step_inputs(state_format, shape, jnp.float32, block_size, seed)
  args = step_arguments(state_format, block_size)
  expected = fused_step.lowbit_adamw_update(grad, moments, count=jnp.int32(2), implementation="xla", **args)
  grids = kernel_launches(monkeypatch)
  actual = fused_step.lowbit_adamw_update(grad, moments, count=jnp.int32(2), implementation="interpret", **args)
  assert grids == []
  for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(bitwise(got), bitwise(want), err_msg=f"{state_format} seed={seed}")


def test_kernel_needs_blocks_of_whole_rows():
  grad = jnp.ones((2, 96))
  moments = fused_step.zero_moments(grad.shape, state_format="8bit", block_size=96)
  with pytest.raises(ValueError, match=r"^block_size must be a multiple of 128"):
    fused_step.lowbit_adamw_update(
        grad, moments, count=1, b1=0.9, b2=0.999, eps=1e-8, state_format="8bit", block_size=96,
        implementation="interpret",
    )


def test_moments_of_another_layout_are_refused_naming_the_field():
  grad = jnp.ones((4, 256))
  moments = fused_step.zero_moments((4, 128), state_format="fp8", block_size=128)
  with pytest.raises(ValueError, match=r"^moments.mu must be float8_e4m3fn\[4, 256\]"):
    fused_step.lowbit_adamw_update(
        grad, moments, count=1, b1=0.9, b2=0.999, eps=1e-8, state_format="fp8", block_size=128,
    )


def test_every_format_has_a_lowering_example():
  names = [example.name for example in fused_step.lowering_examples()]
  for state_format in fused_step.STATE_FORMATS:
    assert any(f"_{state_format}_" in name for name in names), names


def lowered_step(block_size: int) -> str:
  """The fused step for a (4, 256) gradient, lowered for CUDA with ``implementation=None``."""
  grad = jnp.ones((4, 256), jnp.float32)
  moments = fused_step.zero_moments(grad.shape, state_format="8bit", block_size=block_size)

  def step(grad, moments):
    return fused_step.lowbit_adamw_update(
        grad, moments, count=1, b1=0.9, b2=0.999, eps=1e-8, state_format="8bit", block_size=block_size
    )

  return _backend.lower_for_cuda(step, grad, moments)


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_auto_on_hopper_runs_the_path_the_table_names(monkeypatch, kernel_faster):
  monkeypatch.setattr(dispatch, "cuda_target_runs_mosaic_gpu", lambda: True)
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "lowbit_adamw_update", kernel_faster)
  assert ("mosaic_gpu" in lowered_step(128)) == kernel_faster


def test_auto_off_hopper_runs_xla(monkeypatch):
  monkeypatch.setattr(dispatch, "cuda_target_runs_mosaic_gpu", lambda: False)
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "lowbit_adamw_update", True)
  assert "mosaic_gpu" not in lowered_step(128)
