"""TACO's per-row selection: the reference against numpy; the tuned XLA path against the reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.column_select import column_select, column_select_reference

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


def selection_cases():
  # rows, width, tracked, keep, dtype: argmax, one tracked entry (TACO's
  # default), several, keep = width, every slot tracked, bfloat16 rows.
  return [
    (5, 7, 0, 1, np.float32),
    (3, 256, 1, 1, np.float32),
    (4, 70, 1, 1, np.float32),
    (3, 37, 3, 1, np.float32),
    (4, 40, 6, 6, np.float32),
    (3, 33, 4, 9, np.float32),
    (2, 5, 5, 5, np.float32),
    (3, 40, 0, 1, jnp.bfloat16),
    (3, 70, 1, 1, jnp.bfloat16),
    (2, 256, 16, 16, jnp.bfloat16),
    (2, 512, 3, 4, jnp.bfloat16),
    (3, 300, 5, 7, np.float32),
  ]


@pytest.mark.parametrize("rows, width, tracked, keep, dtype", selection_cases())
def test_reference_ranks_like_numpy_with_ties_toward_lower_columns(rows, width, tracked, keep, dtype, seed):
  grads, index, offset = draw_case(seed, rows, width, tracked, dtype)
  selection = column_select_reference(jnp.asarray(grads), jnp.asarray(index), jnp.asarray(offset), keep=keep)
  want_index, want_value = numpy_selection(grads, index, offset, keep)
  np.testing.assert_array_equal(selection.index, want_index, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(selection.value, want_value, err_msg=f"seed={seed}")


@pytest.mark.parametrize("rows, width, tracked, keep, dtype", selection_cases())
def test_xla_path_matches_the_reference(rows, width, tracked, keep, dtype, seed):
  grads, index, offset = draw_case(seed, rows, width, tracked, dtype)
  args = (jnp.asarray(grads), jnp.asarray(index), jnp.asarray(offset))
  want = column_select_reference(*args, keep=keep)
  got = column_select(*args, keep=keep)
  np.testing.assert_array_equal(got.index, want.index, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(got.value, want.value, err_msg=f"seed={seed}")


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("path", ["reference", "xla"])
def test_ties_nan_and_zero_rows(path, keep):
  grads = jnp.array(
    [
      [1.0, -2.0, 2.0, -2.0],  # three tied magnitudes: the lowest column wins
      [0.0, -0.0, 0.0, 0.0],  # all zero (and a negative zero): column 0
      [1.0, jnp.inf, jnp.nan, -5.0],  # NaN ranks above infinity
    ]
  )
  if path == "reference":
    selection = column_select_reference(grads, keep=keep)
  else:
    selection = column_select(grads, keep=keep)
  np.testing.assert_array_equal(selection.index, np.array([[1, 2, 3], [0, 1, 2], [2, 1, 3]])[:, :keep])
  np.testing.assert_array_equal(selection.value[0], np.array([-2.0, 2.0, -2.0])[:keep])
  assert np.isnan(selection.value[2, 0])


@pytest.mark.parametrize("tracked, keep", [(0, 1), (1, 1), (3, 2)])
def test_leading_row_axes_select_as_the_flattened_rows(tracked, keep, seed):
  grads, index, offset = draw_case(seed, 6, 40, tracked)
  flat_index, flat_value = numpy_selection(grads, index, offset, keep)
  batched = column_select(
    *(jnp.asarray(x).reshape(2, 3, x.shape[-1]) for x in (grads, index, offset)),
    keep=keep,
  )
  assert batched.index.shape == batched.value.shape == (2, 3, keep)
  np.testing.assert_array_equal(batched.index.reshape(6, keep), flat_index, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(batched.value.reshape(6, keep), flat_value, err_msg=f"seed={seed}")


def test_tracked_offsets_change_the_ranking():
  grads = jnp.array([[3.0, 1.0, -2.0, 0.5]])
  # The offset at column 3 lifts it to 4.5, the one at column 0 cancels it.
  selection = column_select(grads, jnp.array([[3, 0]]), jnp.array([[4.0, -3.0]]), keep=2)
  np.testing.assert_array_equal(selection.index, [[3, 2]])
  np.testing.assert_array_equal(selection.value, [[4.5, -2.0]])


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
  ],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
  arguments = dict(grads=jnp.zeros((2, 4)), keep=1)
  arguments.update(kwargs)
  grads = arguments.pop("grads")
  with pytest.raises(ValueError, match=match):
    column_select(grads, **arguments)


@pytest.mark.parametrize("removed", [dict(implementation="xla"), dict(segment_width=128)])
def test_the_deleted_kernels_arguments_raise_naming_them(removed):
  (name,) = removed
  with pytest.raises(TypeError, match=name):
    column_select(jnp.zeros((2, 4)), **removed)
