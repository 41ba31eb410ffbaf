"""MicroAdam's error feedback (``pallas_kernels.error_feedback``).

``feedback_step``, the selection and the re-encoded error in one op: the
Triton kernel (Pallas' interpreter) against the XLA path bit for bit and
both against the references, argument errors, and the automatic choice of
implementation on a (faked) Hopper GPU. Its XLA path's two halves:
``feedback_topk``, the block top-k of ``y + dequantize(q)``, against its
reference and the reference against numpy (decoding and ranking
re-derived); ``requantize_unselected`` against the references, zeroing a
selection's positions whatever its values. ``zero_selected`` against a
numpy scatter of zeros. The old import paths warn."""

from __future__ import annotations

import functools
import importlib
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _backend, dispatch, error_feedback, microadam_update, packing, quantize, topk
from tests.test_quantize import draw_input as draw_quantizer_input
from tests.test_topk import CASES as TOPK_CASES
from tests.test_topk import KINDS, documented_keep, draw_input, numpy_block_topk

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


def expected_step(q, y, **kwargs):
  """The references composed: ``feedback_topk_reference``'s selection, then ``quantize_reference`` of ``a`` without it.

  Jitted, as the implementations are: XLA may contract min + q s into one fma.
  """
  return jax.jit(functools.partial(error_feedback.feedback_step_reference, **kwargs))(q, y)


