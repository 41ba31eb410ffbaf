"""How Mosaic GPU kernels are built, interpreted and lowered the same way on
every supported JAX version, and how the XLA paths steer XLA:CPU's fusion and
scheduling without changing values."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def written_out(x: jax.Array) -> jax.Array:
  """``x``, computed once into a buffer of its own that every consumer reads.

  XLA fuses a chain of cheap elementwise operations into each of its
  consumers and recomputes it there: a value that two loops read (a
  quantizer's statistics, then its codes) is computed twice, the second
  time inside a loop that may not vectorize. ``lax.optimization_barrier``
  does not stop that on XLA:CPU, which removes barriers before fusing.
  Rewriting the first element in place (a ``dynamic_update_slice``, which
  updates its operand's buffer) makes XLA write ``x`` out once. The values
  are unchanged; only where XLA computes them changes. MicroAdam's step on
  the CPU went from 124 to 108 ms at 10M parameters and from 491 to 370 ms
  at 40M this way (``benchmarks/README.md``).
  """
  if x.size == 0:
    return x
  flat = x.reshape(-1)
  return jax.lax.dynamic_update_slice(flat, flat[:1], (0,)).reshape(x.shape)


def _on_xla_cpu() -> bool:
  return jax.default_backend() == "cpu"


def _zero_after(values: Any) -> jax.Array:
  """A uint32 zero that XLA can compute only once every array in ``values`` is.

  The largest of each array's first element as unsigned bits, clipped to at
  most 0: always 0, but XLA cannot know that without the elements. The
  clipped elements are written out (``written_out``) before their maximum:
  computed elementwise, the zero would be fused into every loop that reads
  the arguments offset by it and recomputed there for each element, which
  made ternary Adam's step at 40M parameters 94 ms instead of 56.
  """
  clipped = [jnp.zeros((), jnp.uint32)]
  for x in jax.tree.leaves(values):
    if x.size == 0 or not jnp.issubdtype(x.dtype, jnp.number):
      continue
    first = x[(0,) * x.ndim]
    unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    bits = first if x.dtype == unsigned else lax.bitcast_convert_type(first, unsigned)
    clipped.append(jnp.minimum(bits, 0).astype(jnp.uint32))
  return jnp.max(written_out(jnp.stack(clipped)))


def _after(x: Any, token: jax.Array) -> Any:
  """``x`` unchanged (``x - 0``, exact for -0.0, NaN and inf), computed only after ``token``."""
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.number):
    return x
  return x - token.astype(x.dtype)


def zeros_after(shape: tuple[int, ...], dtype: Any, after: Any) -> jax.Array:
  """Zeros of ``shape`` and ``dtype`` that XLA:CPU creates only once ``after`` is computed.

  XLA merges equal arrays of zeros into one and copies it for each user
  that updates it in place (the target of a scatter-add); nothing orders
  those copies, and XLA:CPU's scheduler makes them all first, each live
  until its scatter. These zeros (``0 - 0``) wait for a zero computed from
  ``after``, the scatter's other input, and are not merged with others.
  Elsewhere (GPUs), plain zeros.
  """
  zeros = jnp.zeros(shape, dtype)
  return _after(zeros, _zero_after(after)) if _on_xla_cpu() else zeros


def sum_after(x: jax.Array, axis: int | tuple[int, ...], after: Any) -> jax.Array:
  """``jnp.sum(x, axis)``, which XLA:CPU computes only once ``after`` is computed.

  The sum starts from a zero computed from ``after`` instead of a constant.
  In ``one_leaf_at_a_time`` a reduction of an argument that does not wait
  (a gradient as given) then still waits for the previous leaf through
  ``after`` (an argument that does). Reducing the waiting argument instead
  costs a pass: XLA:CPU's XNNPACK reductions read only written-out arrays,
  so XLA first writes out a copy of the argument offset by its zero.
  Elsewhere (GPUs), a plain sum.
  """
  if not _on_xla_cpu():
    return jnp.sum(x, axis=axis)
  axes = tuple(a % x.ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
  return lax.reduce(x, _zero_after(after).astype(x.dtype), lax.add, axes)


def one_leaf_at_a_time(
    update_leaf: Callable[..., Any],
    *columns: Sequence[Any],
    waiting: Sequence[int],
    awaited: Sequence[int] | None = None,
    chains: int = 1,
) -> list[Any]:
  """``[update_leaf(*args) for args in zip(*columns)]``, on XLA:CPU one leaf after another.

  XLA:CPU schedules independent work stage by stage (every leaf's first
  fusion, then every leaf's second, ...) so that independent loops may run
  side by side. For an optimizer whose step per leaf writes temporaries (a
  decoded moment, a top-k's input), every leaf's temporaries are then live
  at once: 55.6 MB for ternary Adam at 40M parameters, 94.8 MB for
  MicroAdam at 10M, above glibc's 32 MiB threshold for mapping fresh pages,
  which XLA's per-call temporary buffer then faults in at every step. Here
  the arguments of the columns listed in ``waiting`` (pytrees of arrays)
  depend on a zero computed from the previous leaf's results, so each
  leaf's work starts once the previous leaf's is done, the temporary buffer
  holds one leaf's temporaries, and a leaf's passes over its gradient run
  back to back. Values are unchanged. Elsewhere (GPUs) the leaves are left
  independent: temporaries come from a pool there, and the zero would cost
  a small kernel per leaf, a collective when the leaf is sharded.

  Args:
    update_leaf: the step of one leaf.
    *columns: its arguments, one sequence per parameter, one entry per leaf.
    waiting: the indices of the columns whose arguments wait for the
      previous leaf. Leave out arguments updated in place (a donated ring
      buffer): an offset copy of them would be written out anew.
    awaited: the indices of the results of ``update_leaf`` (a tuple) that
      the next leaf waits for; None: all of them. A result left out (a
      direction) is not read by the zero, so XLA may fuse its computation
      into its one consumer (the parameters' update) instead of writing it
      out; it still waits for the previous leaf through its inputs.
    chains: leaf ``i`` waits for leaf ``i - chains``, so that many leaves'
      steps may run side by side (one leaf's single-threaded reductions
      beside another's loops), at that many leaves' temporaries.

  Returns:
    The results of ``update_leaf``, one per leaf.
  """
  if any(column not in range(len(columns)) for column in waiting):
    raise ValueError(
        f"waiting must hold indices of the {len(columns)} columns; got {tuple(waiting)}."
    )
  if isinstance(chains, bool) or not isinstance(chains, int) or chains < 1:
    raise ValueError(f"chains must be an int >= 1; got {chains!r}.")

  def awaited_results(result):
    if awaited is None:
      return result
    if not isinstance(result, tuple) or any(index not in range(len(result)) for index in awaited):
      raise ValueError(
          f"awaited must hold indices of update_leaf's results (a tuple); got {tuple(awaited)}."
      )
    return [result[index] for index in awaited]

  chained = _on_xla_cpu()
  results, awaited_by_next = [], []
  for args in zip(*columns):
    if chained and len(results) >= chains:
      token = _zero_after(awaited_by_next[-chains])
      args = [
          jax.tree.map(lambda x: _after(x, token), arg) if column in waiting else arg
          for column, arg in enumerate(args)
      ]
    results.append(update_leaf(*args))
    awaited_by_next.append(awaited_results(results[-1]))
  return results


def gpu_interpreter() -> Any:
  """Parameters that run a ``plgpu.kernel`` in the Mosaic GPU interpreter.

  Plain ``interpret=True`` cannot bind the grid's axis names; the Mosaic GPU
  interpreter can, and checks for races. It lives in a private module of JAX,
  imported here only.
  """
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError as e:  # pragma: no cover - depends on the JAX version.
    raise RuntimeError(
        "implementation='interpret' needs the Mosaic GPU interpreter"
        " (jax._src.pallas.mosaic_gpu.interpret), which this JAX"
        f" {jax.__version__} does not provide."
    ) from e
  return InterpretGPUParams()


def mosaic_gpu_kernel(
    body: Callable[..., None],
    *,
    out_type: Any,
    grid: tuple[int, ...],
    grid_names: tuple[str, ...],
    interpret: bool,
    scratch_types: Any = (),
) -> Callable[..., Any]:
  """``plgpu.kernel``, lowered for Mosaic GPU or run by its interpreter."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu.kernel(
      body,
      out_type=out_type,
      scratch_types=scratch_types,
      grid=grid,
      grid_names=grid_names,
      interpret=gpu_interpreter() if interpret else None,
  )


def cuda_lowering_context() -> contextlib.AbstractContextManager[Any]:
  """A context in which a CPU-only machine can lower kernels for CUDA.

  From JAX 0.12 lowering for CUDA without a GPU needs an abstract target
  device; older versions accept the same context, so it is always used.
  """
  try:
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  except ImportError:  # pragma: no cover - depends on the JAX version.
    return contextlib.nullcontext()
  h200 = AbstractMesh(
      (1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "gpu")
  )
  return use_abstract_mesh(h200)


def lower_for_cuda(fn: Callable[..., Any], *args: Any) -> str:
  """Lowers ``jax.jit(fn)(*args)`` for CUDA and returns the StableHLO text."""
  with cuda_lowering_context():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


MOSAIC_GPU_CALL = "mosaic_gpu"
TRITON_CALL = "triton"


class LoweringExample(NamedTuple):
  """One kernel call that ``check_lowering`` lowers for CUDA.

  Kernel modules list theirs in a ``lowering_examples()`` function; ``fn``
  must call the kernel with ``implementation="pallas"``.
  """

  name: str
  backend: str  # MOSAIC_GPU_CALL or TRITON_CALL: the custom call to expect.
  fn: Callable[..., Any]
  args: tuple[Any, ...]
