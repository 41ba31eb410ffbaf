"""The planner's compiled peak of a whole training step against the GPU's measured peak.

``memopt_tools.fit`` and ``memopt_tools.train_compile`` say whether a
training step fits from XLA's peak of the step compiled for a GPU
description, with a margin for what the compile cannot see. On a real GPU
this benchmark checks that margin: for each optimizer, the whole training
step of a model from ``benchmarks.shapes`` (forward, backward, optimizer,
``optax.apply_updates``; parameters and state donated) is compiled three
ways where it can be, for the device present, for ``--target``'s
description as the planner does (``train_compile.compile_train_step``), and
then run once, reading the allocator's peak (``Device.memory_stats``).

The allocator's peak is the process's, never reset, so the steps run one
after another in increasing order of their compiled peak, each on arrays of
its own that are freed before the next: each step's measured peak is the
process's peak after it, less what was in use before its arrays were made.
A row whose step does not raise the process's peak says so.

    python -m benchmarks.train_step_peak --model 300M --batch 8 --target h200 --json results/train_step_peak.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import shapes
from memopt_tools import gpu_compile, train_compile  # First: it sets the CUDA plugin's environment.
from memopt_tools.training import loop, model


def _in_use(device) -> int:
  return int(device.memory_stats()["bytes_in_use"])


def _peak(device) -> int:
  return int(device.memory_stats()["peak_bytes_in_use"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="300M", choices=sorted(set(shapes.MODELS) - {"llama2_7b", "llama3_8b"}))
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--optimizers", nargs="+", default=["adamw", "microadam", "adamw_8bit", "adam_mini", "taco"])
  parser.add_argument("--target", default="h200", help="the GPU description the planner compiles for")
  parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("results/train_step_peak.json"))
  args = parser.parse_args(argv)
  if args.batch < 1:
    parser.error("--batch must be >= 1")
  device = jax.local_devices()[0]
  measures = device.memory_stats() is not None
  if not measures:
    print(f"{device.device_kind} reports no memory statistics: compiled peaks only (run this on a GPU)")

  config = shapes.MODELS[args.model]
  dtype = jnp.dtype(args.param_dtype)
  graphdef = nnx.split(nnx.eval_shape(lambda: model.Transformer(config, rngs=nnx.Rngs(0))))[0]
  abstract_params = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, dtype), shapes.params(args.model, abstract=True)
  )
  batch_shape = jax.ShapeDtypeStruct((args.batch, config.max_len + 1), jnp.int32)
  loss_fn = lambda p, b: loop.next_token_loss(graphdef, p, b)

  rows = []
  compiled = {}
  for name in args.optimizers:
    tx = train_compile.registered_optimizer(
      name, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, stochastic_rounding=dtype != jnp.float32
    )
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    step = train_compile.training_step(loss_fn, tx)
    program = jax.jit(step, donate_argnums=(0, 1)).lower(abstract_params, abstract_state, batch_shape).compile()
    row = {
      "optimizer": name,
      "measured_peak": None,
      "compiled_peak": int(gpu_compile.ProgramMemory(**gpu_compile.ProgramMemory.fields_of(program)).peak_bytes),
    }
    try:
      row["planner_peak"] = train_compile.compile_train_step(
        loss_fn, abstract_params, batch_shape, tx, target=args.target
      ).peak_bytes
    except Exception as e:  # The device's own figures stand without the planner's.
      row["planner_peak"] = None
      row["planner_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    compiled[name] = (tx, program)
    rows.append(row)

  for row in sorted(rows, key=lambda r: r["compiled_peak"]) if measures else []:
    tx, program = compiled[row["optimizer"]]
    before_peak, before = _peak(device), _in_use(device)
    params = jax.tree.map(lambda x: x.astype(dtype), shapes.params(args.model))
    state = tx.init(params)
    batch = jax.random.randint(jax.random.key(0), batch_shape.shape, 0, config.vocab_size, jnp.int32)
    params, state, loss = program(params, state, batch)
    jax.block_until_ready((params, state, loss))
    after_peak = _peak(device)
    row["measured_peak"] = after_peak - before if after_peak > before_peak else None
    row["loss_finite"] = bool(jnp.isfinite(loss))
    del params, state, batch, loss
    rows_done = {"compiled": row["compiled_peak"], "planner": row["planner_peak"], "measured": row["measured_peak"]}
    print(
      row["optimizer"],
      {k: (None if v is None else round(v / 2**30, 3)) for k, v in rows_done.items()},
      "GiB",
      flush=True,
    )

  print(f"\n{args.model}, batch {args.batch} x {config.max_len}, {args.param_dtype} parameters, {device.device_kind}")
  print("| optimizer | compiled peak GiB | planner's peak GiB | measured peak GiB | measured / compiled |")
  print("|---|---|---|---|---|")
  gib = lambda v: "-" if v is None else f"{v / 2**30:.3f}"
  for row in rows:
    ratio = "-" if row["measured_peak"] is None else f"{row['measured_peak'] / row['compiled_peak']:.3f}"
    print(
      f"| {row['optimizer']} | {gib(row['compiled_peak'])} | {gib(row['planner_peak'])}"
      f" | {gib(row['measured_peak'])} | {ratio} |"
    )
  results = {
    "command": "python -m benchmarks.train_step_peak " + " ".join(argv if argv is not None else sys.argv[1:]),
    "device": device.device_kind,
    "date": datetime.date.today().isoformat(),
    "jax": jax.__version__,
    "model": args.model,
    "batch": args.batch,
    "seq_len": config.max_len,
    "param_dtype": args.param_dtype,
    "target": args.target,
    "rows": rows,
  }
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(results, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
