"""Lowers every Pallas kernel of the package for CUDA, on any machine.

Run ``python -m pallas_kernels.check_lowering``: one row per kernel (name,
backend, ``lowered`` or the error), and a non-zero exit if any kernel fails
to lower or lowers to another backend than it declares. Kernel modules take
part by defining ``lowering_examples()``; no list here needs editing.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import Iterator

import jax

import pallas_kernels
from pallas_kernels import _backend


def kernel_examples() -> Iterator[_backend.LoweringExample]:
  """Every ``LoweringExample`` declared by a module of ``pallas_kernels``."""
  for info in sorted(pkgutil.iter_modules(pallas_kernels.__path__), key=lambda m: m.name):
    if info.name == "check_lowering":
      continue
    module = importlib.import_module(f"pallas_kernels.{info.name}")
    examples = getattr(module, "lowering_examples", None)
    if examples is not None:
      yield from examples()


def check(example: _backend.LoweringExample) -> str:
  """``"lowered"``, or why the example did not lower to its backend."""
  try:
    text = _backend.lower_for_cuda(example.fn, *example.args)
  except Exception as e:  # Report every failure as a row; never stop early.
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{type(e).__name__}: {first_line[:160]}"
  if example.backend not in text:
    return f"lowered, but no {example.backend} custom call in the program"
  return "lowered"


def main() -> int:
  examples = list(kernel_examples())
  if not examples:
    print("no kernels found", file=sys.stderr)
    return 1
  rows = [(e.name, e.backend, check(e)) for e in examples]
  widths = [max(len(r[i]) for r in rows + [("kernel", "backend", "result")]) for i in range(2)]
  print(f"JAX {jax.__version__}, lowering for CUDA (NVIDIA H200)")
  print(f"{'kernel':<{widths[0]}}  {'backend':<{widths[1]}}  result")
  for name, backend, result in rows:
    print(f"{name:<{widths[0]}}  {backend:<{widths[1]}}  {result}")
  failed = sum(result != "lowered" for _, _, result in rows)
  print(f"{len(rows) - failed} of {len(rows)} kernels lowered")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
