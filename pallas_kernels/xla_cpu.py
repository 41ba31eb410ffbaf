"""The scheduling aids XLA:CPU needs, each the plain computation on other backends.

Values are never changed, only where XLA:CPU computes them (and the
order in which :func:`reduce_row` adds, which XLA's reduction leaves
open). Each aid is chosen when the program is lowered (``jax.lax.platform_dependent``): a
program lowered for a GPU carries none of them, whatever the process's
default backend. Each aid is kept because it buys a measured share of an optimizer's CPU step
(why each: ``docs/performance-notes.md``; the measurements: this file's git history).

:func:`tree_map`, one leaf after another (optimizers reach it through
``optax_memopt.leaves.map_steps``). XLA:CPU schedules independent
work stage by stage (every leaf's first fusion, then every leaf's second,
...), so every leaf's temporaries (a decoded moment, a top-k's input, a
re-encoded block) are live at once. For a compressed optimizer they add up
to more than glibc's 32 MiB threshold for fresh mappings, so XLA's per-call
temporary buffer is faulted in afresh at every step, page by page, which
costs as much as the step's own work or more. :func:`tree_map` makes each leaf's
step wait for the previous leaf's state, so the buffer holds one leaf's
temporaries. On other backends it is ``jax.tree.map``: temporaries come
from a pool there, and the wait would cost a small kernel per leaf.

:func:`written_out`, for the zero that :func:`tree_map`'s leaves wait on:
XLA fuses a cheap elementwise producer into each of its consumers and
recomputes it there. :func:`reduce_row`, for ops' XLA paths: XLA:CPU fuses
a row reduction with its input's computation only over at most
``FUSED_REDUCTION`` entries (a wider one first writes the whole input out),
and reduces short rows one at a time, without vector instructions.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

# The widest row reduction XLA:CPU fuses with the computation of its input.
FUSED_REDUCTION = 32

# The name scope of every aid's operations: a lowered program's debug
# information shows whether it carries any (``Lowered.as_text(debug_info=True)``).
SCOPE = "xla_cpu_aid"


def _in_scope(aided: Callable[..., Any]) -> Callable[..., Any]:
  def scoped(*args: Any) -> Any:
    with jax.named_scope(SCOPE):
      return aided(*args)

  return scoped


def _on_xla_cpu(x: Any, aided: Callable[..., Any], *rest: Any) -> Any:
  """``aided(x, *rest)`` in a program lowered for the CPU, ``x`` in any other."""
  return lax.platform_dependent(x, *rest, cpu=_in_scope(aided), default=lambda x, *_: x)


def written_out(x: jax.Array) -> jax.Array:
  """``x``; on XLA:CPU computed once into a buffer that all its readers share.

  For a value several loops read (the zero that :func:`tree_map`'s leaves
  wait on), which XLA:CPU would otherwise compute again inside each of
  them, perhaps in a loop that does not vectorize. Rewriting the first
  element in place makes XLA write ``x`` out (``lax.optimization_barrier``
  does not: XLA:CPU removes barriers before fusing).
  """
  if x.size == 0:
    return x

  def rewrite_first_element(x):
    flat = x.reshape(-1)
    return lax.dynamic_update_slice(flat, flat[:1], (0,)).reshape(x.shape)

  return _on_xla_cpu(x, rewrite_first_element)


def reduce_row(values: Any, init_values: Any, combine: Callable[[Any, Any], Any], *, fold_to: int = 1) -> Any:
  """``lax.reduce(values, init_values, combine)`` over the last axis; on XLA:CPU folded in halves first.

  As for ``lax.reduce``, ``values`` is an array or a tuple of arrays of one
  shape, ``init_values`` their identities and ``combine`` the binary reduction
  (``lax.max``; on tuples of arrays for a tuple). In a CPU program, while the
  rows are even and wider than ``fold_to``, ``combine`` merges their two
  halves elementwise, in loops that vectorize and fuse with the values'
  computation; what is left reduces in chunks of the widest divisor up to
  ``fold_to``, then across chunks. ``fold_to=1`` for short rows (a
  quantizer's blocks of 32 to 256 entries), which XLA:CPU reduces one at a
  time without vector instructions; ``FUSED_REDUCTION`` for wide rows, which
  it fuses with their input's computation only up to that width. Maxima and
  minima are the same bits; sums add in another order (XLA's reduce fixes
  none, and backends differ).
  """

  def halves(values, part):
    return jax.tree.map(lambda v: v[..., part], values)

  def reduce(values, axis):
    return lax.reduce(values, init_values, combine, (jax.tree.leaves(values)[0].ndim + axis,))

  def folded(values):
    width = jax.tree.leaves(values)[0].shape[-1]
    while width % 2 == 0 and width > fold_to:
      width //= 2
      values = combine(halves(values, slice(None, width)), halves(values, slice(width, None)))
    chunk = max(d for d in range(1, min(width, fold_to) + 1) if width % d == 0)
    chunks = jax.tree.map(lambda v: v.reshape(*v.shape[:-1], width // chunk, chunk), values)
    return reduce(reduce(chunks, -1), -1)

  return lax.platform_dependent(values, cpu=_in_scope(folded), default=lambda values: reduce(values, -1))


def _bits(x: jax.Array) -> jax.Array:
  """``x``'s bits as an unsigned integer array of its width."""
  unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
  return x if x.dtype == unsigned else lax.bitcast_convert_type(x, unsigned)


def _is_numeric_array(x: Any) -> bool:
  return hasattr(x, "dtype") and (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer))


