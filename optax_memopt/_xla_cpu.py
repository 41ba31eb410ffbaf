"""One leaf after another on XLA:CPU: the one scheduling aid the optimizers keep.

XLA:CPU schedules independent work stage by stage (every leaf's first
fusion, then every leaf's second, ...), so every leaf's temporaries (a
decoded moment, a top-k's input, a re-encoded block) are live at once. For
a compressed optimizer that is tens to hundreds of MB at 10M-40M
parameters, above glibc's 32 MiB threshold for fresh mappings, which XLA's
per-call temporary buffer then faults in at every step: the step took 2-3x
as long without this (``docs/performance-notes.md``). :func:`tree_map` makes
each leaf's step wait for the previous leaf's state, so the buffer holds one
leaf's temporaries. Values are unchanged. On other backends it is
``jax.tree.map``: temporaries come from a pool there, and the wait would
cost a small kernel per leaf.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax


def _written_out(x: jax.Array) -> jax.Array:
  """``x``, written to a buffer of its own: rewriting an element in place stops XLA from fusing it into every reader."""
  return lax.dynamic_update_slice(x, x[:1], (0,))


def _zero_after(values: Any) -> jax.Array:
  """A uint32 zero that XLA can compute only once every array in ``values`` is.

  The largest of each array's first element as unsigned bits, clipped to at
  most 0: always 0, but XLA cannot know that without the elements. Written
  out once, so that it is not recomputed inside every loop that reads it.
  """
  clipped = [jnp.zeros((), jnp.uint32)]
  for x in jax.tree.leaves(values):
    if x.size == 0 or not jnp.issubdtype(x.dtype, jnp.number):
      continue
    first = x[(0,) * x.ndim]
    unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    bits = first if x.dtype == unsigned else lax.bitcast_convert_type(first, unsigned)
    clipped.append(jnp.minimum(bits, 0).astype(jnp.uint32))
  return jnp.max(_written_out(jnp.stack(clipped)))


def _after(x: Any, token: jax.Array) -> Any:
  """``x`` unchanged (``x - 0``, exact for -0.0, NaN and inf), computed only after ``token``."""
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.number):
    return x
  return x - token.astype(x.dtype)


def tree_map(
    step: Callable[..., tuple[Any, ...]],
    tree: Any,
    *rest: Any,
    with_path: bool = False,
) -> Any:
  """``jax.tree.map(step, tree, *rest)``; on XLA:CPU one leaf after another.

  Args:
    step: one parameter's step, returning ``(direction, *state)``. The next
      leaf waits for the state; the direction is left for XLA to fuse into
      its one consumer, the parameters' update.
    tree: the gradients; ``rest`` trees with ``tree``'s structure as a prefix.
    with_path: pass each leaf's key path as ``step``'s first argument, as
      ``jax.tree_util.tree_map_with_path`` does.

  Returns:
    A tree like ``tree`` of ``step``'s results.
  """
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  columns = [[leaf for _, leaf in paths_and_leaves]] + [treedef.flatten_up_to(r) for r in rest]
  one_after_another = jax.default_backend() == "cpu"
  results = []
  for (path, _), args in zip(paths_and_leaves, zip(*columns)):
    if one_after_another and results:
      token = _zero_after(results[-1][1:])
      args = [jax.tree.map(lambda x: _after(x, token), arg) for arg in args]
    results.append(step(path, *args) if with_path else step(*args))
  return treedef.unflatten(results)
