"""Helpers the package's kernels share: lowering them for CUDA on any machine,
the same way on every supported JAX version, and the lowering examples that
``check_lowering`` lowers."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import jax


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


TRITON_CALL = "__gpu$xla.gpu.triton"


class LoweringExample(NamedTuple):
  """One kernel call that ``check_lowering`` lowers for CUDA.

  Kernel modules list theirs in a ``lowering_examples()`` function; ``fn``
  must call the kernel with ``implementation="pallas"``.
  """

  name: str
  backend: str  # TRITON_CALL: the custom call to expect in the lowered program.
  fn: Callable[..., Any]
  args: tuple[Any, ...]
