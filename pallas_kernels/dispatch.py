"""Which implementation of an op runs: the switch every op with a kernel, and every optimizer, takes.

Every op of ``pallas_kernels`` with a kernel takes ``implementation=``:

* ``None``: the op's default for the platform the program is lowered for,
  from :data:`FASTER_ON_HOPPER`: the Pallas kernel in a program lowered for a
  Hopper-or-newer NVIDIA GPU where the kernel moved fewer bytes or measured
  faster than XLA there (``benchmarks/README.md``), XLA everywhere else. The
  choice is made when the program is lowered (``jax.lax.platform_dependent``),
  never from the process's default backend, so that a program compiled for a
  GPU from a CPU host is the GPU's program;
* ``"xla"``: the jnp/XLA path (any backend);
* ``"pallas"``: the op's kernel (Triton, as its module says why); fails
  loudly where it cannot run rather than falling back;
* ``"interpret"``: the kernel in its Pallas interpreter on the CPU, for
  tests.

Why each implementation beside the reference is kept. The H100 compile's
bytes of today's defaults are in ``benchmarks/data/h100_compile.json``; the
commits named hold the before-and-after measurements; the kernels timed on
an H200 against XLA are in ``benchmarks/README.md``, "On an H200".

* ``error_feedback.feedback_step`` (MicroAdam's selection and its error
  re-encoded). XLA path: the default off Hopper and for a tail block. Triton
  kernel, the default on Hopper: one program per block in registers reads
  the gradient and the error codes once, selects, and rewrites the codes
  in place, where XLA's path reads them twice for the selection (its exact
  two-stage top-k) and again to re-encode. MicroAdam's bytes moved per
  parameter in the H100 compile of two Llama-2-7B layers: 25.6 to 20.7
  with float32 parameters, 16.7 to 13.9 with bfloat16
  (``benchmarks/data/h100_compile.json``). It replaced two kernels, one per
  half: a Triton top-k (on an H200, JAX 0.11.2, 32M elements, it agreed
  with XLA exactly and took 1.06x XLA's time for the op alone) and a
  Mosaic GPU re-encoding (0.58x XLA's time, but then zeroing the selection
  by a rank bound compared with its own decoded error, which the GPU
  compiler rounded otherwise than the top-k's program, so that at a
  block's threshold a selected entry stayed: ``benchmarks/data/h200/kernels.json``).
  The fused kernel zeroes the selection it wrote, from the one decoded
  error it computed. It has not run on a GPU: untimed, and its agreement
  with XLA there unchecked.
* ``topk.block_topk``: an XLA path and no kernel; it is ``feedback_topk``'s
  XLA path, the reference's selection in two exact stages on float32-bitcast
  keys (XLA:CPU's partial-sort ``TopK``; MicroAdam's CPU step, commit
  7c637d5). Its Mosaic GPU kernel, slower than XLA's ``TopK`` on an H200
  and reached by no optimizer, is deleted.
* ``quantize.quantize``, ``dequantize`` and ``dequantize_add``: an XLA
  path and no kernel, not switched here. XLA fuses the decoding into its
  readers, which moves fewer bytes than a kernel writing it out
  (MicroAdam's H100 compile, commit 12570ed), and the library quantizes
  only in ``requantize_unselected``'s XLA path. Their Mosaic GPU kernels,
  the default nowhere or reached by no optimizer, are deleted.
* ``column_select`` (TACO's heavy hitters): an XLA path and no kernel,
  not switched here: TACO selects with XLA on every platform. Its Mosaic
  GPU kernel agreed with XLA exactly but was slower on an H200 (JAX 0.11.2,
  ``python -m benchmarks.kernels --size 33554432 --repeats 20``, medians,
  XLA against the kernel): each row's argmax on bfloat16 rows of 4096,
  0.095 against 0.108 ms; TACO's default layout (rows in 16 parts of 256,
  one tracked heavy hitter each), 0.107 against 0.169 ms. It is deleted.
* ``map_codes`` (low-bit AdamW's codes) has no kernel and is not switched
  here: ``lax.platform_dependent`` picks, per platform, one of two XLA
  paths beside the reference's binary search. XLA:CPU reads tables: one
  read per element instead of a search (8-bit AdamW's CPU step, commits
  2375677, 1017bdd), and float8 by table because XLA:CPU converts float8 in
  software (commit 1017bdd). Every other platform computes codes and
  entries from each element alone, so that XLA:GPU writes the new codes in
  place: fewer bytes in low-bit AdamW's H100 compile (commit 3559e85).
"""

