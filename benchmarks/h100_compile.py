"""Every optimizer's step compiled for an H100 on this machine: bytes moved and peak, per parameter.

No GPU is needed: XLA compiles the donated step (update, then
``optax.apply_updates``) for an H100 target description
(``memopt_tools.gpu_compile``). On Llama-2-7B-shaped parameters (``--layers``
of its 32 decoder layers, with its embedding and head) it prints, per
parameter: the state, the bytes the step moves, those as a ratio to
``optax.adamw``'s on the same parameters, the step's peak, and its
temporaries beyond parameters + gradients + state; and whether the step fits
in the H100's 80 GB. ``--kernels`` also compiles each optimizer with every
Pallas kernel on (``implementation="pallas"``). ``--model llama3_8b`` takes
Llama-3-8B's shapes instead, whose 128K-token vocabulary makes the embedding
and the head 525M parameters each: the step's temporaries where one tensor is
a large share of the model. ``--target h200`` or ``b200`` compiles for that GPU
instead (``memopt_tools.gpu_compile.TARGETS``).

``--stochastic-rounding`` also compiles, with bfloat16 parameters, each
optimizer followed by stochastic rounding
(``optax_memopt.with_stochastic_rounding``): its bytes beside the same
optimizer's round-to-nearest step and bfloat16 ``optax.adamw``'s.

    pip install -e ".[gpu-compile]"
    python -m benchmarks.h100_compile --layers 2 --param-dtypes float32 bfloat16 --kernels \\
        --stochastic-rounding --json benchmarks/data/h100_compile.json
    python -m benchmarks.h100_compile --render benchmarks/data/h100_compile.json

``--json`` writes over the rows of an existing file of the same shapes, so
``--optimizers NAME`` re-measures one optimizer. The CI lane compiles two
layers (float32, default implementations) and fails when an optimizer's
bytes ratio or temporaries rise by more than 5% over
``benchmarks/data/h100_compile.json`` (``--check``), and for a B200
(sm_100a kernels) over ``benchmarks/data/b200_compile.json``; a change that
lowers them rewrites its rows in the same commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import optax_memopt  # noqa: E402
from benchmarks import shapes  # noqa: E402
from memopt_tools import gpu_compile  # First: it sets the CUDA plugin's environment.
from memopt_tools.training import model, optimizers  # noqa: E402

# A rise over a committed figure that fails the check: 5%, plus 0.005 bytes
# per parameter so that a figure near zero (AdamW's temporaries) does not
# fail on a few bytes.
TOLERANCE = 0.05
ABSOLUTE_SLACK = 0.005


# Each target's memory as its data sheet names it (``gpu_targets/``).
MEMORY = {"h100": "80 GB", "h200": "141 GB", "b200": "180 GB"}

# The key of a row's bfloat16 step followed by stochastic rounding, beside "default" and "pallas".
ROUNDING = "stochastic_rounding"

# The models that can be compiled, and how the tables name them.
MODELS = {"llama2_7b": "Llama-2-7B", "llama3_8b": "Llama-3-8B"}


def model_params(model_name: str, layers: int, param_dtype) -> tuple[dict, model.TransformerConfig]:
  """``model_name``'s parameters with ``layers`` decoder layers (``ShapeDtypeStruct`` leaves), and its config."""
  config = dataclasses.replace(shapes.MODELS[model_name], n_layers=layers)
  build = lambda: nnx.to_pure_dict(nnx.split(model.Transformer(config, rngs=nnx.Rngs(0)))[1])
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(param_dtype)), jax.eval_shape(build))
  return params, config


def measure(name: str, params, config, *, kernels: bool, target: str = "h100", rounding: bool = False) -> dict:
  spec = optimizers.get(name)
  tx = spec.build(1e-3, config, implementation="pallas") if kernels else spec.build(1e-3, config)
  if rounding:
    tx = optax_memopt.with_stochastic_rounding(tx)
  start = time.perf_counter()
  program = gpu_compile.compile_step(tx, params, target=target)
  per_param = lambda b: b / program.n_params
  # A step that branches (GaLore's SVD every update_proj_gap steps) moves its costliest branch's bytes
  # only on the steps that take it: the cheapest branch's figure is kept beside it.
  cheapest = program.cheapest_moved_bytes
  return {
    "n_params": program.n_params,
    "state": per_param(program.state_bytes),
    "moved": per_param(program.moved_bytes),
    "peak": per_param(program.peak_bytes),
    "temporaries": per_param(program.temporaries_bytes),
    "peak_bytes": program.peak_bytes,
    "fits": program.peak_bytes <= gpu_compile.device_memory_bytes(target),
    "compile_seconds": round(time.perf_counter() - start, 1),
  } | ({"moved_cheapest_branch": per_param(cheapest)} if cheapest < program.moved_bytes else {})


