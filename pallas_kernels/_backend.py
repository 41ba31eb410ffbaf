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
  h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "gpu"))
  return use_abstract_mesh(h200)


def lower_for_cuda(fn: Callable[..., Any], *args: Any) -> str:
  """Lowers ``jax.jit(fn)(*args)`` for CUDA and returns the StableHLO text."""
  with cuda_lowering_context():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


MOSAIC_GPU_CALL = "mosaic_gpu"


class LoweringExample(NamedTuple):
  """One kernel call that ``check_lowering`` lowers for CUDA.

  Kernel modules list theirs in a ``lowering_examples()`` function; ``fn``
  must call the kernel with ``implementation="pallas"``.
  """

  name: str
  backend: str  # MOSAIC_GPU_CALL: the custom call to expect in the lowered program.
  fn: Callable[..., Any]
  args: tuple[Any, ...]