from __future__ import annotations

from typing import Callable, Literal, TypeVar

import jax
from jax import lax

Implementation = Literal["xla", "pallas", "interpret"] | None
IMPLEMENTATIONS = (None, "xla", "pallas", "interpret")

# Per op, whether its Pallas kernel is the default for a Hopper-or-newer GPU
# (why: the module docstring). One table, so that a new measurement changes
# one line. Blackwell (B200, sm_100a) takes the same defaults, none of them
# timed: no kernel has run on a Blackwell GPU. They follow the bytes moved
# in the B200 compile of two Llama-2-7B layers, where the step that holds
# kernels (MicroAdam's) moves fewer bytes with them than on XLA alone, as in
# the H100 compile.
FASTER_ON_HOPPER: dict[str, bool] = {
  # MicroAdam's selection and re-encoded error in one pass over the gradient
  # and the codes (fewer bytes in the H100 compile; untimed on a GPU).
  "feedback_step": True,
}

# The kernels are written for Hopper (sm_90) and newer; older GPUs take the XLA path.
_MIN_COMPUTE_CAPABILITY = 9.0

T = TypeVar("T")


def cuda_target_is_hopper_or_newer() -> bool:
  """Whether a program lowered for CUDA in this process targets Hopper or newer.

  The process's CUDA devices decide where it has them. A process without any
  (a CPU-only machine lowering or compiling ahead of time for a GPU target
  description) targets Hopper, the generation the kernels are written for.
  """
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return True
  try:
    return all(float(d.compute_capability) >= _MIN_COMPUTE_CAPABILITY for d in devices)
  except (AttributeError, TypeError, ValueError):
    return False


def check(implementation: Implementation) -> None:
  """Raises ``ValueError`` naming ``implementation`` unless it is one of :data:`IMPLEMENTATIONS`."""
  if not (implementation is None or (isinstance(implementation, str) and implementation in IMPLEMENTATIONS)):
    raise ValueError(f"implementation must be one of None, 'xla', 'pallas' or 'interpret'; got {implementation!r}.")


def run(op: str, implementation: Implementation, path: Callable[[str], T], *, unsupported: str | None = None) -> T:
  """``path`` called with the implementation that runs ``op``.

  Args:
    op: a key of :data:`FASTER_ON_HOPPER`.
    implementation: the caller's choice, checked; a named one is honoured
      everywhere.
    path: computes the op given ``"xla"``, ``"pallas"`` or ``"interpret"``.
    unsupported: why the kernel cannot run on these arguments, or ``None``.
      Then a named kernel raises ``ValueError`` with this text, and ``None``
      takes XLA.

  Returns:
    ``path(implementation)``, or for ``None`` the kernel in a program lowered
    for a Hopper-or-newer GPU where :data:`FASTER_ON_HOPPER` says so and the
    kernel supports the arguments, and XLA in every other program.
  """
  check(implementation)
  if implementation in ("pallas", "interpret") and unsupported is not None:
    raise ValueError(unsupported)
  if implementation is not None:
    return path(implementation)
  if not FASTER_ON_HOPPER[op] or unsupported is not None:
    return path("xla")
  return lax.platform_dependent(
    cuda=lambda: path("pallas" if cuda_target_is_hopper_or_newer() else "xla"),
    default=lambda: path("xla"),
  )
