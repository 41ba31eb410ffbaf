"""Optimizer-state bytes per parameter of every optimizer, without training.

Prints a markdown table and writes ``results/memory.json``. The demo and 10M
models are measured on real states; Llama-2-7B shapes through
``jax.eval_shape``, so nothing of that size is allocated. The papers' figures
for Llama-2-7B stand beside ours.

    python -m benchmarks.memory
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax

from benchmarks import shapes
from optax_memopt import state_nbytes
from optax_memopt.training import optimizers

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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=["demo", "10M", "llama2_7b"], choices=sorted(shapes.MODELS))
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  args = parser.parse_args(argv)

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
