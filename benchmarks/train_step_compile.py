"""Will Llama-2-7B or Llama-3-8B fine-tune on one H100, H200 or B200? Each training step compiled for the GPU.

For each model, GPU, optimizer and batch size, the whole training step of the
built-in Llama (``memopt_tools.training.model``: forward, backward,
optimizer, ``optax.apply_updates``) is compiled by XLA for one GPU of
``memopt_tools.gpu_compile.TARGETS`` on this machine, as
``python -m optax_memopt.fit --model M --compile T --batch B`` does
(``memopt_tools.train_compile``): XLA's peak, its parts, and whether it fits
in the GPU's memory less the report's margin. A whole 7B/8B step takes a
long compile: rows are added one run at a time, ``--json`` writing over the
rows of an existing file with the same key.

    pip install -e ".[gpu-compile]"
    python -m benchmarks.train_step_compile --model llama2_7b --target h100 --batch 1 \\
        --optimizer adamw_4bit --json benchmarks/data/train_step_compile.json
    python -m benchmarks.train_step_compile --render benchmarks/data/train_step_compile.json

The rendered table is ``docs/memory-planning.md``'s (``tests/test_benchmark_tables.py``
checks it against the file).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from memopt_tools import (  # First: it sets the CUDA plugin's environment.
  fit,  # noqa: E402
  gpu_compile,
  train_compile,
)
from memopt_tools.training import model, optimizers  # noqa: E402

# How the table names the models.
MODELS = {"llama2_7b": "Llama-2-7B", "llama3_8b": "Llama-3-8B"}
# The fields that say which step a row is.
KEY = ("model", "target", "param_dtype", "optimizer", "remat", "seq_len", "batch")


def measure(model_name: str, target: str, param_dtype: str, optimizer: str, remat: str, seq_len: int, batch: int):
  config = fit.MODELS[model_name]
  loss_fn, params, tokens = fit.training_loss(model_name, jnp.dtype(param_dtype), remat, seq_len)
  tx = train_compile.registered_optimizer(
    optimizer,
    n_heads=config.n_heads,
    n_kv_heads=config.n_kv_heads,
    stochastic_rounding=jnp.dtype(param_dtype) != jnp.float32,
  )
  start = time.perf_counter()
  program = train_compile.compile_train_step(loss_fn, params, tokens(batch), tx, target=target)
  return {
    "model": model_name,
    "target": target,
    "param_dtype": param_dtype,
    "optimizer": optimizer,
    "remat": remat,
    "seq_len": seq_len,
    "batch": batch,
    "n_params": program.n_params,
    "params": program.param_bytes,
    "gradients": program.gradient_bytes,
    "state": program.state_bytes,
    "batch_bytes": program.batch_bytes,
    "activations": program.activations_bytes,
    "peak": program.peak_bytes,
    "memory": program.memory,
    "margin": program.margin,
    "fits": program.fits,
    "compile_seconds": round(time.perf_counter() - start, 1),
  }


def render(results: dict) -> str:
  """A markdown table from the JSON results."""
  if not results["rows"]:
    return f"No training step compiled yet with JAX {results['jax']}."
  gb = lambda n: f"{n / 1e9:.1f}"
  out = [
    f"Compiled with JAX {results['jax']}; GB (10^9 bytes) on one GPU. A step fits where XLA's peak is at most the"
    " GPU's memory less the margin kept for what the compile cannot see. Parameters and optimizer state are the"
    " step's donated arguments, held throughout; gradients are one set in the parameters' dtype; activations and"
    " the rest are the temporaries of the forward and backward pass compiled alone; the update is what the"
    " whole step's peak holds beyond all of these, negative where XLA updates some parameters before the"
    " backward pass has made every gradient.",
    "",
    "| model | GPU (memory, less margin) | parameters | optimizer | remat | batch x tokens"
    " | params + state | gradients | activations and the rest | the update | XLA's peak | fits |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in results["rows"]:
    memory = f"{row['target'].upper()} ({gb(row['memory'])}, {gb(row['memory'] * (1 - row['margin']))})"
    update = row["peak"] - row["params"] - row["gradients"] - row["state"] - row["batch_bytes"] - row["activations"]
    cells = [
      MODELS[row["model"]],
      memory,
      row["param_dtype"],
      row["optimizer"],
      row["remat"],
      f"{row['batch']} x {row['seq_len']}",
      gb(row["params"] + row["state"]),
      gb(row["gradients"]),
      gb(row["activations"]),
      f"{update / 1e9:+.1f}",
      gb(row["peak"]),
      "yes" if row["fits"] else "no",
    ]
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def merged(row: dict, path: pathlib.Path) -> dict:
  """``path``'s results (if any) with ``row`` written over the row of the same key, in a stable order."""
  results = json.loads(path.read_text()) if path.exists() else {"jax": jax.__version__, "rows": []}
  if results["jax"] != jax.__version__:
    raise ValueError(f"{path} holds JAX {results['jax']}'s compiles; this is JAX {jax.__version__}.")
  key = lambda r: tuple(r[k] for k in KEY)
  rows = {key(r): r for r in results["rows"]}
  rows[key(row)] = row
  order = lambda k: (list(MODELS).index(k[0]), list(gpu_compile.TARGETS).index(k[1])) + k[2:]
  results["rows"] = [rows[k] for k in sorted(rows, key=order)]
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=list(MODELS), default="llama2_7b")
  parser.add_argument("--target", choices=gpu_compile.TARGETS, default="h100")
  parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="bfloat16")
  parser.add_argument("--optimizer", choices=list(optimizers.OPTIMIZERS), default="adamw_4bit")
  parser.add_argument("--remat", choices=list(model.REMAT_POLICIES), default="full")
  parser.add_argument("--seq-len", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--json", type=pathlib.Path, help="add the row to this results file")
  parser.add_argument("--render", type=pathlib.Path, help="print the table of a results file and exit")
  args = parser.parse_args(argv)
  if args.render:
    print(render(json.loads(args.render.read_text())))
    return 0
  row = measure(args.model, args.target, args.param_dtype, args.optimizer, args.remat, args.seq_len, args.batch)
  print(json.dumps(row))
  if args.json:
    args.json.write_text(json.dumps(merged(row, args.json), indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
