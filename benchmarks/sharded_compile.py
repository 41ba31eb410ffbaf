"""Every optimizer's step sharded over many H100s, compiled on this machine: what crosses devices, and each one's peak.

No GPU is needed: XLA compiles the donated step (update, then
``optax.apply_updates``) for H100 target devices (``memopt_tools.gpu_compile``):
one host of 8 and two hosts of 8, the parameters (Llama-2-7B's embedding,
head and ``--layers`` decoder layers, float32) sharded FSDP-style on a
dimension the devices divide, the state by ``optax_memopt.state_shardings``;
``--tensor-parallel 2`` also splits each matrix's last axis over pairs of
devices (``docs/sharding.md``). Per optimizer and layout it records, per
device: the bytes each kind of collective carries (as a share of the
parameter bytes a device holds), the bytes the step moves, its peak and
temporaries, and the peak against the single-device step's peak
(``benchmarks/data/h100_compile.json``) divided by the devices.

    pip install -e ".[gpu-compile]"
    python -m benchmarks.sharded_compile --layers 2 --json benchmarks/data/sharded_compile.json
    python -m benchmarks.sharded_compile --render benchmarks/data/sharded_compile.json

``--check FILE`` (CI's gpu-compile lane, against the committed
``benchmarks/data/sharded_compile.json``) fails where a step's collectives
carry more than ``COLLECTIVE_SHARE`` of the parameters' bytes, or its
per-device peak exceeds the single-device peak / N by more than
``PEAK_TOLERANCE``. A step already beyond a bound in ``FILE`` (listed, not
failing) fails where it rises more than ``PEAK_TOLERANCE`` over its committed
figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

from benchmarks import h100_compile, shapes  # noqa: E402
from memopt_tools import gpu_compile  # noqa: E402  (benchmarks.h100_compile imports it first: the CUDA environment)
from memopt_tools.training import optimizers  # noqa: E402

# The step's collectives may carry at most this share of the parameter bytes a
# device holds (a scalar reduction, or a few per-row statistics, is far below).
COLLECTIVE_SHARE = 0.002
# A device's peak may exceed the single-device step's peak / N by this much.
PEAK_TOLERANCE = 0.05

# Layouts: (hosts, devices per host, tensor-parallel devices).
LAYOUTS = {"8": (1, 8, 1), "2x8": (2, 8, 1), "8 tp2": (1, 8, 2)}


def measure(name: str, params, config, *, hosts: int, devices: int, tensor_parallel: int, single_peak: float) -> dict:
  tx = optimizers.get(name).build(1e-3, config)
  start = time.perf_counter()
  program = gpu_compile.compile_step(tx, params, devices=devices, hosts=hosts, tensor_parallel=tensor_parallel)
  collectives = program.collectives
  n_devices = hosts * devices
  return {
    "param_bytes": program.param_bytes,
    "collectives": {kind: nbytes for kind, nbytes in collectives.items() if nbytes},
    "collective_share": sum(collectives.values()) / program.param_bytes,
    "moved_bytes": program.moved_bytes,
    "peak_bytes": program.peak_bytes,
    "temporaries_bytes": program.temporaries_bytes,
    "peak_over_share": program.peak_bytes / (single_peak / n_devices),
    "compile_seconds": round(time.perf_counter() - start, 1),
  }


def _megabytes(nbytes: float) -> str:
  for unit, scale in (("MB", 1e6), ("KB", 1e3)):
    if nbytes >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{nbytes:.0f} B"


def render(results: dict) -> str:
  """A markdown table per layout from the JSON results."""
  out = [
    f"Llama-2-7B's embedding, head and {results['layers']} of its 32 decoder layers ({results['n_params']:,}"
    f" float32 parameters), the step compiled for H100s with JAX {results['jax']}; per device."
  ]
  for layout, rows in results["layouts"].items():
    hosts, devices, tp = LAYOUTS[layout]
    where = f"{hosts} hosts of {devices}" if hosts > 1 else f"{devices}"
    how = f"FSDP over {hosts * devices // tp} x tensor parallelism over {tp}" if tp > 1 else "FSDP"
    out += [
      "",
      f"{where} H100s, {how}:",
      "",
      "| optimizer | collectives | / parameter bytes | bytes moved | peak | peak / (one device's peak / N) |",
      "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
      carried = ", ".join(f"{kind} {_megabytes(b)}" for kind, b in row["collectives"].items()) or "none"
      out.append(
        f"| {name} | {carried} | {100 * row['collective_share']:.3f}% | {_megabytes(row['moved_bytes'])}"
        f" | {_megabytes(row['peak_bytes'])} | {row['peak_over_share']:.3f} |"
      )
  return "\n".join(out)


def failures(results: dict, committed: dict) -> tuple[list[str], list[str]]:
  """The layouts and optimizers beyond the bounds: ``(failing, known)``.

  A figure beyond its bound fails, unless the committed results hold it
  beyond the bound already: then it is known, and fails only where it rose
  more than ``PEAK_TOLERANCE`` over the committed figure.
  """
  failing, known = [], []
  for layout, rows in results["layouts"].items():
    for name, row in rows.items():
      before = committed.get("layouts", {}).get(layout, {}).get(name, {})
      carried = ", ".join(f"{kind} {_megabytes(b)}" for kind, b in row["collectives"].items())
      for label, key, bound, text in (
        ("collectives", "collective_share", COLLECTIVE_SHARE, f"{100 * row['collective_share']:.3f}% ({carried})"),
        ("peak", "peak_over_share", 1 + PEAK_TOLERANCE, f"{row['peak_over_share']:.3f} x (one device's peak / N)"),
      ):
        if row[key] <= bound:
          continue
        line = f"{layout} {name}: {label} {text}"
        if before.get(key, 0.0) > bound and row[key] <= before[key] * (1 + PEAK_TOLERANCE):
          known.append(line)
        else:
          failing.append(line)
  return failing, known


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=2, help="decoder layers of Llama-2-7B's 32")
  parser.add_argument("--layouts", nargs="+", default=["8", "2x8"], choices=list(LAYOUTS))
  parser.add_argument("--optimizers", nargs="+", default=None, choices=list(optimizers.OPTIMIZERS))
  parser.add_argument(
    "--single",
    type=pathlib.Path,
    default=pathlib.Path("benchmarks/data/h100_compile.json"),
    help="the single-device results whose float32 peaks N devices share",
  )
  parser.add_argument("--json", type=pathlib.Path, help="write the results here, over an existing file's rows")
  parser.add_argument(
    "--check", type=pathlib.Path, help="committed results: exit 1 where collectives or a peak exceed the bounds"
  )
  parser.add_argument("--render", type=pathlib.Path, help="print the tables of a results file and exit")
  args = parser.parse_args(argv)
  if args.render:
    print(render(json.loads(args.render.read_text())))
    return 0
  single = json.loads(args.single.read_text())
  if single["layers"] != args.layers or single.get("model", "llama2_7b") != "llama2_7b":
    parser.error(f"--single {args.single} holds another model than Llama-2-7B with {args.layers} layers")
  params, config = h100_compile.model_params("llama2_7b", args.layers, "float32")
  results = {"jax": jax.__version__, "layers": args.layers, "n_params": shapes.count(params), "layouts": {}}
  for layout in args.layouts:
    hosts, devices, tp = LAYOUTS[layout]
    rows = results["layouts"][layout] = {}
    for name in args.optimizers or optimizers.OPTIMIZERS:
      committed = single["rows"]["float32"].get(name)
      if committed is None:  # An optimizer the single-device results do not hold yet: compiled here.
        single_peak = gpu_compile.compile_step(optimizers.get(name).build(1e-3, config), params).peak_bytes
      else:
        single_peak = committed["default"]["peak_bytes"]
      rows[name] = measure(
        name, params, config, hosts=hosts, devices=devices, tensor_parallel=tp, single_peak=single_peak
      )
      print(f"{layout} {name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
  print(render(results))
  if args.json:
    if args.json.exists():
      previous = json.loads(args.json.read_text())
      if (previous["layers"], previous["jax"]) == (results["layers"], results["jax"]):
        for layout, rows in results["layouts"].items():
          previous["layouts"].setdefault(layout, {}).update(rows)
        results = previous
    args.json.write_text(json.dumps(results, indent=1) + "\n")
  if args.check:
    failing, known = failures(results, json.loads(args.check.read_text()))
    if known:
      print(f"Beyond the bounds in {args.check} already, and not risen:\n  " + "\n  ".join(known))
    if failing:
      print("Sharded steps beyond the bounds:\n  " + "\n  ".join(failing), file=sys.stderr)
      return 1
    print(
      f"Every other step's collectives carry at most {COLLECTIVE_SHARE:.1%} of the parameter bytes, and every"
      f" other peak is within {PEAK_TOLERANCE:.0%} of one device's peak / N."
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
