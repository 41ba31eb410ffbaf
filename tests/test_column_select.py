"""TACO's per-row selection: the reference against numpy; the tuned XLA path and the Mosaic GPU kernel
(interpreted) against the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _backend, dispatch
from pallas_kernels.column_select import (
  MAX_SEGMENT_WIDTH,
  column_select,
  column_select_reference,
  default_segment_width,
)

pytestmark = pytest.mark.kernels


def draw_case(seed, rows, width, tracked, dtype=np.float32):
  """Small integers (many ties) and distinct tracked columns per row."""
  rng = np.random.default_rng(seed)
  grads = rng.integers(-3, 4, (rows, width)).astype(dtype)
  index = np.stack([rng.choice(width, tracked, replace=False) for _ in range(rows)])
  offset = rng.integers(-4, 5, (rows, tracked)).astype(np.float32)
  return grads, index.reshape(rows, tracked).astype(np.int32), offset


def numpy_selection(grads, index, offset, keep):
  """Each row's columns sorted by decreasing |u|, then increasing column: the first ``keep``."""
  u = grads.astype(np.float32).copy()
  for r in range(u.shape[0]):
    u[r, index[r]] += offset[r]
  columns = np.arange(u.shape[1])
  order = np.stack([np.lexsort((columns, -np.abs(row)))[:keep] for row in u])
  return order, np.take_along_axis(u, order, axis=1)


def lowers_to_the_kernel(args, **kwargs):
  """Whether ``column_select(*args, **kwargs)`` lowered for CUDA calls the Mosaic GPU kernel."""
  text = _backend.lower_for_cuda(functools.partial(column_select, **kwargs), *args)
  return _backend.MOSAIC_GPU_CALL in text


def selection_cases():
  # rows, width, tracked, keep: argmax, one tracked entry (TACO's default),
  # several, keep = width, a width of one kernel lane and more.
  return [
    (5, 7, 0, 1),
    (3, 256, 1, 1),
    (4, 70, 1, 1),
    (3, 37, 3, 1),
    (4, 40, 6, 6),
    (3, 33, 4, 9),
    (2, 5, 5, 5),
  ]


