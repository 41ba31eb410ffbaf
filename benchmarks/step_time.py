"""Jitted step time of every optimizer as a ratio to ``optax.adamw``, in one run.

For each model size, every optimizer updates the same parameters with the
same gradients; the steps (update + apply, state and params donated) are
compiled first and then timed in ``--repeats`` rounds, each round two steps
of every optimizer in turn (the second one timed), so that a slower or busier
stretch of the machine weighs on all of them alike. A row reports the median
step time and the median over rounds of its ratio to the same round's
``optax.adamw`` step. The compiled step's temporary memory (XLA's
``memory_analysis``) shows any transient dense buffer an optimizer needs
beyond its state. With ``--implementations xla pallas`` (on
a GPU) the methods with kernels are timed once per implementation, against
the same adamw baseline. ``--optimizers`` also takes the steps of
``PROBES`` (``galore_svd_step``: GaLore's step that recomputes its
projections, which the ``galore`` row, timed on steps 3 to 22, never takes).
With ``--param-dtypes float32 bfloat16`` each model is also timed with
bfloat16 parameters and gradients: ``optax.adamw`` as it is (round to
nearest, the baseline of the bfloat16 rows), then every optimizer, ``adamw``
too, followed by ``optax_memopt.stochastic_rounding`` as a user runs it.
With ``--steps-per-call N`` one timed call takes N steps in a
``lax.fori_loop``: a step's few hundred arrays cost the host a dispatch that
can outlast the GPU's work, which a loop pays once per N steps.
``--compile-threads`` compiles that many steps at once (XLA compiles in
threads), and ``--compile-budget`` stops starting compiles after that many
seconds, listing what it left out. With ``--bandwidth`` (TB/s) each row also gives the bytes per parameter that
the compiled program moves (``memopt_tools.gpu_compile.bytes_moved`` of the
program timed), the time those bytes take at that bandwidth, and the
measured time over it. Writes the rows with the machine and the command to
``--json`` (``results/step_time.json``) after each model and dtype, so that a
run stopped early keeps what it measured; benchmarks/README.md's tables are
``--render`` of the committed files.

    python -m benchmarks.step_time --models 10M 40M --repeats 10 --json benchmarks/data/step_time.json
    python -m benchmarks.step_time --render benchmarks/data/step_time.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optax_memopt
from benchmarks import shapes
from memopt_tools import gpu_compile
from memopt_tools.training import optimizers

# Steps timed beside the registry's, by name: GaLore's step that recomputes its
# projections (an SVD of every matrix's gradient), which optax's default takes
# once every 200 steps, so that the registry's galore row times only the others.
PROBES = {
  "galore_svd_step": optimizers.OptimizerSpec(
    lambda lr, config: optax.contrib.galore(lr, update_proj_gap=1, weight_decay=optimizers.WEIGHT_DECAY),
    1e-3,
    "optax.contrib.galore recomputing its projections every step",
  )
}


def compile_step(optimizer, params, grads, steps_per_call: int = 1):
  """The jitted update + apply, params and state donated, compiled; and the optimizer's first state.

  With ``steps_per_call`` above 1 one call takes that many steps in a
  ``lax.fori_loop`` on the same gradients, so that the host dispatches one
  call of a few hundred arrays per that many steps.
  """

  def step(params, state, grads):
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def steps(params, state, grads):
    return jax.lax.fori_loop(0, steps_per_call, lambda _, carry: step(*carry, grads), (params, state))

  state = optimizer.init(params)
  program = step if steps_per_call == 1 else steps
  return jax.jit(program, donate_argnums=(0, 1)).lower(params, state, grads).compile(), state


def temporary_bytes(compiled) -> int:
  """The compiled step's temporary memory per XLA's ``memory_analysis`` (0 where not reported)."""
  return int(getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) or 0)


class Timed:
  """One optimizer's compiled step with its running params and state, and its step times.

  Built in two parts, so that many can compile at once in threads
  (``compile``), then take their first steps one after another (``start``).
  """

  def __init__(self, optimizer, params, steps_per_call: int = 1):
    self.optimizer, self.params, self.steps_per_call = optimizer, params, steps_per_call
    self.seconds: list[float] = []

  def compile(self, grads) -> None:
    start = time.perf_counter()
    self.compiled, self.state = compile_step(self.optimizer, self.params, grads, self.steps_per_call)
    self.compile_seconds = time.perf_counter() - start
    self.temp_bytes = temporary_bytes(self.compiled)
    try:
      # A loop's body counts once per trip: the bytes of one step are the call's over its steps.
      self.bytes_moved = gpu_compile.bytes_moved(self.compiled.as_text()) / self.steps_per_call
    except Exception as e:  # A program the counter cannot read is still timed.
      print(f"bytes not counted: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
      self.bytes_moved = None

  def start(self, grads) -> None:
    for _ in range(2):  # Warm-up calls, not timed.
      self.params, self.state = self.compiled(self.params, self.state, grads)
    jax.block_until_ready((self.params, self.state))

  def step(self, grads) -> None:
    """Times one call, after an untimed one that brings this optimizer's arrays into the caches.

    Back-to-back steps of one optimizer find them there; the optimizer
    timed just before would otherwise have left its own.
    """
    self.params, self.state = self.compiled(self.params, self.state, grads)
    jax.block_until_ready((self.params, self.state))
    start = time.perf_counter()
    self.params, self.state = self.compiled(self.params, self.state, grads)
    jax.block_until_ready((self.params, self.state))
    self.seconds.append((time.perf_counter() - start) / self.steps_per_call)


def header(bandwidth: float | None) -> str:
  columns = ["model", "params", "param dtype", "optimizer", "implementation", "rounding", "ms/step", "ratio to adamw"]
  if bandwidth:
    columns += ["bytes/param", f"ms at {bandwidth:g} TB/s", "measured / bytes' time"]
  columns.append("temp MB")
  return "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"


def table_row(row: dict, bandwidth: float | None) -> str:
  cells = [
    row["model"],
    f"{row['n_params']:,}",
    row.get("param_dtype", "float32"),
    row["optimizer"],
    row["implementation"],
    row.get("rounding", "-"),
    f"{row['ms_per_step']:.2f}",
    f"{row['ratio_to_adamw']:.2f}x",
  ]
  if bandwidth and row["bytes_moved"] is None:
    cells += ["-", "-", "-"]
  elif bandwidth:
    predicted_ms = 1e3 * row["bytes_moved"] / (bandwidth * 1e12)
    cells += [
      f"{row['bytes_moved'] / row['n_params']:.1f}",
      f"{predicted_ms:.2f}",
      f"{row['ms_per_step'] / predicted_ms:.2f}",
    ]
  cells.append(f"{row['temp_bytes'] / 2**20:.1f}")
  return "| " + " | ".join(cells) + " |"


def render(results: dict) -> str:
  """The markdown table of a results file: where and how it was measured, then a row per step."""
  bandwidth = results.get("bandwidth_tb_s")
  lines = [
    f"`{results['command']}` ({results['machine']}, {results['date']}; JAX {results['jax']}).",
    "",
    header(bandwidth),
    *(table_row(row, bandwidth) for row in results["rows"]),
  ]
  if results.get("left_out"):
    lines += ["", "Not timed (`--compile-budget` spent): " + ", ".join(results["left_out"]) + "."]
  return "\n".join(lines)


def steps_to_time(names: list[str], param_dtype: str) -> list[tuple[str, str]]:
  """(optimizer, rounding) in table order, the baseline first: plain adamw, then each optimizer rounded if bfloat16."""
  if param_dtype == "float32":
    return [(name, "-") for name in names]
  return [("adamw", "nearest")] + [(name, "stochastic") for name in names]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=["10M", "40M"], choices=sorted(shapes.MODELS))
  parser.add_argument("--optimizers", nargs="+", default=list(optimizers.OPTIMIZERS))
  parser.add_argument(
    "--implementations",
    nargs="+",
    default=["auto"],
    choices=["auto", "xla", "pallas"],
    help="kernel paths to time; auto: Pallas on a Hopper-or-newer GPU, XLA elsewhere",
  )
  parser.add_argument("--param-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument(
    "--steps-per-call",
    type=int,
    default=1,
    help="steps one timed call takes (a lax.fori_loop), so that the host's dispatch of the call weighs 1/N",
  )
  parser.add_argument(
    "--compile-threads", type=int, default=1, help="steps compiled at once (XLA compiles in parallel threads)"
  )
  parser.add_argument(
    "--compile-budget",
    type=float,
    help="seconds: once compiling has taken this long, time the steps compiled and list the rest as left out",
  )
  parser.add_argument(
    "--bandwidth",
    type=float,
    help="memory bandwidth in TB/s (an H200's: 4.8): adds each step's bytes and the time they take at it",
  )
  parser.add_argument(
    "--json",
    type=pathlib.Path,
    default=pathlib.Path("results/step_time.json"),
    help="where the results go (the committed ones: benchmarks/data/step_time.json)",
  )
  parser.add_argument(
    "--machine",
    default=f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores",
    help="how the results file names the machine measured",
  )
  parser.add_argument("--render", type=pathlib.Path, help="print the table of a results file and exit")
  args = parser.parse_args(argv)
  if args.render:
    print(render(json.loads(args.render.read_text())))
    return
  for flag in ("repeats", "steps_per_call", "compile_threads"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1")
  names = ["adamw"] + [n for n in args.optimizers if n != "adamw"]
  implementations = [None if i == "auto" else i for i in args.implementations]
  if args.bandwidth is not None and args.bandwidth <= 0:
    parser.error("--bandwidth must be positive")
  results = {
    "command": "python -m benchmarks.step_time " + shlex.join(argv if argv is not None else sys.argv[1:]),
    "machine": args.machine,
    "date": datetime.date.today().isoformat(),
    "jax": jax.__version__,
    "bandwidth_tb_s": args.bandwidth,
    "rows": [],
    "left_out": [],
  }
  print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}")
  print(header(args.bandwidth))
  started = time.perf_counter()
  for model in args.models:
    for param_dtype in args.param_dtypes:
      params = jax.tree.map(lambda x: x.astype(param_dtype), shapes.params(model))
      grads = shapes.gradients(params)
      timed = []  # (name, path, rounding, Timed) in table order, the baseline first.
      for name, rounding in steps_to_time(names, param_dtype):
        spec = PROBES[name] if name in PROBES else optimizers.get(name)
        for implementation in implementations if spec.has_kernels else [None]:
          options = {"implementation": implementation} if spec.has_kernels else {}
          optimizer = spec.build(1e-3, shapes.MODELS[model], **options)
          if rounding == "stochastic":
            optimizer = optax_memopt.with_stochastic_rounding(optimizer)
          # "default": each op's own choice (benchmarks/README.md says which on a GPU).
          path = (implementation or "default") if spec.has_kernels else "xla"
          fresh = jax.tree.map(jnp.copy, params)  # Donation consumes the buffers.
          timed.append((name, path, rounding, Timed(optimizer, fresh, args.steps_per_call)))

      def compile_within_budget(entry, model=model, param_dtype=param_dtype, params=params, grads=grads):
        name, path, rounding, timed_step = entry
        if args.compile_budget is not None and time.perf_counter() - started > args.compile_budget:
          left_out = f"{model} {param_dtype} {name} {path}"
          print(f"left out (--compile-budget {args.compile_budget:g}s spent): {left_out}", flush=True)
          results["left_out"].append(left_out)
          return None
        try:
          timed_step.compile(grads)
          return entry
        except Exception as e:  # One row per optimizer, whatever happens.
          print(
            f"| {model} | {shapes.count(params):,} | {param_dtype} | {name} | {path} | {rounding} |"
            f" {type(e).__name__}: {str(e).splitlines()[0][:120]} |",
            flush=True,
          )
          return None

      with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        timed = [entry for entry in pool.map(compile_within_budget, timed) if entry is not None]
      for *_, entry in timed:
        entry.start(grads)
      for _ in range(args.repeats):
        for *_, entry in timed:
          entry.step(grads)
      baseline = timed[0][-1].seconds
      for name, path, rounding, entry in timed:
        row = {
          "model": model,
          "n_params": shapes.count(params),
          "param_dtype": param_dtype,
          "optimizer": name,
          "implementation": path,
          "rounding": rounding,
          "ms_per_step": 1e3 * statistics.median(entry.seconds),
          "ratio_to_adamw": statistics.median(s / b for s, b in zip(entry.seconds, baseline)),
          "bytes_moved": entry.bytes_moved,
          "temp_bytes": entry.temp_bytes,
          "compile_seconds": entry.compile_seconds,
        }
        results["rows"].append(row)
        print(table_row(row, args.bandwidth), flush=True)
      del timed, params, grads
      args.json.parent.mkdir(parents=True, exist_ok=True)
      args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  main()
