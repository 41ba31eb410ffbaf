"""Jitted step time of every optimizer as a ratio to ``optax.adamw``, in one run.

For each model size, every optimizer updates the same parameters with the
same gradients; the step (update + apply, state and params donated) is timed
after compilation, the median of ``--repeats`` runs. The compiled step's
temporary memory (XLA's ``memory_analysis``) shows any transient dense buffer
an optimizer needs beyond its state. With ``--implementations xla pallas`` (on
a GPU) the methods with kernels are timed once per implementation, against
the same adamw baseline. Prints a markdown table and writes
``results/step_time.json``.

    python -m benchmarks.step_time
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks import shapes
from optax_memopt.training import optimizers


def compile_step(optimizer, params, grads):
  """The jitted update + apply, params and state donated, compiled; and the optimizer's first state."""

  def step(params, state, grads):
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = optimizer.init(params)
  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile(), state


def temporary_bytes(compiled) -> int:
  """The compiled step's temporary memory per XLA's ``memory_analysis`` (0 where not reported)."""
  return int(getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) or 0)


def time_step(optimizer, params, grads, repeats: int) -> tuple[float, int]:
  """Median seconds per jitted step, and the compiled step's temporary bytes."""
  compiled, state = compile_step(optimizer, params, grads)
  temp_bytes = temporary_bytes(compiled)
  for _ in range(2):
    params, state = compiled(params, state, grads)
  jax.block_until_ready(params)
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, state = compiled(params, state, grads)
    jax.block_until_ready((params, state))
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds), temp_bytes


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=["10M", "40M"], choices=sorted(shapes.MODELS))
  parser.add_argument("--optimizers", nargs="+", default=list(optimizers.OPTIMIZERS))
  parser.add_argument("--implementations", nargs="+", default=["auto"], choices=["auto", "xla", "pallas"],
                      help="kernel paths to time; auto: Pallas on a Hopper-or-newer GPU, XLA elsewhere")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  args = parser.parse_args(argv)
  names = ["adamw"] + [n for n in args.optimizers if n != "adamw"]
  implementations = [None if i == "auto" else i for i in args.implementations]

  rows = []
  print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}")
  print("| model | params | optimizer | implementation | ms/step | ratio to adamw | temp MB |")
  print("|---|---|---|---|---|---|---|")
  for model in args.models:
    params = shapes.params(model)
    grads = shapes.gradients(params)
    baseline = None
    for name in names:
      spec = optimizers.get(name)
      for implementation in implementations if spec.has_kernels else [None]:
        fresh = jax.tree.map(jnp.copy, params)  # Donation consumes the buffers.
        options = {"implementation": implementation} if spec.has_kernels else {}
        optimizer = spec.build(1e-3, shapes.MODELS[model], **options)
        # "default": each op's own choice (benchmarks/README.md says which on a GPU).
        path = (implementation or "default") if spec.has_kernels else "xla"
        try:
          seconds, temp = time_step(optimizer, fresh, grads, args.repeats)
        except Exception as e:  # One row per optimizer, whatever happens.
          print(f"| {model} | {shapes.count(params):,} | {name} | {path} |"
                f" {type(e).__name__}: {str(e).splitlines()[0][:120]} | - | - |", flush=True)
          continue
        baseline = baseline or seconds
        row = {"model": model, "n_params": shapes.count(params), "optimizer": name, "implementation": path,
               "ms_per_step": 1e3 * seconds, "ratio_to_adamw": seconds / baseline, "temp_bytes": temp}
        rows.append(row)
        print(f"| {model} | {row['n_params']:,} | {name} | {path} | {row['ms_per_step']:.1f} |"
              f" {row['ratio_to_adamw']:.2f}x | {temp / 2**20:.1f} |", flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "step_time.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
