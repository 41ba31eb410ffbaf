"""Helpers every Mosaic GPU kernel of the package shares: building a kernel,
running it in the interpreter, and lowering it for CUDA on any machine, the
same way on every supported JAX version."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import jax


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
  in_place: tuple[int, ...] = (),
) -> Callable[..., Any]:
  """``plgpu.kernel``, lowered for Mosaic GPU or run by its interpreter.

  ``in_place`` lists operands the kernel overwrites: the body gets each one's
  ref again as an output, before ``out_type``'s, and the call returns their
  new values first (``out_type`` must then be a tuple). Compiled, they are
  passed as ``jax.Ref`` s, which the custom call updates in the operand's
  buffer (no copy where the operand is donated); the interpreter, which
  takes no refs, writes them to new arrays, the body being the same.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if not in_place:
    return plgpu.kernel(
      body,
      out_type=out_type,
      scratch_types=scratch_types,
      grid=grid,
      grid_names=grid_names,
      interpret=gpu_interpreter() if interpret else None,
    )

  def call(*operands):
    if interpret:
      overwritten = tuple(jax.ShapeDtypeStruct(operands[i].shape, operands[i].dtype) for i in in_place)
      return mosaic_gpu_kernel(
        body,
        out_type=overwritten + tuple(out_type),
        grid=grid,
        grid_names=grid_names,
        interpret=True,
        scratch_types=scratch_types,
      )(*operands)
    refs = [jax.new_ref(x) if i in in_place else x for i, x in enumerate(operands)]

    def aliased_body(*kernel_refs):
      inputs = kernel_refs[: len(operands)]
      return body(*inputs, *(inputs[i] for i in in_place), *kernel_refs[len(operands) :])

    outputs = pl.kernel(
      aliased_body,
      out_type=tuple(out_type),
      mesh=plgpu.Mesh(grid=grid, grid_names=grid_names),
      scratch_types=scratch_types,
    )(*refs)
    return (*(jax.freeze(refs[i]) for i in in_place), *outputs)

  return call


def cuda_lowering_context() -> contextlib.AbstractContextManager[Any]:
  """A context in which a CPU-only machine can lower kernels for CUDA.

  From JAX 0.12 lowering for CUDA without a GPU needs an abstract target
  device; older versions accept the same context, so it is always used.
  """
  try:
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  except ImportError:  # pragma: no cover - depends on the JAX version.
    return contextlib.nullcontext()
  h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "gpu"))
  return use_abstract_mesh(h200)


def lower_for_cuda(fn: Callable[..., Any], *args: Any) -> str:
  """Lowers ``jax.jit(fn)(*args)`` for CUDA and returns the StableHLO text."""
  with cuda_lowering_context():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


MOSAIC_GPU_CALL = "mosaic_gpu"
TRITON_CALL = "__gpu$xla.gpu.triton"


class LoweringExample(NamedTuple):
  """One kernel call that ``check_lowering`` lowers for CUDA.

  Kernel modules list theirs in a ``lowering_examples()`` function; ``fn``
  must call the kernel with ``implementation="pallas"``.
  """

  name: str
  backend: str  # MOSAIC_GPU_CALL or TRITON_CALL: the custom call to expect in the lowered program.
  fn: Callable[..., Any]
  args: tuple[Any, ...]
