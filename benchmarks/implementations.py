"""Each method's Pallas path against its XLA path, step for step, on one device.

The fused kernels (MicroAdam's window update, TACO's column select, ternary
Adam's step) are checked here through the public optimizers: both paths start
from the same state, take the same fresh random gradients for a few steps,
and the table gives, per optimizer, the largest relative difference of the
updates (``|pallas - xla| / |xla|`` over the whole tree), of the float state
leaves, and the fraction of integer codes that differ. On a GPU this is the
readiness check of the fused kernels; on a CPU the same comparison runs with
``--implementations xla interpret`` on the demo model (slowly).

Exact equality is not expected everywhere: the kernels may round a division
or a sum differently from XLA's fusion, and a top-k or argmax near a tie then
picks another entry, which changes integer codes and the following steps.
Differences at float rounding, and code differences in a small fraction of
entries, are agreement; anything non-finite or an error is failure.

    python -m benchmarks.implementations --model 40M
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import shapes
from memopt_tools.training import optimizers

# Relative update difference above which a row counts as disagreement.
UPDATE_TOLERANCE = 1e-2


def _tree_relative_difference(a, b) -> float:
  num = sum(
    float(jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  den = sum(float(jnp.sum(jnp.square(y.astype(jnp.float32)))) for y in jax.tree.leaves(b))
  return float(np.sqrt(num / max(den, 1e-30)))


def _state_differences(a, b) -> tuple[float, float, bool]:
  """Largest relative float difference, fraction of integer codes that differ, all finite."""
  float_difference, codes, differing, finite = 0.0, 0, 0, True
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jnp.issubdtype(x.dtype, jnp.floating):
      x32, y32 = np.asarray(x, np.float32), np.asarray(y, np.float32)
      finite &= bool(np.isfinite(x32).all() == np.isfinite(y32).all())
      scale = np.max(np.abs(y32)) if y32.size else 0.0
      if scale > 0:
        float_difference = max(float_difference, float(np.max(np.abs(x32 - y32)) / scale))
    elif jnp.issubdtype(x.dtype, jnp.integer):
      codes += x.size
      differing += int(np.count_nonzero(np.asarray(x) != np.asarray(y)))
  return float_difference, differing / max(codes, 1), finite


def compare(name: str, model: str, params, *, reference: str, kernel: str, steps: int, seed: int) -> dict:
  spec = optimizers.get(name)
  paths = {impl: spec.build(1e-3, shapes.MODELS[model], implementation=impl) for impl in (reference, kernel)}
  steps_of = {impl: jax.jit(opt.update) for impl, opt in paths.items()}
  state = {impl: opt.init(params) for impl, opt in paths.items()}
  worst_update = 0.0
  for step in range(steps):
    grads = shapes.gradients(params, seed + step)
    updates = {}
    for impl in paths:
      updates[impl], state[impl] = steps_of[impl](grads, state[impl], params)
    worst_update = max(worst_update, _tree_relative_difference(updates[kernel], updates[reference]))
  float_difference, code_fraction, finite = _state_differences(state[kernel], state[reference])
  return {
    "optimizer": name,
    "update_difference": worst_update,
    "state_float_difference": float_difference,
    "state_code_fraction_differing": code_fraction,
    "finite_agree": finite,
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="40M", choices=sorted(set(shapes.MODELS) - {"llama2_7b"}))
  parser.add_argument("--implementations", nargs=2, default=["xla", "pallas"], metavar=("REFERENCE", "KERNEL"))
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  args = parser.parse_args(argv)
  reference, kernel = args.implementations
  params = shapes.params(args.model)
  names = [name for name, spec in optimizers.OPTIMIZERS.items() if spec.has_kernels]
  print(
    f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; model {args.model}"
    f" ({shapes.count(params):,} parameters), {args.steps} steps"
  )
  print("| optimizer | update rel. diff | state float rel. diff | integer codes differing | verdict |")
  print("|---|---|---|---|---|")
  rows, failures = [], 0
  for name in names:
    try:
      row = compare(name, args.model, params, reference=reference, kernel=kernel, steps=args.steps, seed=args.seed)
      agrees = row["finite_agree"] and row["update_difference"] <= UPDATE_TOLERANCE
      verdict = "agree" if agrees else "DISAGREE"
      print(
        f"| {name} | {row['update_difference']:.2e} | {row['state_float_difference']:.2e} |"
        f" {100 * row['state_code_fraction_differing']:.4f}% | {verdict} |",
        flush=True,
      )
    except Exception as e:  # One row per optimizer, whatever happens.
      row, agrees = {"optimizer": name, "error": f"{type(e).__name__}: {e}"}, False
      print(f"| {name} | {type(e).__name__}: {str(e).splitlines()[0][:120]} | - | - | ERROR |", flush=True)
    failures += not agrees
    rows.append(row)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "implementations.json").write_text(json.dumps(rows, indent=1))
  return 1 if failures else 0


if __name__ == "__main__":
  raise SystemExit(main())