def render(results: dict) -> str:
  """Markdown tables (one per parameter dtype) from the JSON results."""
  layers, name = results["layers"], MODELS[results.get("model", "llama2_7b")]
  target = results.get("target", "h100")
  shape = name if layers == 32 else f"{name}'s embedding, head and {layers} of its 32 decoder layers"
  out = [
    f"{shape} ({results['n_params']:,} parameters), compiled for {'an' if target[0] == 'h' else 'a'}"
    f" {target.upper()} with JAX {results['jax']}; bytes per parameter."
  ]
  for dtype, rows in results["rows"].items():
    adamw = rows["adamw"]["default"]["moved"]
    kernels = any("pallas" in row for row in rows.values())
    rounding = any(ROUNDING in row for row in rows.values())
    out += ["", f"{dtype} parameters:", ""]
    # Whether the step fits says something only of the whole model.
    whole = layers == 32
    header = "| optimizer | state | bytes moved | / adamw | peak | temporaries |" + (
      f" fits in {MEMORY[target]} |" if whole else ""
    )
    rule = "|---|---|---|---|---|---|" + ("---|" if whole else "")
    if kernels:
      header += " bytes moved, every Pallas kernel on | / adamw |"
      rule += "---|---|"
    if rounding:
      # Against round-to-nearest's bytes: what the rounding adds to the step.
      header += " bytes moved, stochastic rounding | / adamw | added by rounding | temporaries, stochastic rounding |"
      rule += "---|---|---|---|"
    out += [header, rule]
    for name, row in rows.items():
      d = row["default"]
      line = (
        f"| {name} | {d['state']:.3f} | {d['moved']:.1f} | {d['moved'] / adamw:.2f} | {d['peak']:.2f}"
        f" | {d['temporaries']:.3f} |" + (f" {'yes' if d['fits'] else 'no'} |" if whole else "")
      )
      if kernels:
        k = row.get("pallas")
        line += f" {k['moved']:.1f} | {k['moved'] / adamw:.2f} |" if k else " | |"
      if rounding:
        r = row.get(ROUNDING)
        line += (
          f" {r['moved']:.1f} | {r['moved'] / adamw:.2f} | {r['moved'] - d['moved']:+.3f} | {r['temporaries']:.3f} |"
          if r
          else " | | | |"
        )
      out.append(line)
    branching = [(name, row["default"].get("moved_cheapest_branch")) for name, row in rows.items()]
    branching = [(name, moved) for name, moved in branching if moved is not None]
    if branching:
      out += [
        "",
        "A step that branches is counted at its costliest branch; on the steps that take the cheapest one, "
        + ", ".join(f"{name} moves {moved:.1f} bytes ({moved / adamw:.2f} / adamw)" for name, moved in branching)
        + ".",
      ]
  return "\n".join(out)


def merged(results: dict, path: pathlib.Path) -> dict:
  """``results`` written over the rows of ``path``'s results of the same shapes and JAX, if any.

  An optimizer measured here that has no kernels keeps no ``"pallas"``
  figures from ``path``: they are of kernels since deleted.
  """
  if not path.exists():
    return results
  previous = json.loads(path.read_text())
  key = lambda r: (r["layers"], r["jax"], r.get("model", "llama2_7b"), r.get("target", "h100"))
  if key(previous) != key(results):
    return results
  for dtype, rows in results["rows"].items():
    previous["rows"].setdefault(dtype, {})
    for name, row in rows.items():
      kept = previous["rows"][dtype].setdefault(name, {})
      kept.update(row)
      if not optimizers.get(name).has_kernels:
        kept.pop("pallas", None)
  return previous


