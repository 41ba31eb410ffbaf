"""Fine-tuning with bfloat16 parameters: each optimizer with stochastic rounding against its own float32 run.

The small model's fine-tuning task of ``benchmarks.convergence`` (AdamW's
pre-trained base, ``stdlib_source``, its steps, schedule and batches) with
the base's weights cast to bfloat16: the forward and backward passes run in
bfloat16, the gradients are bfloat16, and the new parameters are written
back into bfloat16 by stochastic rounding
(``optax_memopt.with_stochastic_rounding``, seeded with the run's seed), by
round-to-nearest (``optax.apply_updates`` alone), AdamW's usual bfloat16
training, or (AdamW, and ``KAHAN_TOO``) by round-to-nearest with Kahan
compensation (``optax_memopt.with_kahan_summation``: a bfloat16 buffer per
parameter carries what rounding dropped into the next step). Each optimizer runs at its best float32 fine-tuning rate in
``benchmarks/data/convergence.json`` and is compared seed by seed with its
float32-parameter runs there (same base, batches and rate): the gap and the
standard error of the per-seed differences. The target is a gap within
0.01 or that standard error, whichever is larger.

Stochastic rounding draws its own noise: with the seed's batches fixed, the
rounding key alone moved a run of TACO's by up to 0.02. So each seed runs
with ``ROUNDING_DRAWS`` rounding keys (seeds ``seed + KEY_STRIDE * draw``,
draw 0 the seed itself) and its loss is their mean: the per-seed difference
then measures the rounding's expected cost, not one draw of its noise.
Round-to-nearest and Kahan compensation are deterministic: one run a seed.

Whether the spacing matters: a step changes a weight ``w`` by about the
learning rate (Adam's normalized step), and bfloat16's spacing at ``w`` is
``2**-7`` to ``2**-8`` of ``|w|``. AdamW also runs, every way, at lower
rates (``LOW_RATES``) where, late in the cosine schedule, its steps are
below the spacing of most weights: there round-to-nearest loses them, and
the table shows what that costs.

Runs are appended to ``--results`` as they end and a run already there is
not run again (the benchmark resumes). The table comes from the results:

    python -m benchmarks.convergence_bf16 --estimate
    python -m benchmarks.convergence_bf16 --optimizers adamw microadam   # runs, resumable
    python -m benchmarks.convergence_bf16 --render
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_memopt
from benchmarks import convergence
from memopt_tools.main_job import learning_rate_schedule
from memopt_tools.training import optimizers

RESULTS = convergence.ROOT / "benchmarks" / "data" / "convergence_bf16.json"
SIZE, TASK = "small", "finetune"
# The float32 sweep's five seeds.
SEEDS = (0, 1, 2, 3, 4)
# Rounding keys per seed for stochastic rounding, and the stride between
# them (apart from every data seed).
ROUNDING_DRAWS = 3
KEY_STRIDE = 1000
ROUNDINGS = {
  "stochastic": "stochastic rounding",
  "nearest": "round-to-nearest",
  "kahan": "Kahan compensation",
}
# optax.adamw keeps m and v in the parameters' dtype; in bfloat16, v's decay
# 0.999 rounds to 1 and v stops forgetting. This AdamW keeps them in float32
# (``float32_moments``); its float32-parameter runs are adamw's.
FLOAT32_MOMENTS = "adamw_float32_moments"
# AdamW's rates below its best (powers of 3 from its default, as in
# convergence.json): 3e-4 at the peak, a tenth of that at the end.
LOW_RATES = (-1,)
# Beside AdamW, the optimizers that also run with Kahan compensation: TACO,
# whose gap with stochastic rounding missed the target while each seed ran one rounding key.
KAHAN_TOO = ("taco",)


@dataclasses.dataclass(frozen=True)
class Case:
  """One row of the table: an optimizer, a rate (an exponent of convergence.json's grid) and a rounding."""

  optimizer: str
  exponent: int
  rounding: str

  @property
  def reference(self) -> str:
    """The optimizer whose float32-parameter runs this case compares with."""
    return convergence.BASE_OPTIMIZER if self.optimizer == FLOAT32_MOMENTS else self.optimizer


def best_exponent(reference: dict, name: str) -> int | None:
  """``name``'s best float32 fine-tuning rate in ``reference`` (convergence.json), None if it has no sweep."""
  row = convergence.row_of(reference, SIZE, TASK, name)
  return None if row is None else row.exponent


def cases(reference: dict, names) -> list[Case]:
  """Every optimizer with stochastic rounding at its best rate; AdamW also with round-to-nearest and with Kahan
  compensation, and lower; the optimizers of ``KAHAN_TOO`` also with Kahan compensation."""
  out = []
  for name in names:
    best = best_exponent(reference, name)
    if best is None:
      continue
    out.append(Case(name, best, "stochastic"))
    if name in KAHAN_TOO:
      out.append(Case(name, best, "kahan"))
    if name == convergence.BASE_OPTIMIZER:
      out += [Case(name, best, r) for r in ROUNDINGS if r != "stochastic"]
      out += [Case(name, e, r) for e in LOW_RATES if e != best for r in ROUNDINGS]
      out += [Case(FLOAT32_MOMENTS, e, r) for e in (*LOW_RATES, best) for r in ROUNDINGS]
  return out


def float32_runs(reference: dict, case: Case) -> dict[int, dict]:
  """The float32-parameter runs of ``case``'s optimizer and rate in ``reference``, by seed."""
  return {
    r["seed"]: r
    for r in convergence.runs_of(reference, SIZE, TASK, case.reference)
    if r["exponent"] == case.exponent and r["seed"] in SEEDS
  }


def draws(case: Case) -> range:
  """The rounding draws a seed of ``case`` runs: ``ROUNDING_DRAWS`` for stochastic rounding, else one."""
  return range(ROUNDING_DRAWS if case.rounding == "stochastic" else 1)


def runs_of(results: dict, case: Case) -> dict[tuple[int, int], dict]:
  """``case``'s runs in ``results``, by ``(seed, draw)``."""
  return {
    (r["seed"], r.get("rounding_draw", 0)): r
    for r in results["runs"]
    if (r["optimizer"], r["exponent"], r["rounding"]) == (case.optimizer, case.exponent, case.rounding)
  }


@dataclasses.dataclass(frozen=True)
class Row:
  case: Case
  learning_rate: float
  validation_loss: float  # Mean over SEEDS (and draws); infinite where a run diverged.
  standard_error: float | None
  float32_loss: float
  float32_error: float | None
  gap: float  # validation_loss - float32_loss.
  gap_error: float | None  # Standard error of the per-seed differences.

  @property
  def within_target(self) -> bool:
    return math.isfinite(self.gap) and abs(self.gap) <= max(0.01, self.gap_error or 0.0)


def row_of(results: dict, reference: dict, case: Case) -> Row | None:
  """``case``'s row, or None until every seed (and draw) has run in both files."""
  bf16, fp32 = runs_of(results, case), float32_runs(reference, case)
  if not {(s, d) for s in SEEDS for d in draws(case)} <= set(bf16) or not set(SEEDS) <= set(fp32):
    return None
  low = [float(np.mean([convergence.validation(bf16[s, d]) for d in draws(case)])) for s in SEEDS]
  high = [convergence.validation(fp32[s]) for s in SEEDS]
  return Row(
    case=case,
    learning_rate=bf16[SEEDS[0], 0]["learning_rate"],
    validation_loss=float(np.mean(low)),
    standard_error=convergence.standard_error(low),
    float32_loss=float(np.mean(high)),
    float32_error=convergence.standard_error(high),
    gap=float(np.mean(low) - np.mean(high)),
    gap_error=convergence.standard_error(np.subtract(low, high)),
  )


def render(results: dict, reference: dict, names=tuple(optimizers.OPTIMIZERS)) -> str:
  """The markdown table, one row per case, with the cases not run yet."""
  planned = cases(reference, names)
  rows = [row for row in (row_of(results, reference, c) for c in planned) if row is not None]
  missing = [c for c in planned if c not in {r.case for r in rows}]
  head = (
    f"Fine-tuning AdamW's pre-trained weights on the standard library's source with bfloat16 parameters and"
    f" gradients, small model ({reference['protocol']['n_params'][SIZE]:,} parameters),"
    f" {convergence.PROTOCOL[SIZE][TASK].steps} steps, seeds {', '.join(map(str, SEEDS))}; the gap is to the same"
    " optimizer's float32-parameter runs at the same rate and seeds (`convergence.json`); with stochastic rounding"
    f" a seed's loss is the mean of {ROUNDING_DRAWS} rounding keys"
  )
  if missing:
    head += ". Partial (not run yet: " + ", ".join(_case_name(c) for c in missing) + ")"
  lines = [
    head + ".",
    "",
    "| optimizer | rate | bfloat16 rounding | validation loss | float32 parameters | gap | within 0.01 or its SE |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r.case.optimizer} | {r.learning_rate:.1e} ({convergence.rate_name(r.case.exponent)})"
      f" | {ROUNDINGS[r.case.rounding]}"
      f" | {convergence._plus_minus(r.validation_loss, r.standard_error, sign='')}"
      f" | {convergence._plus_minus(r.float32_loss, r.float32_error, sign='')}"
      f" | {convergence._plus_minus(r.gap, r.gap_error)} | {'yes' if r.within_target else 'no'} |"
    )
  return "\n".join(lines)


def _case_name(case: Case) -> str:
  return f"{case.optimizer} {convergence.rate_name(case.exponent)} {case.rounding}"


def protocol_json() -> dict:
  """The protocol stored beside the runs: a resumed benchmark must run the same one."""
  task = convergence.PROTOCOL[SIZE][TASK]
  return {
    "size": SIZE,
    "task": TASK,
    "steps": task.steps,
    "lr_scale": task.lr_scale,
    "seeds": list(SEEDS),
    "rounding_draws": ROUNDING_DRAWS,
    "key_stride": KEY_STRIDE,
    "batch_size": convergence.BATCH_SIZE,
    "seq_len": convergence.SEQ_LEN,
    "param_dtype": "bfloat16",
  }


def load(path: pathlib.Path) -> dict:
  if not path.exists():
    return {"protocol": protocol_json(), "runs": []}
  results = json.loads(path.read_text())
  if results["protocol"] != protocol_json():
    raise SystemExit(f"{path} holds runs of another protocol; move it away or pass another --results")
  return results


def float32_moments(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` initialised and updated on float32 copies of the parameters and updates: its state in float32."""
  up = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  return optax.GradientTransformation(
    lambda params: tx.init(up(params)),
    lambda updates, state, params=None: tx.update(up(updates), state, None if params is None else up(params)),
  )


def train_once(case: Case, seed: int, draw: int, base_params) -> dict:
  """One run with bfloat16 parameters, ``draw`` its rounding key (:data:`ROUNDING_DRAWS`): its record."""
  task = convergence.PROTOCOL[SIZE][TASK]
  spec = optimizers.get(case.reference)
  config = convergence.SIZES[SIZE]
  peak = spec.default_learning_rate * task.lr_scale * 3.0**case.exponent
  tx = spec.build(learning_rate_schedule(peak, task.steps), config)
  if case.optimizer == FLOAT32_MOMENTS:
    tx = float32_moments(tx)
  if case.rounding == "stochastic":
    tx = optax_memopt.with_stochastic_rounding(tx, seed=seed + KEY_STRIDE * draw)
  elif case.rounding == "kahan":
    tx = optax_memopt.with_kahan_summation(tx)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base_params)
  start = time.perf_counter()
  result, divergence = convergence.train_task(config, tx, task, seed=seed, params=params)
  diverged = None if divergence is None else divergence.step
  validation = None if divergence is not None else result.validation_loss
  return {
    "optimizer": case.optimizer,
    "exponent": case.exponent,
    "rounding": case.rounding,
    "seed": seed,
    "rounding_draw": draw,
    "learning_rate": peak,
    "validation_loss": validation,
    "diverged_at_step": diverged,
    "final_train_loss": None if diverged else float(np.mean(result.train_losses[-20:])),
    "ms_per_step": 1e3 * result.seconds_per_step if math.isfinite(result.seconds_per_step) else None,
    "seconds": round(time.perf_counter() - start, 2),
  }


def estimate(results: dict, todo: list[tuple[Case, int, int]]) -> str:
  """The time left: each run at the median time of the runs here, or of the float32 runs of convergence.json."""
  timed = [r["seconds"] for r in results["runs"]]
  per_run = float(np.median(timed)) if timed else math.nan
  return f"{len(todo)} runs to go, about {len(todo) * per_run / 60:.0f} min at {per_run:.0f} s a run" + (
    " (no run timed yet)" if not timed else ""
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=list(optimizers.OPTIMIZERS),
    choices=list(convergence.NAMES),
    help="in this order",
  )
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the JSON results, read and extended")
  parser.add_argument("--reference", type=pathlib.Path, default=convergence.RESULTS, help="the float32 runs")
  parser.add_argument(
    "--cache", type=pathlib.Path, default=pathlib.Path("results"), help="folder of the pre-trained base"
  )
  parser.add_argument("--render", action="store_true", help="print the table and exit")
  parser.add_argument("--estimate", action="store_true", help="print the time left and exit")
  args = parser.parse_args(argv)
  reference = convergence.load(args.reference)
  results = load(args.results)
  if args.render:
    print(render(results, reference))
    return
  names = [convergence.BASE_OPTIMIZER] + [n for n in args.optimizers if n != convergence.BASE_OPTIMIZER]
  todo = []
  for case in cases(reference, names):
    done = runs_of(results, case)
    todo += [(case, s, d) for s in SEEDS for d in draws(case) if (s, d) not in done]
  print(estimate(results, todo), flush=True)
  if args.estimate or not todo:
    return
  key, steps = convergence.base_of(reference["protocol"], SIZE, TASK)
  base, _ = convergence.pretrained_base(
    SIZE, steps, reference["bases"][key], args.cache / f"convergence_base_{key}.msgpack"
  )
  for count, (case, seed, draw) in enumerate(todo, 1):
    record = train_once(case, seed, draw, base)
    results["runs"].append(record)
    convergence.save(args.results, results)
    print(
      f"[{count}/{len(todo)}] {_case_name(case)} seed {seed} draw {draw}: validation"
      f" {convergence._loss(convergence.validation(record))} ({record['seconds']:.0f} s)",
      flush=True,
    )
  print(render(results, reference))


if __name__ == "__main__":
  main()
