"""Which implementation of an op runs: the switch every op and optimizer takes.

Every op of ``pallas_kernels`` takes ``implementation=``:

* ``None``: the op's default for the device, from :data:`FASTER_ON_HOPPER`:
  the Pallas kernel on a Hopper-or-newer NVIDIA GPU where it measured faster
  than XLA there (``benchmarks/README.md``), XLA everywhere else;
* ``"xla"``: the jnp/XLA path (any backend);
* ``"pallas"``: the Mosaic GPU kernel; fails loudly where it cannot run
  rather than falling back;
* ``"interpret"``: the kernel in the Mosaic GPU interpreter on the CPU, for
  tests.
"""

from __future__ import annotations

from typing import Literal

import jax

Implementation = Literal["xla", "pallas", "interpret"] | None
IMPLEMENTATIONS = (None, "xla", "pallas", "interpret")

# Per op, whether its Pallas kernel beat XLA on a Hopper GPU (H200). One table,
# so that a new measurement changes one line.
FASTER_ON_HOPPER: dict[str, bool] = {
    "block_topk": False,
    "quantize": True,
    "ternary": True,
    "microadam_update": False,
    "column_select": True,
    "ternary_adam_update": False,
    "lowbit_adamw_update": False,
}

# Mosaic GPU targets Hopper (sm_90) and newer; older GPUs take the XLA path.
_MIN_MOSAIC_COMPUTE_CAPABILITY = 9.0


def default_device_runs_mosaic_gpu() -> bool:
  """Whether JAX's default device is an NVIDIA GPU of compute capability >= 9.0."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  try:
    return float(getattr(device, "compute_capability", None)) >= _MIN_MOSAIC_COMPUTE_CAPABILITY
  except (TypeError, ValueError):
    return False


def check(implementation: Implementation) -> None:
  """Raises ``ValueError`` naming ``implementation`` unless it is one of :data:`IMPLEMENTATIONS`."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        "implementation must be one of None, 'xla', 'pallas' or 'interpret';"
        f" got {implementation!r}."
    )


def resolve(op: str, implementation: Implementation) -> str:
  """``implementation`` checked, with ``None`` turned into ``op``'s default for the device."""
  check(implementation)
  if implementation is None:
    return "pallas" if FASTER_ON_HOPPER[op] and default_device_runs_mosaic_gpu() else "xla"
  return implementation
