"""Block top-k of ``y + dequantize(q)``: the reference against numpy (decoding
and ranking re-derived), the XLA path and the Triton kernel (Pallas'
interpreter) against the reference exactly, argument errors, and the
automatic choice of implementation on a (faked) Hopper GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _backend, dispatch, feedback_topk, quantize, topk
from tests.test_topk import draw_input, numpy_block_topk

pytestmark = pytest.mark.kernels


def draw(kind, size, dtype, bits, bucket_size, seed):
  """A gradient of ``kind`` and the quantized error of a smaller random one (bfloat16 statistics, as MicroAdam)."""
  y = draw_input(kind, (size,), dtype, seed)
  error = 0.3 * np.random.default_rng(seed + 1).standard_normal(size).astype(np.float32)
  if kind == "sparse":  # error feedback of zeros too: ties at 0 with zero codes
    error[:] = 0.0
  q = quantize.quantize(jnp.asarray(error), bits=bits, bucket_size=bucket_size, stats_dtype=jnp.bfloat16)
  return q, y


def numpy_feedback_topk(q, y, *, density, block_size, bits, bucket_size):
  """Independent re-derivation: the codes unpacked by hand, ``min + q (max - min) fl(1 / levels)`` in float32.

  A 4-bit byte holds element ``j`` (low nibble) and ``j + 128`` (high) of a
  row of 256; whole rows only (a short last row has a tail rule of its own).
  """
  packed = np.asarray(q.codes)
  size = y.size
  if bits == 8:
    codes = packed[:size]
  else:
    rows = np.zeros(-(-size // 256) * 128, np.uint8)
    rows[: packed.size] = packed
    rows = rows.reshape(-1, 128)
    codes = np.concatenate([rows % 16, rows // 16], axis=1).reshape(-1)[:size]
  bucket = np.arange(size) // bucket_size
  minimum = np.asarray(q.minimum.astype(jnp.float32))[bucket]
  maximum = np.asarray(q.maximum.astype(jnp.float32))[bucket]
  step = (maximum - minimum) * np.float32(1 / (2**bits - 1))
  accumulated = np.asarray(y.astype(jnp.float32)) + (minimum + codes.astype(np.float32) * step)
  return numpy_block_topk(accumulated, density, block_size)


CASES = [
  # size, block_size, bucket_size, bits, dtype
  (3 * 1024, 1024, 256, 4, jnp.float32),
  (2 * 1024 + 300, 1024, 1024, 4, jnp.float32),  # a tail, through XLA
  (700, 1024, 256, 4, jnp.float32),  # only a tail
  (4 * 256, 256, 32, 4, jnp.bfloat16),
  (2 * 512 + 7, 512, 64, 8, jnp.float16),
]


@pytest.mark.parametrize("size, block_size, bucket_size, bits, dtype", CASES)
@pytest.mark.parametrize("kind", ["normal", "integers", "sparse", "special"])
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_implementations_equal_the_reference(size, block_size, bucket_size, bits, dtype, kind, implementation, seed):
  q, y = draw(kind, size, dtype, bits, bucket_size, seed)
  kwargs = dict(density=0.05, block_size=block_size, bits=bits, bucket_size=bucket_size)
  # Jitted, as the implementations are: XLA may contract min + q s into one fma.
  expected = jax.jit(functools.partial(feedback_topk.feedback_topk_reference, **kwargs))(q, y)
  indices, values = feedback_topk.feedback_topk(q, y, implementation=implementation, **kwargs)
  assert indices.dtype == jnp.int16 and values.dtype == jnp.float32
  np.testing.assert_array_equal(indices, expected[0], err_msg=f"seed={seed}")
  np.testing.assert_array_equal(values, expected[1], err_msg=f"seed={seed}")


@pytest.mark.parametrize(
  "size, block_size, bucket_size, bits, dtype", [c for c in CASES if c[3] == 8 or c[0] % 256 == 0]
)
@pytest.mark.parametrize("kind", ["normal", "integers"])
def test_reference_equals_numpy(size, block_size, bucket_size, bits, dtype, kind, seed):
  q, y = draw(kind, size, dtype, bits, bucket_size, seed)
  kwargs = dict(density=0.05, block_size=block_size, bits=bits, bucket_size=bucket_size)
  indices, values = feedback_topk.feedback_topk_reference(q, y, **kwargs)
  expected_indices, expected_values = numpy_feedback_topk(q, y, **kwargs)
  np.testing.assert_array_equal(indices, expected_indices, err_msg=f"seed={seed}")
  np.testing.assert_allclose(values, expected_values, rtol=1e-6, err_msg=f"seed={seed}")


def test_ties_at_the_threshold_take_the_lowest_indices():
  # Every magnitude equal: the first k of each block, in both implementations.
  q = quantize.quantize(jnp.zeros(512), bits=4, bucket_size=256)
  y = jnp.where(jnp.arange(512) % 2 == 0, 1.0, -1.0)
  for implementation in ("xla", "interpret"):
    indices, values = feedback_topk.feedback_topk(
      q, y, density=0.02, block_size=256, bucket_size=256, implementation=implementation
    )
    np.testing.assert_array_equal(indices, np.tile(np.arange(6), 2))
    np.testing.assert_array_equal(values, np.tile([1.0, -1.0], 6))


@pytest.mark.parametrize("implementation", [None, "xla", "interpret"])
def test_an_empty_input_gives_an_empty_selection(implementation):
  q = quantize.quantize(jnp.zeros((0, 4)), bits=4, bucket_size=256)
  indices, values = feedback_topk.feedback_topk(
    q, jnp.zeros((0, 4)), density=0.05, block_size=256, bucket_size=256, implementation=implementation
  )
  assert indices.shape == values.shape == (0,)


@pytest.mark.parametrize(
  "kwargs, argument",
  [
    (dict(block_size=768), "block_size"),  # a multiple of 256, not a power of two
    (dict(block_size=128), "block_size"),
    (dict(bucket_size=768, block_size=1536), "block_size"),
    (dict(bucket_size=512, block_size=256), "bucket_size"),
  ],
)
def test_what_the_kernel_cannot_do_names_the_argument(kwargs, argument):
  settings = dict(density=0.05, block_size=1024, bucket_size=256) | kwargs
  q = quantize.quantize(jnp.zeros(3072), bits=4, bucket_size=settings["bucket_size"])
  with pytest.raises(ValueError, match=argument):
    feedback_topk.feedback_topk(q, jnp.zeros(3072), implementation="pallas", **settings)
  # The default takes XLA for what the kernel lacks.
  indices, _ = feedback_topk.feedback_topk(q, jnp.zeros(3072), **settings)
  expected = topk.selection_size(3072, density=0.05, block_size=settings["block_size"])
  assert indices.shape == (expected,)


@pytest.mark.parametrize(
  "change, argument",
  [
    (dict(density=0.0), "density"),
    (dict(block_size=0), "block_size"),
    (dict(bits=3), "bits"),
    (dict(bucket_size=100), "bucket_size"),
  ],
)
def test_bad_arguments_name_themselves(change, argument):
  q = quantize.quantize(jnp.zeros(1024), bits=4, bucket_size=256)
  kwargs = dict(density=0.05, block_size=256, bits=4, bucket_size=256) | change
  with pytest.raises(ValueError, match=argument):
    feedback_topk.feedback_topk(q, jnp.zeros(1024), **kwargs)


def test_a_quantized_array_of_another_size_is_refused():
  q = quantize.quantize(jnp.zeros(1024), bits=4, bucket_size=256)
  with pytest.raises(ValueError, match="q does not match size=2048"):
    feedback_topk.feedback_topk(q, jnp.zeros(2048), density=0.05, block_size=256, bucket_size=256)


def lowered(block_size: int) -> str:
  size = 4 * block_size
  q = quantize.QuantizedArray(
    jax.ShapeDtypeStruct((size // 2,), jnp.uint8),
    jax.ShapeDtypeStruct((size // 256,), jnp.bfloat16),
    jax.ShapeDtypeStruct((size // 256,), jnp.bfloat16),
  )
  fn = functools.partial(feedback_topk.feedback_topk, density=0.01, block_size=block_size, bucket_size=256)
  return _backend.lower_for_cuda(fn, q, jax.ShapeDtypeStruct((size,), jnp.float32))


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_auto_on_hopper_runs_the_path_the_table_names(monkeypatch, kernel_faster):
  monkeypatch.setattr(dispatch, "cuda_target_runs_mosaic_gpu", lambda: True)
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "feedback_topk", kernel_faster)
  assert (_backend.TRITON_CALL in lowered(1024)) == kernel_faster
  # And for a block size the kernel lacks, XLA, whatever the table says.
  assert _backend.TRITON_CALL not in lowered(768)


def test_auto_off_hopper_runs_xla(monkeypatch):
  monkeypatch.setattr(dispatch, "cuda_target_runs_mosaic_gpu", lambda: False)
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "feedback_topk", True)
  assert _backend.TRITON_CALL not in lowered(1024)