def _zero_after(values: Any) -> jax.Array:
  """A uint32 zero that XLA can compute only once every array in ``values`` is.

  The largest of each array's first element as unsigned bits, clipped to at
  most 0: always 0, but XLA cannot know that without the elements. Written
  out once, so that it is not recomputed inside every loop that reads it
  (read only by the CPU program; XLA removes it from any other).
  """
  clipped = [jnp.zeros((), jnp.uint32)]
  for x in jax.tree.leaves(values):
    if x.size and _is_numeric_array(x):
      clipped.append(jnp.minimum(_bits(x[(0,) * x.ndim]), 0).astype(jnp.uint32))
  return jnp.max(written_out(jnp.stack(clipped)))


def _after(x: Any, token: jax.Array) -> Any:
  """``x`` unchanged (its bits minus a zero), computed only after ``token``.

  On the bits, so that it stays one integer operation for float8 too.
  """
  bits = _bits(x)
  bits = bits - token.astype(bits.dtype)
  return bits if bits.dtype == x.dtype else lax.bitcast_convert_type(bits, x.dtype)


def _wait(arrays: list[Any], token: jax.Array) -> list[Any]:
  """``arrays``, computed after ``token`` in a program lowered for the CPU.

  One platform-dependent branch for a leaf's arrays, not one per array:
  each is traced for every platform.
  """
  return _on_xla_cpu(arrays, lambda arrays, token: [_after(x, token) for x in arrays], token)


def _awaited(state: tuple[Any, ...]) -> list[Any]:
  """What the next leaf waits for: a leaf's state, the results of its step after the direction.

  The direction is left out, for XLA to fuse into its one consumer, the
  parameters' update. A result that names ``awaited_fields`` (a NamedTuple
  of an op's state) contributes only the arrays of those fields, or all its
  arrays where those hold none: an op leaves out an array computed through
  a table read, since the wait reads its first element, and XLA then writes
  the table read out rather than compute it twice.
  """
  awaited = []
  for result in state:
    fields = getattr(result, "awaited_fields", ())
    chosen = jax.tree.leaves([getattr(result, field) for field in fields])
    awaited.append(chosen or result)
  return awaited


def tree_map(step: Callable[..., tuple[Any, ...]], tree: Any, *rest: Any) -> Any:
  """``jax.tree.map(step, tree, *rest)``; on XLA:CPU one leaf after another.

  Args:
    step: one parameter's step, returning ``(direction, *state)``; each leaf's
      step waits for the previous leaf's state (:func:`_awaited`).
    tree: the gradients; ``rest`` trees with ``tree``'s structure as a prefix.

  Returns:
    A tree like ``tree`` of ``step``'s results.
  """
  leaves, treedef = jax.tree.flatten(tree)
  columns = [leaves] + [treedef.flatten_up_to(r) for r in rest]
  results = []
  for args in zip(*columns):
    if results:
      token = _zero_after(_awaited(results[-1][1:]))
      flat, structure = jax.tree.flatten(args)
      numeric = [i for i, x in enumerate(flat) if _is_numeric_array(x)]
      for i, x in zip(numeric, _wait([flat[i] for i in numeric], token)):
        flat[i] = x
      args = jax.tree.unflatten(structure, flat)
    results.append(step(*args))
  return treedef.unflatten(results)