def assert_step_equals(got, want, bits, message):
  """``feedback_step``'s result against ``feedback_step_reference``'s (the error unpacked), bit for bit."""
  indices, values, error = got
  assert indices.dtype == jnp.int16 and values.dtype == jnp.float32
  np.testing.assert_array_equal(indices, want[0], err_msg=message)
  np.testing.assert_array_equal(values, want[1], err_msg=message)
  codes, minimum, maximum = want[2]
  np.testing.assert_array_equal(
    packing.unpack(error.codes, codes.size, base=2**bits, planes=8 // bits), codes, err_msg=message
  )
  np.testing.assert_array_equal(error.minimum.astype(jnp.float32), minimum, err_msg=message)
  np.testing.assert_array_equal(error.maximum.astype(jnp.float32), maximum, err_msg=message)


@pytest.mark.parametrize("size, block_size, bucket_size, bits, dtype", CASES)
@pytest.mark.parametrize("kind", ["normal", "integers", "sparse", "special"])
def test_feedback_topk_equals_the_reference(size, block_size, bucket_size, bits, dtype, kind, seed):
  q, y = draw(kind, size, dtype, bits, bucket_size, seed)
  kwargs = dict(density=0.05, block_size=block_size, bits=bits, bucket_size=bucket_size)
  expected = jax.jit(functools.partial(error_feedback.feedback_topk_reference, **kwargs))(q, y)
  indices, values = error_feedback.feedback_topk(q, y, **kwargs)
  assert indices.dtype == jnp.int16 and values.dtype == jnp.float32
  np.testing.assert_array_equal(indices, expected[0], err_msg=f"seed={seed}")
  np.testing.assert_array_equal(values, expected[1], err_msg=f"seed={seed}")


@pytest.mark.parametrize("size, block_size, bucket_size, bits, dtype", CASES)
@pytest.mark.parametrize("kind", ["normal", "integers", "sparse", "special"])
def test_feedback_step_kernel_equals_xla_and_the_references(size, block_size, bucket_size, bits, dtype, kind, seed):
  q, y = draw(kind, size, dtype, bits, bucket_size, seed)
  kwargs = dict(density=0.05, block_size=block_size, bits=bits, bucket_size=bucket_size, stats_dtype=jnp.bfloat16)
  results = {
    implementation: error_feedback.feedback_step(q, y, implementation=implementation, **kwargs)
    for implementation in ("xla", "interpret")
  }
  chex.assert_trees_all_equal(results["interpret"], results["xla"], custom_message=f"seed={seed}")
  assert_step_equals(results["xla"], expected_step(q, y, **kwargs), bits, f"seed={seed}")


@pytest.mark.parametrize(
  "size, block_size, bucket_size, bits, dtype", [c for c in CASES if c[3] == 8 or c[0] % 256 == 0]
)
@pytest.mark.parametrize("kind", ["normal", "integers"])
def test_reference_equals_numpy(size, block_size, bucket_size, bits, dtype, kind, seed):
  q, y = draw(kind, size, dtype, bits, bucket_size, seed)
  kwargs = dict(density=0.05, block_size=block_size, bits=bits, bucket_size=bucket_size)
  indices, values = error_feedback.feedback_topk_reference(q, y, **kwargs)
  expected_indices, expected_values = numpy_feedback_topk(q, y, **kwargs)
  np.testing.assert_array_equal(indices, expected_indices, err_msg=f"seed={seed}")
  np.testing.assert_allclose(values, expected_values, rtol=1e-6, err_msg=f"seed={seed}")


def test_ties_at_the_threshold_take_the_lowest_indices():
  # Every magnitude equal: the first k of each block, in both implementations.
  q = quantize.quantize(jnp.zeros(512), bits=4, bucket_size=256)
  y = jnp.where(jnp.arange(512) % 2 == 0, 1.0, -1.0)
  for implementation in ("xla", "interpret"):
    indices, values, error = error_feedback.feedback_step(
      q, y, density=0.02, block_size=256, bucket_size=256, implementation=implementation
    )
    np.testing.assert_array_equal(indices, np.tile(np.arange(6), 2))
    np.testing.assert_array_equal(values, np.tile([1.0, -1.0], 6))
    # What is left is the block from its seventh entry on, -1 and 1 alternating.
    np.testing.assert_array_equal(error.minimum, [-1.0, -1.0])
    np.testing.assert_array_equal(error.maximum, [1.0, 1.0])


@pytest.mark.parametrize("implementation", [None, "xla", "interpret"])
def test_an_empty_input_gives_an_empty_selection(implementation):
  q = quantize.quantize(jnp.zeros((0, 4)), bits=4, bucket_size=256)
  indices, values, error = error_feedback.feedback_step(
    q, jnp.zeros((0, 4)), density=0.05, block_size=256, bucket_size=256, implementation=implementation
  )
  assert indices.shape == values.shape == error.codes.shape == error.minimum.shape == (0,)


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
    error_feedback.feedback_step(q, jnp.zeros(3072), implementation="pallas", **settings)
  # The default takes XLA for what the kernel lacks.
  indices, _, _ = error_feedback.feedback_step(q, jnp.zeros(3072), **settings)
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
  for op in (error_feedback.feedback_step, error_feedback.feedback_topk):
    with pytest.raises(ValueError, match=argument):
      op(q, jnp.zeros(1024), **kwargs)
  with pytest.raises(ValueError, match="stats_dtype"):
    error_feedback.feedback_step(
      q, jnp.zeros(1024), density=0.05, block_size=256, bucket_size=256, stats_dtype=jnp.int8
    )
  with pytest.raises(ValueError, match="implementation"):
    error_feedback.feedback_step(
      q, jnp.zeros(1024), density=0.05, block_size=256, bucket_size=256, implementation="gpu"
    )


def test_a_quantized_array_of_another_size_is_refused():
  q = quantize.quantize(jnp.zeros(1024), bits=4, bucket_size=256)
  for op in (error_feedback.feedback_step, error_feedback.feedback_topk):
    with pytest.raises(ValueError, match="q does not match size=2048"):
      op(q, jnp.zeros(2048), density=0.05, block_size=256, bucket_size=256)


def lowered(block_size: int) -> str:
  size = 4 * block_size
  q = quantize.QuantizedArray(
    jax.ShapeDtypeStruct((size // 2,), jnp.uint8),
    jax.ShapeDtypeStruct((size // 256,), jnp.bfloat16),
    jax.ShapeDtypeStruct((size // 256,), jnp.bfloat16),
  )
  fn = functools.partial(error_feedback.feedback_step, density=0.01, block_size=block_size, bucket_size=256)
  return _backend.lower_for_cuda(fn, q, jax.ShapeDtypeStruct((size,), jnp.float32))


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_auto_on_hopper_runs_the_path_the_table_names(monkeypatch, kernel_faster):
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: True)
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "feedback_step", kernel_faster)
  assert (_backend.TRITON_CALL in lowered(1024)) == kernel_faster
  # And for a block size the kernel lacks, XLA, whatever the table says.
  assert _backend.TRITON_CALL not in lowered(768)


def test_auto_off_hopper_runs_xla(monkeypatch):
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: False)
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "feedback_step", True)
  assert _backend.TRITON_CALL not in lowered(1024)


# (shape, y dtype, bits, bucket_size, top-k block size, density, stats dtype):
# MicroAdam's defaults with a short last block and bucket, 8 bits with a
# bfloat16 y, buckets of one row, and blocks of one bucket.
REQUANTIZE_CASES = [
  ((2 * 16384 + 1000,), jnp.float32, 4, 1024, 16384, 0.01, jnp.bfloat16),
  ((3, 1000), jnp.bfloat16, 8, 512, 1024, 0.05, jnp.float32),
  ((2, 1100), jnp.float32, 4, 256, 512, 0.25, jnp.bfloat16),
  ((700,), jnp.float16, 4, 256, 256, 0.1, jnp.bfloat16),
]


@pytest.mark.parametrize("shape,dtype,bits,bucket_size,block_size,density,stats_dtype", REQUANTIZE_CASES)
@pytest.mark.parametrize("error", ["random", "zero"])
def test_feedback_step_re_encodes_what_its_selection_left(
  shape, dtype, bits, bucket_size, block_size, density, stats_dtype, error, seed
):
  """The kernel in the interpreter against XLA bit for bit, XLA against its two halves, and both against the
  references: top-k of ``y + dequantize(q)`` zeroed, quantized. With a zero error ``x = y`` holds runs of
  equal magnitudes, so each block's selection ends inside a run of ties at its threshold."""
  message = f"seed={seed}"
  rng = np.random.default_rng(seed)
  size = math.prod(shape)
  kwargs = dict(bits=bits, bucket_size=bucket_size)
  e = np.array(draw_quantizer_input((size,), jnp.float32, bucket_size, seed)) if error == "random" else np.zeros(size)
  y = rng.standard_normal(size)
  y[rng.random(size) < 0.3] = -1.5  # ties: more than k of them in every block
  # The short last bucket's error decodes far below its x (where padding,
  # decoded as the old minimum, would widen the bucket's range).
  last = size - size % bucket_size
  e[last:] = np.where(e[last:] == 0, 0, -50 - rng.random(size - last))
  y[last:] += np.where(e[last:] == 0, 0, 100)
  q = quantize.quantize(jnp.asarray(e, jnp.float32), stats_dtype=stats_dtype, **kwargs)
  y = jnp.asarray(y.reshape(shape), dtype)
  selection = dict(density=density, block_size=block_size)
  results = {
    implementation: error_feedback.feedback_step(
      q, y, **selection, stats_dtype=stats_dtype, implementation=implementation, **kwargs
    )
    for implementation in ("xla", "interpret")
  }
  chex.assert_trees_all_equal(results["interpret"], results["xla"], custom_message=message)
  indices, values = error_feedback.feedback_topk(q, y, **selection, **kwargs)
  halves = (
    indices,
    values,
    error_feedback.requantize_unselected(q, y, indices, values, **selection, stats_dtype=stats_dtype, **kwargs),
  )
  chex.assert_trees_all_equal(results["xla"], halves, custom_message=message)
  assert_step_equals(results["xla"], expected_step(q, y, **selection, stats_dtype=stats_dtype, **kwargs), bits, message)


def test_requantize_unselected_zeroes_the_given_positions_whatever_their_values(seed):
  """A selection whose values are one ulp larger in magnitude than the ``x`` this program decodes
  (as where another program, rounding the decoding otherwise, ranked ``x``): exactly its positions
  are zeroed. A rule that compared the decoded ``x`` with a bound read from the values would leave
  each block's smallest selected entries in place."""
  size, bits, bucket_size, block_size, density = 3 * 1024 + 300, 4, 256, 1024, 0.05
  kwargs = dict(bits=bits, bucket_size=bucket_size)
  rng = np.random.default_rng(seed)
  q = quantize.quantize(
    draw_quantizer_input((size,), jnp.float32, bucket_size, seed), stats_dtype=jnp.bfloat16, **kwargs
  )
  y = jnp.asarray(rng.standard_normal(size), jnp.float32)
  x = np.asarray(quantize.dequantize_add(q, y, **kwargs))
  indices, values = topk.block_topk(jnp.asarray(x), density=density, block_size=block_size)
  values = np.asarray(values)
  perturbed = jnp.asarray(np.nextafter(values, np.copysign(np.inf, values)))
  assert (perturbed != values).all()
  result = error_feedback.requantize_unselected(
    q,
    y,
    indices,
    perturbed,
    density=density,
    block_size=block_size,
    stats_dtype=jnp.bfloat16,
    **kwargs,
  )
  positions = microadam_update.flat_positions(indices, k=topk.entries_kept(block_size, density), block_size=block_size)
  zeroed = x.copy()
  zeroed[np.asarray(positions)] = 0.0
  codes, minimum, maximum = quantize.quantize_reference(jnp.asarray(zeroed), stats_dtype=jnp.bfloat16, **kwargs)
  np.testing.assert_array_equal(packing.unpack(result.codes, size, base=2**bits, planes=8 // bits), codes)
  np.testing.assert_array_equal(result.minimum.astype(jnp.float32), minimum)
  np.testing.assert_array_equal(result.maximum.astype(jnp.float32), maximum)


def numpy_zero_selected(x, density: float, block_size: int) -> np.ndarray:
  """Zeros at the positions numpy_block_topk selects: the scatter that zero_selected avoids."""
  flat = np.asarray(x).reshape(-1).copy()
  indices, _ = numpy_block_topk(x, density, block_size)
  offset = 0
  for start in range(0, flat.size, block_size):
    keep = documented_keep(min(block_size, flat.size - start), density)
    flat[start + indices[offset : offset + keep]] = 0
    offset += keep
  return flat.reshape(np.shape(x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, density, block_size", TOPK_CASES + [((0,), 0.3, 8), ((10,), 0.75, 4)])
def test_zero_selected_equals_zeroing_the_selected_positions(shape, density, block_size, dtype, kind, seed):
  x = draw_input(kind, shape, dtype, seed)
  indices, values = topk.block_topk(x, density=density, block_size=block_size)
  zeroed = error_feedback.zero_selected(x, indices, values, density=density, block_size=block_size)
  chex.assert_shape(zeroed, shape)
  chex.assert_type(zeroed, dtype)
  expected = numpy_zero_selected(np.asarray(x.astype(jnp.float32)), density, block_size)
  # Bitwise, so a -0.0 left in place or a NaN payload would show.
  np.testing.assert_array_equal(
    np.asarray(zeroed.astype(jnp.float32)).view(np.uint32),
    expected.astype(np.float32).view(np.uint32),
    err_msg=f"seed={seed}",
  )


def test_zero_selected_rejects_a_selection_it_cannot_have_come_from():
  x = jnp.ones((300,))
  indices, values = topk.block_topk(x, density=0.03, block_size=128)
  with pytest.raises(ValueError, match="indices and values must have shape"):
    error_feedback.zero_selected(x, indices[:-1], values[:-1], density=0.03, block_size=128)
  with pytest.raises(ValueError, match="block_size"):
    error_feedback.zero_selected(x, indices, values, density=0.03, block_size=0)
  # Only the indices are read: values of another dtype (MicroAdam's ring holds bfloat16) are taken.
  chex.assert_trees_all_equal(
    error_feedback.zero_selected(x, indices, values.astype(jnp.bfloat16), density=0.03, block_size=128),
    error_feedback.zero_selected(x, indices, values, density=0.03, block_size=128),
  )
  with pytest.raises(ValueError, match="floating dtype"):
    error_feedback.zero_selected(x.astype(jnp.int32), indices, values, density=0.03, block_size=128)


def test_the_old_import_paths_warn_and_give_the_moved_functions():
  with pytest.warns(DeprecationWarning, match="pallas_kernels.error_feedback.requantize_unselected"):
    assert quantize.requantize_unselected is error_feedback.requantize_unselected
  with pytest.warns(DeprecationWarning, match="pallas_kernels.feedback_topk moved to pallas_kernels.error_feedback"):
    moved = importlib.reload(importlib.import_module("pallas_kernels.feedback_topk"))
  assert moved.feedback_topk is error_feedback.feedback_topk
  assert moved.feedback_topk_reference is error_feedback.feedback_topk_reference