@pytest.mark.parametrize("rows, width, tracked, keep", selection_cases())
def test_reference_ranks_like_numpy_with_ties_toward_lower_columns(rows, width, tracked, keep, seed):
  grads, index, offset = draw_case(seed, rows, width, tracked)
  selection = column_select_reference(jnp.asarray(grads), jnp.asarray(index), jnp.asarray(offset), keep=keep)
  want_index, want_value = numpy_selection(grads, index, offset, keep)
  np.testing.assert_array_equal(selection.index, want_index, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(selection.value, want_value, err_msg=f"seed={seed}")


@pytest.mark.parametrize("rows, width, tracked, keep", selection_cases())
def test_xla_path_matches_the_reference(rows, width, tracked, keep, seed):
  grads, index, offset = draw_case(seed, rows, width, tracked)
  args = (jnp.asarray(grads), jnp.asarray(index), jnp.asarray(offset))
  want = column_select_reference(*args, keep=keep)
  got = column_select(*args, keep=keep, implementation="xla")
  np.testing.assert_array_equal(got.index, want.index, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(got.value, want.value, err_msg=f"seed={seed}")


@pytest.mark.parametrize(
  "rows, width, tracked, keep, segment_width, dtype",
  [
    (3, 40, 0, 1, None, np.float32),  # argmax, the row padded to 128
    (3, 70, 1, 1, None, jnp.bfloat16),  # TACO's default: one tracked entry, keep 1
    (2, 256, 16, 16, None, jnp.bfloat16),  # one segment, all slots tracked
    (3, 300, 5, 7, 128, np.float32),  # three segments, the last one padded
    (2, 512, 3, 4, 128, jnp.bfloat16),  # four segments merged by XLA
    (3, 130, 2, 3, 128, np.float32),  # a last segment with fewer columns than keep
  ],
)
def test_kernel_matches_the_reference_in_the_interpreter(
  rows,
  width,
  tracked,
  keep,
  segment_width,
  dtype,
  seed,
):
  grads, index, offset = draw_case(seed, rows, width, tracked, dtype)
  args = (jnp.asarray(grads), jnp.asarray(index), jnp.asarray(offset))
  # The kernel takes this case (no fallback to XLA): the comparison is kernel against reference.
  assert lowers_to_the_kernel(args, keep=keep, implementation="pallas", segment_width=segment_width)
  want = column_select_reference(*args, keep=keep)
  got = column_select(*args, keep=keep, implementation="interpret", segment_width=segment_width)
  np.testing.assert_array_equal(got.index, want.index, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(got.value, want.value, err_msg=f"seed={seed}")


@pytest.mark.parametrize("hopper", [True, False])
def test_automatic_choice_takes_the_kernel_on_hopper_only(monkeypatch, hopper):
  monkeypatch.setattr(dispatch, "cuda_target_runs_mosaic_gpu", lambda: hopper)
  grads = (jax.ShapeDtypeStruct((8, 256), jnp.bfloat16),)
  tracked = (
    jax.ShapeDtypeStruct((8, 256), jnp.float32),
    jax.ShapeDtypeStruct((8, 1), jnp.int32),
    jax.ShapeDtypeStruct((8, 1), jnp.float32),
  )
  assert lowers_to_the_kernel(grads) == hopper
  assert lowers_to_the_kernel(tracked, keep=1) == hopper
  # What the kernel cannot take goes to XLA, on Hopper too.
  assert not lowers_to_the_kernel(
    (jax.ShapeDtypeStruct((1, 2 * MAX_SEGMENT_WIDTH), jnp.float32),), keep=MAX_SEGMENT_WIDTH + 1
  )


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("implementation", ["reference", "xla", "interpret"])
def test_ties_nan_and_zero_rows(implementation, keep):
  grads = jnp.array(
    [
      [1.0, -2.0, 2.0, -2.0],  # three tied magnitudes: the lowest column wins
      [0.0, -0.0, 0.0, 0.0],  # all zero (and a negative zero): column 0
      [1.0, jnp.inf, jnp.nan, -5.0],  # NaN ranks above infinity
    ]
  )
  if implementation == "reference":
    selection = column_select_reference(grads, keep=keep)
  else:
    selection = column_select(grads, keep=keep, implementation=implementation)
  np.testing.assert_array_equal(selection.index, np.array([[1, 2, 3], [0, 1, 2], [2, 1, 3]])[:, :keep])
  np.testing.assert_array_equal(selection.value[0], np.array([-2.0, 2.0, -2.0])[:keep])
  assert np.isnan(selection.value[2, 0])


def test_a_short_last_segment_never_offers_a_column_twice():
  # Segments of 128 cut 130 columns into 128 + 2: the last one holds fewer
  # columns than keep = 3, and the largest entries.
  grads = jnp.zeros((1, 130)).at[0, 128].set(10.0).at[0, 129].set(-9.0).at[0, 5].set(1.0)
  selection = column_select(grads, keep=3, implementation="interpret", segment_width=128)
  np.testing.assert_array_equal(selection.index, [[128, 129, 5]])
  np.testing.assert_array_equal(selection.value, [[10.0, -9.0, 1.0]])


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("tracked, keep", [(0, 1), (1, 1), (3, 2)])
def test_leading_row_axes_select_as_the_flattened_rows(implementation, tracked, keep, seed):
  grads, index, offset = draw_case(seed, 6, 40, tracked)
  flat_index, flat_value = numpy_selection(grads, index, offset, keep)
  batched = column_select(
    *(jnp.asarray(x).reshape(2, 3, x.shape[-1]) for x in (grads, index, offset)),
    keep=keep,
    implementation=implementation,
  )
  assert batched.index.shape == batched.value.shape == (2, 3, keep)
  np.testing.assert_array_equal(batched.index.reshape(6, keep), flat_index, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(batched.value.reshape(6, keep), flat_value, err_msg=f"seed={seed}")


def test_tracked_offsets_change_the_ranking():
  grads = jnp.array([[3.0, 1.0, -2.0, 0.5]])
  # The offset at column 3 lifts it to 4.5, the one at column 0 cancels it.
  selection = column_select(grads, jnp.array([[3, 0]]), jnp.array([[4.0, -3.0]]), keep=2, implementation="xla")
  np.testing.assert_array_equal(selection.index, [[3, 2]])
  np.testing.assert_array_equal(selection.value, [[4.5, -2.0]])


def test_default_segment_width_pads_rows_least():
  assert default_segment_width(40, 1) == 128  # one padded segment
  assert default_segment_width(4096, 16) == MAX_SEGMENT_WIDTH
  assert default_segment_width(8192, 16) == MAX_SEGMENT_WIDTH
  # 11008 = 86 * 128 = 2 * 43 * 128: no divisor of 86 lanes lies in [2, 32]
  # but 2, so 43 segments of 256 and no padding.
  assert default_segment_width(11008, 16) == 256
  # keep = 300 needs 3 lanes or more: 3 segments of 29 lanes pad 86 to 87,
  # the least possible (86 has no divisor in [3, 32]).
  assert default_segment_width(11008, 300) == 29 * 128
  assert default_segment_width(2 * MAX_SEGMENT_WIDTH, MAX_SEGMENT_WIDTH + 1) is None


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(grads=jnp.zeros((4,))), "grads must be a floating array"),
    (dict(grads=jnp.zeros((2, 4), jnp.int32)), "grads must be a floating array"),
    (dict(keep=0), r"keep must be an int \[1, 4\] \(at most the row width\); got 0"),
    (dict(keep=5), r"keep must be an int \[1, 4\] \(at most the row width\); got 5"),
    (dict(keep=1.5), "keep must be an int"),
    (dict(keep=jnp.asarray(1)), r"keep .* static_args"),
    (dict(tracked_index=jnp.zeros((2, 1), jnp.int32)), "must be given together"),
    (
      dict(tracked_index=jnp.zeros((3, 1), jnp.int32), tracked_offset=jnp.zeros((3, 1))),
      r"tracked_index must have shape \[\*rows=\[2\], t\]",
    ),
    (
      dict(tracked_index=jnp.zeros((2, 1), jnp.int32), tracked_offset=jnp.zeros((2, 2))),
      "same shape",
    ),
    (
      dict(tracked_index=jnp.zeros((2, 1)), tracked_offset=jnp.zeros((2, 1))),
      "tracked_index must be integer",
    ),
    (dict(segment_width=100), "segment_width must be a multiple of 128"),
    (
      dict(grads=jnp.zeros((2, 200)), keep=130, segment_width=128),
      r"segment_width must be an int >= 130 \(a multiple of 128, at least keep\); got 128",
    ),
    (dict(implementation="cuda"), "implementation must be one of"),
  ],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
  arguments = dict(grads=jnp.zeros((2, 4)), keep=1)
  arguments.update(kwargs)
  grads = arguments.pop("grads")
  with pytest.raises(ValueError, match=match):
    column_select(grads, **arguments)


def test_kernel_refuses_more_slots_than_a_segment_holds():
  grads = jnp.zeros((1, 2 * MAX_SEGMENT_WIDTH))
  with pytest.raises(ValueError, match="keep must be at most"):
    column_select(grads, keep=MAX_SEGMENT_WIDTH + 1, implementation="interpret")
  # Auto picks XLA instead (on any machine, the kernel cannot take it).
  assert column_select(grads, keep=MAX_SEGMENT_WIDTH + 1).index.shape == (
    1,
    MAX_SEGMENT_WIDTH + 1,
  )