def regressions(results: dict, committed: dict, names=None) -> list[str]:
  """Each measured optimizer whose bytes ratio to AdamW or temporaries rose past the tolerance.

  Compares the parameter dtypes and implementations ``results`` holds, and
  the optimizers ``names`` (default: every committed one); one of them
  missing from ``results`` is a regression.
  """
  found = []
  for dtype, rows in results["rows"].items():
    measured = {implementation for row in rows.values() for implementation in row}
    for name, row in committed["rows"].get(dtype, {}).items():
      if names is not None and name not in names:
        continue
      for implementation, old in row.items():
        if implementation not in measured:
          continue
        new = rows.get(name, {}).get(implementation)
        if new is None:
          found.append(f"{dtype} {name} {implementation}: not measured")
          continue
        old_ratio = old["moved"] / committed["rows"][dtype]["adamw"]["default"]["moved"]
        new_ratio = new["moved"] / rows["adamw"]["default"]["moved"]
        for label, before, after, slack in (
          ("bytes / adamw", old_ratio, new_ratio, 0.0),
          ("temporaries", old["temporaries"], new["temporaries"], ABSOLUTE_SLACK),
        ):
          if after > before * (1 + TOLERANCE) + slack:
            found.append(f"{dtype} {name} {implementation}: {label} {before:.3f} -> {after:.3f}")
  return found


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--model",
    default="llama2_7b",
    choices=list(MODELS),
    help="Llama-2-7B, or Llama-3-8B (a 128K-token vocabulary: a 525M-parameter embedding and head)",
  )
  parser.add_argument("--layers", type=int, default=32, help="decoder layers of the model's 32")
  parser.add_argument("--target", default="h100", choices=gpu_compile.TARGETS, help="the GPU compiled for")
  parser.add_argument("--param-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=None,
    choices=list(optimizers.OPTIMIZERS),
    help="default: all (adamw always, as the baseline)",
  )
  parser.add_argument("--kernels", action="store_true", help="also compile with every Pallas kernel on")
  parser.add_argument(
    "--stochastic-rounding",
    action="store_true",
    help="with bfloat16 parameters, also compile each optimizer followed by optax_memopt.stochastic_rounding",
  )
  parser.add_argument(
    "--json", type=pathlib.Path, help="write the results here, over the rows an existing file of the same shapes holds"
  )
  parser.add_argument(
    "--check", type=pathlib.Path, help="committed results: exit 1 where a bytes ratio or temporaries rose more than 5%%"
  )
  parser.add_argument("--render", type=pathlib.Path, help="print the tables of a results file and exit")
  args = parser.parse_args(argv)
  if args.render:
    print(render(json.loads(args.render.read_text())))
    return 0
  if args.layers < 1:
    parser.error(f"--layers: must be >= 1; got {args.layers}")

  names = ["adamw"] + [n for n in (args.optimizers or optimizers.OPTIMIZERS) if n != "adamw"]
  results = {"jax": jax.__version__, "layers": args.layers, "rows": {}}
  if args.model != "llama2_7b":
    results["model"] = args.model
  if args.target != "h100":
    results["target"] = args.target
  for dtype in args.param_dtypes:
    params, config = model_params(args.model, args.layers, dtype)
    results["n_params"] = shapes.count(params)
    rows = results["rows"][dtype] = {}
    for name in names:
      rows[name] = {"default": measure(name, params, config, kernels=False, target=args.target)}
      if args.kernels and optimizers.get(name).has_kernels:
        rows[name]["pallas"] = measure(name, params, config, kernels=True, target=args.target)
      if args.stochastic_rounding and dtype == "bfloat16":
        rows[name][ROUNDING] = measure(name, params, config, kernels=False, target=args.target, rounding=True)
      print(f"{dtype} {name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
  print(render(results))
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(merged(results, args.json), indent=1) + "\n")
  if args.check:
    found = regressions(results, json.loads(args.check.read_text()), None if args.optimizers is None else names)
    if found:
      print("Regressions over " + str(args.check) + ":\n  " + "\n  ".join(found), file=sys.stderr)
      return 1
    print(f"No optimizer's bytes ratio or temporaries rose more than {TOLERANCE:.0%} over {args.check}.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
