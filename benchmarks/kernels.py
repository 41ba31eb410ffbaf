"""Every Pallas kernel against its XLA path: same answer, and how fast.

The kernel the optimizers' steps run on a Hopper GPU by default: MicroAdam's
``error_feedback.feedback_step`` (Triton: the gradient plus the decoded
error, its block top-k, and the error with the selection zeroed,
re-encoded in place), at MicroAdam's defaults (4-bit error feedback in
buckets of 1024 with bfloat16 statistics, top-k blocks of 16384 at density
0.01).

On a GPU this is the readiness check: each op runs with
``implementation="pallas"`` and ``"xla"`` on the same inputs at realistic
sizes (tens of millions of elements), the outputs are compared (integer
outputs exactly, floats within rounding), and both are timed. The table gives
achieved bandwidth (bytes the op must read and write, over time) next to the
device's HBM peak. On a CPU, ``--implementations xla interpret`` with a small
``--size`` checks the same thing slowly; timings there mean nothing.

    python -m benchmarks.kernels --size 33554432
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import error_feedback, quantize, topk

# HBM bandwidth in bytes/s by device kind, from the vendors' data sheets.
HBM_PEAK = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA B200": 8.0e12}

# MicroAdam's defaults (optax_memopt/microadam.py).
BITS = 4
BUCKET = 1024
BLOCK = 16384
DENSITY = 0.01
# What the error-feedback op takes, at those defaults.
_FEEDBACK = dict(density=DENSITY, block_size=BLOCK, bits=BITS, bucket_size=BUCKET)


@dataclasses.dataclass(frozen=True)
class KernelCase:
  name: str
  make_inputs: Callable[[jax.Array, int], tuple[Any, ...]]
  run: Callable[..., Any]  # run(*inputs, implementation=...)
  bytes_moved: Callable[[int], int]  # what one call must read and write


def _normal(key, size, dtype=jnp.float32):
  return (jax.random.normal(key, (size,), jnp.float32) * 0.01).astype(dtype)


def _error_and_gradient(key, n):
  """A quantized error feedback and a float32 gradient of ``n`` elements."""
  error = quantize.quantize(_normal(key, n), bits=BITS, bucket_size=BUCKET, stats_dtype=jnp.bfloat16)
  return error, _normal(jax.random.fold_in(key, 1), n)


def _selection_bytes(n: int) -> int:
  """The selection's int16 indices and float32 values."""
  return 6 * topk.selection_size(n, density=DENSITY, block_size=BLOCK)


def _statistics_bytes(n: int) -> int:
  """Each bucket's bfloat16 minimum and maximum."""
  return 4 * quantize.num_buckets(n, BUCKET)


def _cases() -> list[KernelCase]:
  codes = lambda n: n * BITS // 8
  return [
    KernelCase(
      "feedback_step",
      _error_and_gradient,
      lambda q, y, implementation: error_feedback.feedback_step(
        q, y, **_FEEDBACK, stats_dtype=jnp.bfloat16, implementation=implementation
      ),
      # Reads the gradient, the codes and statistics; writes the selection, new codes and statistics.
      lambda n: 4 * n + _selection_bytes(n) + 2 * (codes(n) + _statistics_bytes(n)),
    ),
  ]


def _time(fn, inputs, repeats: int) -> float:
  jax.block_until_ready(fn(*inputs))
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds)


def _agree(a, b) -> str:
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      return f"shape/dtype {x.shape}{x.dtype} vs {y.shape}{y.dtype}"
    if np.issubdtype(x.dtype, np.integer) or x.dtype == bool:
      if not np.array_equal(x, y):
        return f"{np.count_nonzero(x != y)} integer mismatches"
    elif not np.allclose(x.astype(np.float32), y.astype(np.float32), rtol=1e-5, atol=1e-6):
      return f"max abs diff {np.max(np.abs(x.astype(np.float32) - y.astype(np.float32))):.3g}"
  return "equal"


def header(reference: str, kernel: str) -> str:
  return (
    f"| op | {kernel} vs {reference} | {reference} ms | {kernel} ms"
    f" | {reference} GB/s | {kernel} GB/s | {kernel} % of peak |\n|---|---|---|---|---|---|---|"
  )


def table_row(row: dict, reference: str, kernel: str, peak: float | None) -> str:
  cell = lambda d, i, f: format(d[i], f) if i in d else "-"
  gbps = row["GB/s"]
  pct = f"{100 * gbps[kernel] * 1e9 / peak:.0f}%" if peak and kernel in gbps else "-"
  return (
    f"| {row['op']} | {row['agreement']} | {cell(row['ms'], reference, '.3f')} | {cell(row['ms'], kernel, '.3f')} |"
    f" {cell(gbps, reference, '.0f')} | {cell(gbps, kernel, '.0f')} | {pct} |"
  )


def render(results: dict) -> str:
  """The markdown table of a results file: the command, device and date, then a row per op."""
  reference, kernel = results["implementations"]
  lines = [
    f"`{results['command']}` ({results['device']}, {results['date']}; JAX {results['jax']};"
    f" {results['size']:,} elements per input).",
    "",
    header(reference, kernel),
    *(table_row(row, reference, kernel, HBM_PEAK.get(results["device"])) for row in results["rows"]),
  ]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", type=int, default=32 * 2**20, help="elements per input")
  parser.add_argument("--implementations", nargs=2, default=["xla", "pallas"], metavar=("REFERENCE", "KERNEL"))
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  parser.add_argument("--render", type=pathlib.Path, help="print the table of a results file (kernels.json) and exit")
  args = parser.parse_args(argv)
  if args.render:
    print(render(json.loads(args.render.read_text())))
    return 0
  reference, kernel = args.implementations
  device = jax.devices()[0].device_kind
  peak = HBM_PEAK.get(device)
  print(
    f"JAX {jax.__version__} on {device}; {args.size:,} elements per input; HBM peak {peak / 1e9:,.0f} GB/s"
    if peak
    else f"JAX {jax.__version__} on {device}; {args.size:,} elements"
  )
  print(header(reference, kernel))
  rows, failures = [], 0
  for case in _cases():
    inputs = case.make_inputs(jax.random.key(0), args.size)
    fns = {
      impl: jax.jit(lambda *a, impl=impl, case=case: case.run(*a, implementation=impl)) for impl in (reference, kernel)
    }
    try:
      agreement = _agree(fns[kernel](*inputs), fns[reference](*inputs))
      times = {impl: _time(fn, inputs, args.repeats) for impl, fn in fns.items()}
    except Exception as e:  # One row per op, whatever happens.
      agreement, times = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}", {}
    failures += agreement != "equal"
    moved = case.bytes_moved(args.size)
    row = {
      "op": case.name,
      "agreement": agreement,
      "ms": {i: 1e3 * t for i, t in times.items()},
      "GB/s": {i: moved / t / 1e9 for i, t in times.items()},
    }
    rows.append(row)
    print(table_row(row, reference, kernel, peak), flush=True)
  results = {
    "command": "python -m benchmarks.kernels " + shlex.join(argv if argv is not None else sys.argv[1:]),
    "device": device,
    "date": datetime.date.today().isoformat(),
    "jax": jax.__version__,
    "size": args.size,
    "implementations": [reference, kernel],
    "rows": rows,
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "kernels.json").write_text(json.dumps(results, indent=1) + "\n")
  return 1 if failures else 0


if __name__ == "__main__":
  raise SystemExit(main())
