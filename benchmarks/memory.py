"""Optimizer-state bytes per parameter of every optimizer, and the peak of a step on the CPU.

Prints a markdown table and writes ``results/memory.json``. The demo and 10M
models are measured on real states; Llama-2-7B shapes through
``jax.eval_shape``, so nothing of that size is allocated. The papers' figures
for Llama-2-7B stand beside ours.

    python -m benchmarks.memory

With ``--step-peak FILE`` it compiles each optimizer's donated step (update,
then ``optax.apply_updates``; parameters and state donated, gradients not)
for this machine's CPU and records XLA's memory analysis: the peak
(arguments + outputs - aliased + temporaries) and what it holds beyond
parameters, gradients and state, over the rows of the measured optimizers
in an existing file. ``--render FILE`` prints that file's table,
as ``benchmarks/README.md`` quotes it.

    python -m benchmarks.memory --step-peak benchmarks/data/cpu_step_memory.json --models 10M 40M \\
        --optimizers adamw microadam
    python -m benchmarks.memory --render benchmarks/data/cpu_step_memory.json

``--one-gpu`` prints README's answer to "which optimizer lets Llama-3-8B
train on one 80 GB H100?": per optimizer, parameters + gradients + state
(``memopt_tools.fit.report``) and what is left for activations, with
float32 and with bfloat16 parameters and gradients.

    python -m benchmarks.memory --one-gpu
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import optax

from benchmarks import shapes
from memopt_tools import fit
from memopt_tools.training import optimizers
from optax_memopt import state_nbytes

# Optimizer state of Llama-2-7B as the papers report it. The MicroAdam paper's
# "GB" are binary (its 5.65 is 0.9 bytes x 6.74e9 parameters in GiB); the
# Adam-mini repository's are decimal (53.92 = 8 bytes x 6.74e9 / 1e9).
PAPER_LLAMA2_7B = {
  "adamw": "53.92 GB (Adam-mini repo, fp32)",
  "adamw_bf16": "25.1 GiB (MicroAdam paper: bf16 m and v with bf16 weights; this row keeps v in fp32)",
  "adam_mini": "26.96 GB (Adam-mini repo, fp32)",
  "microadam": "5.65 GiB (MicroAdam paper)",
  "adamw_8bit": "12.55 GiB (MicroAdam paper: bitsandbytes' AdamW-8bit)",
}


def state_bytes(name: str, model: str) -> tuple[int, int]:
  abstract = shapes.params(model, abstract=True)
  optimizer = optimizers.get(name).build(1e-3, shapes.MODELS[model])
  return state_nbytes(jax.eval_shape(optimizer.init, abstract)), shapes.count(abstract)


def step_peak(name: str, model: str) -> dict:
  """One optimizer's donated step on ``model``, compiled for the CPU: bytes per parameter.

  Returns:
    ``n_params``; ``state`` (bytes per parameter); ``peak``, XLA's peak of
    the step (arguments + outputs - aliased + temporaries); ``temporaries``,
    the peak beyond parameters, gradients and state.
  """
  abstract = shapes.params(model, abstract=True)
  optimizer = optimizers.get(name).build(1e-3, shapes.MODELS[model])
  state = jax.eval_shape(optimizer.init, abstract)

  def step(params, state, grads):
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(abstract, state, abstract).compile()
  analysis = compiled.memory_analysis()
  peak = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )
  n_params = shapes.count(abstract)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  state_bytes = state_nbytes(state)
  return {
    "n_params": n_params,
    "state": state_bytes / n_params,
    "peak": peak / n_params,
    "temporaries": (peak - 2 * param_bytes - state_bytes) / n_params,
  }


def render_step_peak(results: dict) -> str:
  """The markdown table of a ``--step-peak`` results file, bytes per parameter."""
  lines = [
    "| model | params | optimizer | state | peak | temporaries | peak / adamw's |",
    "|---|---|---|---|---|---|---|",
  ]
  for model, rows in results["models"].items():
    adamw = rows["adamw"]["peak"]
    for name, row in rows.items():
      lines.append(
        f"| {model} | {row['n_params']:,} | {name} | {row['state']:.3f} | {row['peak']:.2f} |"
        f" {row['temporaries']:.2f} | {row['peak'] / adamw:.2f} |"
      )
  return "\n".join(lines)


def one_gpu_table(model: str = "llama3_8b", memory: str = "80GiB") -> str:
  """Markdown: per optimizer, ``model``'s parameters + gradients + state on one device, and what is left.

  From :func:`memopt_tools.fit.report` with float32 and with bfloat16
  parameters (gradients in the parameters' dtype). Of the AdamW rows,
  ``adamw`` keeps float32 ``m`` and ``v`` whatever the parameters are, and
  ``adamw_bf16`` is ``optax.adamw`` on bfloat16 parameters (its ``m`` and
  ``v`` in bfloat16). Stochastic rounding's state (a key and a count,
  12 bytes) is left out.
  """
  params = shapes.params(model, abstract=True)
  reports = {
    dtype: fit.report(
      params,
      memory=memory,
      param_dtype=dtype,
      n_heads=shapes.MODELS[model].n_heads,
      n_kv_heads=shapes.MODELS[model].n_kv_heads,
    )
    for dtype in ("float32", "bfloat16")
  }
  device = reports["float32"].memory
  left = lambda nbytes: device.format(device.nbytes - nbytes) if nbytes <= device.nbytes else "does not fit"
  lines = [
    f"{model} ({reports['float32'].n_params:,} parameters) on one device of {device.format(device.nbytes)}:"
    " parameters + gradients + optimizer state, and what is left for activations.",
    "",
    "| optimizer | float32 parameters | left | bfloat16 parameters | left |",
    "|---|---|---|---|---|",
  ]
  for high, low in zip(reports["float32"].rows, reports["bfloat16"].rows):
    lines.append(
      f"| {high.optimizer} | {device.format(high.total_bytes)} | {left(high.total_bytes)}"
      f" | {device.format(low.total_bytes)} | {left(low.total_bytes)} |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=["demo", "10M", "llama2_7b"], choices=sorted(shapes.MODELS))
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=list(optimizers.OPTIMIZERS),
    choices=list(optimizers.OPTIMIZERS),
    help="for --step-peak (adamw is always measured)",
  )
  parser.add_argument("--step-peak", type=pathlib.Path, help="measure the CPU step's peak into this results file")
  parser.add_argument("--render", type=pathlib.Path, help="print the table of a --step-peak results file and exit")
  parser.add_argument("--one-gpu", action="store_true", help="print Llama-3-8B on one 80 GB H100 (README's table)")
  args = parser.parse_args(argv)

  if args.one_gpu:
    print(one_gpu_table())
    return

  if args.render:
    print(render_step_peak(json.loads(args.render.read_text())))
    return
  if args.step_peak:
    names = ["adamw"] + [n for n in args.optimizers if n != "adamw"]
    results = {"jax": jax.__version__, "backend": jax.default_backend(), "models": {}}
    if args.step_peak.exists():  # Its other optimizers' rows stay.
      results["models"] = json.loads(args.step_peak.read_text())["models"]
    for model in args.models:
      results["models"].setdefault(model, {}).update({name: step_peak(name, model) for name in names})
    args.step_peak.parent.mkdir(parents=True, exist_ok=True)
    args.step_peak.write_text(json.dumps(results, indent=1) + "\n")
    print(render_step_peak(results))
    return

  rows = []
  for name in optimizers.OPTIMIZERS:
    row = {"optimizer": name}
    for model in args.models:
      nbytes, n_params = state_bytes(name, model)
      row[model] = {"bytes": nbytes, "bytes_per_param": nbytes / n_params, "n_params": n_params}
    rows.append(row)

  header = "| optimizer | " + " | ".join(f"{m} B/param" for m in args.models)
  if "llama2_7b" in args.models:
    header += " | Llama-2-7B GB | Llama-2-7B GiB | paper"
  print(header + " |")
  print("|---" * (header.count("|")) + "|")
  for row in rows:
    cells = [f"{row[m]['bytes_per_param']:.3f}" for m in args.models]
    if "llama2_7b" in args.models:
      nbytes = row["llama2_7b"]["bytes"]
      cells += [f"{nbytes / 1e9:.2f}", f"{nbytes / 2**30:.2f}", PAPER_LLAMA2_7B.get(row["optimizer"], "")]
    print(f"| {row['optimizer']} | " + " | ".join(cells) + " |")
  print("parameters: " + ", ".join(f"{m} {rows[0][m]['n_params']:,}" for m in args.models))
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
