"""Does the model still learn, and how far from AdamW? Rate sweeps that bracket each optimizer's best.

Two tasks, on the demo Transformer at two sizes (``SIZES``):

1. Pre-training: each optimizer trains the model from scratch on CPython's
   help pages (``pydoc_topics``).
2. Fine-tuning, the use case MicroAdam and TACO were made for: AdamW
   pre-trains the model on ``pydoc_topics`` (its default rate, seed 0), then
   each optimizer fine-tunes those weights on the Python source of
   standard-library modules (``stdlib_source``), from ``lr_scale`` times its
   default rate.

Each optimizer's peak rates are its default times powers of 3. The sweep
starts at three of them (``Task.start``) and, while the lowest mean
validation loss sits at an edge of the rates tried, adds the next rate on
that side, up to
``MAX_EXPONENT`` powers of 3 from the default: an optimizer is judged at its
own best rate, not at one that happened to suit another. Every rate runs every
seed of its task (initialisation and batches; batches only when
fine-tuning), the same seeds for every optimizer. A table row gives the best
rate's mean validation loss and its standard error over the seeds, the gap to
AdamW with the standard error of the per-seed differences, and the mean at
every rate; a best rate at an edge of its grid is marked.

Every run is appended to the JSON results (``--results``) as soon as it ends,
and a run already there is not run again, so the benchmark runs in parts
(``--optimizers``, ``--sizes``, ``--tasks``) and resumes after an
interruption. The tables and the plots come from the results alone:

    python -m benchmarks.convergence --sizes small --tasks finetune   # runs, resumable
    python -m benchmarks.convergence --estimate   # the full protocol's time, from the runs measured
    python -m benchmarks.convergence --render     # markdown to stdout, plots to benchmarks/figures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time

import flax.serialization
import numpy as np

from memopt_tools.main_job import MODEL_SIZES, learning_rate_schedule
from memopt_tools.training import data, loop, model, optimizers, report

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "data" / "convergence.json"
FIGURES = ROOT / "benchmarks" / "figures"

SIZES = {
  "small": MODEL_SIZES["small"],
  "large": model.TransformerConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
}
BATCH_SIZE = 16
SEQ_LEN = 64
PRETRAIN_CORPUS = "pydoc_topics"
FINETUNE_CORPUS = "stdlib_source"
BASE_OPTIMIZER = "adamw"
# The registry's optimizers, then the variants that answer issue 33's questions.
NAMES = (*optimizers.OPTIMIZERS, *optimizers.VARIANTS)
BASE_SEED = 0


@dataclasses.dataclass(frozen=True)
class Task:
  """One sweep's setting: what each run trains on, for how long, from which rates and seeds."""

  corpus: str
  steps: int
  seeds: tuple[int, ...]
  lr_scale: float  # The rates are lr_scale * default * 3**exponent.
  start: tuple[int, ...]  # The exponents every sweep runs first.
  optimizers: tuple[str, ...] | None = None  # None: every one.
  # Fine-tuning: the steps of AdamW's pre-training that makes the base; None: the size's BASE_PRETRAIN_STEPS.
  base_steps: int | None = None


# Fine-tuning starts at 0.3x the default rate times 3, 9 and 27 and pre-training
# at the default times 1, 3 and 9: where the best rates of the previous,
# three-rate benchmark were, at or past its top. The larger model (30 times
# the parameters, and about as many times the step time) fine-tunes for 100
# steps over three seeds, from a base pre-trained for 500 steps, with every
# optimizer of the small model's fine-tuning table, 8-bit AdamW with the head
# and the embedding alone in float32 state, and TACO with its fallback at
# AdamW's rate.
LARGE_OPTIMIZERS = (
  "adamw",
  "adamw_8bit",
  "adamw_8bit_vocab_fp32",
  "adamw_fp8",
  "microadam",
  "microadam_5pct",
  "taco",
  "adam_mini",
  "ternary_adam",
  "adamw_4bit",
  "adafactor",
  "adamw_8bit_head_fp32",
  "adamw_8bit_embed_fp32",
  "taco_fallback_adamw_rate",
  # optax's GaLore (issue 47), at its defaults and at a state the size of ours.
  "galore",
  "galore_rank8",
  "adamw_bf16",
  "adamw_fp8_vocab_fp32",
  "taco_one_segment",
)
# The small model fine-tuned as the large one is (100 steps from a base
# pre-trained for 500): its gaps beside the large model's differ by size alone.
SAME_STEPS_OPTIMIZERS = ("adamw", "microadam", "taco", "adamw_8bit", "adamw_fp8", "ternary_adam", "adam_mini")
PROTOCOL = {
  "small": {
    "finetune": Task(FINETUNE_CORPUS, steps=300, seeds=(0, 1, 2, 3, 4), lr_scale=0.3, start=(1, 2, 3)),
    "pretrain": Task(PRETRAIN_CORPUS, steps=1000, seeds=(0,), lr_scale=1.0, start=(0, 1, 2)),
    "finetune_short": Task(
      FINETUNE_CORPUS,
      steps=100,
      seeds=(0, 1, 2, 3, 4),
      lr_scale=0.3,
      start=(1, 2, 3),
      optimizers=SAME_STEPS_OPTIMIZERS,
      base_steps=500,
    ),
  },
  "large": {
    "finetune": Task(
      FINETUNE_CORPUS, steps=100, seeds=(0, 1, 2), lr_scale=0.3, start=(1, 2, 3), optimizers=LARGE_OPTIMIZERS
    ),
  },
}
# AdamW's pre-training run whose weights every fine-tuning run starts from.
BASE_PRETRAIN_STEPS = {"small": 1000, "large": 500}
MAX_EXPONENT = 4  # The grid stops at x81 and x1/81 of the default.
# TACO's variant whose fallback group (Adam on embeddings, norms and vectors)
# trains at AdamW's best fine-tuning rate of the size, on the same schedule,
# while TACO's own rate is swept (its default rate: TACO's). The rates are
# AdamW's rows in the committed results (tests/test_convergence.py checks them).
TACO_FALLBACK_AT_ADAMW_RATE = "taco_fallback_adamw_rate"
ADAMW_BEST_FINETUNE_RATE = {"small": 8.1e-3, "large": 9e-4}
LOSSES_EVERY = 10  # A run keeps the mean training loss of every 10 steps, for the plots.


def rate_name(exponent: int) -> str:
  """``x3``, ``x1``, ``x1/9``: the multiple ``3**exponent`` of the default rate."""
  return f"x{3**exponent}" if exponent >= 0 else f"x1/{3**-exponent}"


def validation(run: dict) -> float:
  """A run's validation loss; infinite for a run that diverged."""
  return math.inf if run["validation_loss"] is None else run["validation_loss"]


def standard_error(values) -> float | None:
  """Standard error of the mean (sample standard deviation / sqrt(n)); None for fewer than two values."""
  values = np.asarray(values, dtype=np.float64)
  if len(values) < 2 or not np.all(np.isfinite(values)):
    return None
  return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def runs_of(results: dict, size: str, task: str, optimizer: str | None = None) -> list[dict]:
  return [r for r in results["runs"] if r["size"] == size and r["task"] == task and optimizer in (None, r["optimizer"])]


def complete_rates(runs: list[dict], seeds) -> dict[int, list[dict]]:
  """The runs of each rate that has run every seed, by exponent, in seed order."""
  by_rate = {}
  for r in runs:
    by_rate.setdefault(r["exponent"], {})[r["seed"]] = r
  return {e: [by_seed[s] for s in seeds] for e, by_seed in sorted(by_rate.items()) if set(seeds) <= set(by_seed)}


def mean_validation(runs: list[dict]) -> float:
  return float(np.mean([validation(r) for r in runs]))


def next_exponent(means: dict[int, float], *, start, limit: int = MAX_EXPONENT) -> int | None:
  """The next rate a sweep runs, or None when its best mean lies inside the rates tried (or at the limit).

  Args:
    means: mean validation loss by exponent of the rates already complete.
    start: the rates every sweep runs first.
    limit: the largest ``|exponent|`` a sweep may reach.
  """
  missing = [e for e in start if e not in means]
  if missing:
    return missing[0]
  best = min(sorted(means), key=lambda e: means[e])  # Ties to the smaller rate.
  if best == min(means) and best > -limit:
    return best - 1
  if best == max(means) and best < limit:
    return best + 1
  return None


@dataclasses.dataclass(frozen=True)
class Row:
  """One optimizer's sweep, summarized at its best rate."""

  optimizer: str
  exponent: int
  learning_rate: float
  validation_loss: float  # Infinite where every seed of every rate diverged.
  standard_error: float | None
  validation: tuple[float, ...]  # Per seed, in the task's seed order.
  final_train_loss: float
  means: dict[int, float]  # Mean validation loss by exponent, every complete rate.
  at_edge: bool  # The best is the smallest or largest rate tried.
  finished: bool  # The sweep has nothing left to run.
  state_bytes_per_param: float
  state_bytes: int
  adamw_state_bytes: int
  train_losses: list[float]  # Mean over the best rate's seeds, one point per LOSSES_EVERY steps.
  diverged_at_step: int | None


def summarize(runs: list[dict], seeds, *, start, limit: int = MAX_EXPONENT) -> Row | None:
  """The row of one optimizer's sweep; None before any rate has run all its seeds."""
  rates = complete_rates(runs, seeds)
  if not rates:
    return None
  means = {e: mean_validation(rs) for e, rs in rates.items()}
  best = min(sorted(means), key=lambda e: means[e])
  best_runs = rates[best]
  shortest = min(len(r["train_losses"]) for r in best_runs)
  values = tuple(validation(r) for r in best_runs)
  return Row(
    optimizer=best_runs[0]["optimizer"],
    exponent=best,
    learning_rate=best_runs[0]["learning_rate"],
    validation_loss=means[best],
    standard_error=standard_error(values),
    validation=values,
    final_train_loss=float(
      np.mean([math.inf if r["final_train_loss"] is None else r["final_train_loss"] for r in best_runs])
    ),
    means=means,
    at_edge=best in (min(means), max(means)),
    finished=next_exponent(means, start=start, limit=limit) is None,
    state_bytes_per_param=best_runs[0]["state_bytes"] / best_runs[0]["n_params"],
    state_bytes=best_runs[0]["state_bytes"],
    adamw_state_bytes=best_runs[0]["adamw_state_bytes"],
    train_losses=[float(x) for x in np.mean([r["train_losses"][:shortest] for r in best_runs], axis=0)],
    diverged_at_step=min((r["diverged_at_step"] for r in best_runs if r["diverged_at_step"]), default=None)
    if not math.isfinite(means[best])
    else None,
  )


def gap_to(row: Row, base: Row) -> tuple[float, float | None]:
  """Mean validation gap of ``row`` to ``base`` and the standard error of the per-seed differences."""
  differences = np.asarray(row.validation) - np.asarray(base.validation)
  return float(row.validation_loss - base.validation_loss), standard_error(differences)


def _loss(value: float) -> str:
  return f"{value:.3f}" if math.isfinite(value) else "diverged"


def _plus_minus(value: float, error: float | None, sign: str = "+") -> str:
  """``value ± error``, with a sign when ``sign`` is "+"; "diverged" for an infinite value."""
  if not math.isfinite(value):
    return "diverged"
  return f"{value:{sign}.3f} ± {error:.3f}" if error is not None else f"{value:{sign}.3f}"


def best_rate_cell(row: Row) -> str:
  """The best rate, marked where it is an edge of the grid: an unfinished sweep, or the limit reached."""
  text = f"{row.learning_rate:.1e} ({rate_name(row.exponent)})"
  if not row.at_edge:
    return text
  return f"{text}, edge: {'at the limit' if row.finished else 'sweep unfinished'}"


def seeds_of(results: dict, size: str, task: str) -> tuple[int, ...]:
  return tuple(results["protocol"]["sizes"][size][task]["seeds"])


def row_of(results: dict, size: str, task: str, name: str) -> Row | None:
  return summarize(
    runs_of(results, size, task, name),
    seeds_of(results, size, task),
    start=results["protocol"]["sizes"][size][task]["start"],
    limit=results["protocol"]["max_exponent"],
  )


def rows_of(results: dict, size: str, task: str) -> list[Row]:
  """Every optimizer's row for one task, AdamW first, then in the order they first ran."""
  names = list(dict.fromkeys(r["optimizer"] for r in runs_of(results, size, task)))
  names.sort(key=lambda n: n != BASE_OPTIMIZER)
  rows = (row_of(results, size, task, n) for n in names)
  return [row for row in rows if row is not None]


def markdown_table(rows: list[Row]) -> str:
  base = next((r for r in rows if r.optimizer == BASE_OPTIMIZER), None)
  exponents = sorted({e for r in rows for e in r.means})
  lines = [
    "| optimizer | best rate | validation loss | gap to AdamW | train loss | "
    + " | ".join(f"{rate_name(e)}" for e in exponents)
    + " | state bytes/param |",
    "|---" * (6 + len(exponents)) + "|",
  ]
  for r in rows:
    gap = _plus_minus(*gap_to(r, base)) if base else "n/a"
    lines.append(
      f"| {r.optimizer} | {best_rate_cell(r)} | {_plus_minus(r.validation_loss, r.standard_error, sign='')}"
      f" | {gap} | {_loss(r.final_train_loss)} | "
      + " | ".join(_loss(r.means[e]) if e in r.means else "" for e in exponents)
      + f" | {r.state_bytes_per_param:.3f} |"
    )
  return "\n".join(lines)


TASK_TITLES = {
  "pretrain": "Pre-training from scratch on CPython's help pages (`pydoc_topics`)",
  "finetune": "Fine-tuning AdamW's pre-trained weights on the standard library's source (`stdlib_source`)",
  "finetune_short": "Fine-tuning as the large model does, from AdamW's weights pre-trained for 500 steps"
  " (`stdlib_source`)",
}


def base_of(protocol: dict, size: str, task: str) -> tuple[str, int] | None:
  """A fine-tuning task's base: its key in the results' ``bases`` and its pre-training steps; None for pre-training.

  The size's own base (``base_pretrain_steps``) is keyed by the size, another by ``{size}_{steps}``.
  """
  setting = protocol["sizes"][size][task]
  if setting["corpus"] != FINETUNE_CORPUS:
    return None
  default = protocol["base_pretrain_steps"][size]
  steps = setting.get("base_steps") or default
  return (size if steps == default else f"{size}_{steps}"), steps


def figure_path(size: str, task: str) -> pathlib.Path:
  return FIGURES / f"convergence_{task}_{size}.png"


def render(results: dict, optimizer_names=NAMES) -> str:
  """Markdown for benchmarks/README.md: one table per size and task, with what is still missing."""
  protocol = results["protocol"]
  parts = []
  for size, tasks in protocol["sizes"].items():
    for task, setting in tasks.items():
      rows = rows_of(results, size, task)
      head = (
        f"{TASK_TITLES[task]}, {size} model ({protocol['n_params'][size]:,} parameters),"
        f" {setting['steps']} steps, {len(setting['seeds'])} seed{'s' * (len(setting['seeds']) > 1)}"
      )
      base = base_of(protocol, size, task)
      if base is not None and base[0] in results["bases"]:
        head += f" (validation loss before: {results['bases'][base[0]]['validation_loss_before']:.3f})"
      missing = [n for n in setting["optimizers"] or optimizer_names if n not in {r.optimizer for r in rows}]
      unfinished = [r.optimizer for r in rows if not r.finished]
      status = []
      if missing:
        status.append("not run yet: " + ", ".join(missing))
      if unfinished:
        status.append("sweep unfinished: " + ", ".join(unfinished))
      head += "." if not status else f". Partial ({'; '.join(status)})."
      parts.append(head)
      if rows:
        parts.append(markdown_table(rows))
        parts.append(f"![{task}, {size}](figures/{figure_path(size, task).name})")
  gaps = gap_table(results)
  if gaps:
    parts.append(gaps)
  return "\n\n".join(parts)


def gap_table(results: dict) -> str:
  """Each optimizer's gap to AdamW in every fine-tuning table, side by side; empty for fewer than two tables.

  The large model fine-tunes for 100 steps from a 500-step base, the small
  one for 300 from a 1,000-step base and, in ``finetune_short``, as the
  large one does: the columns with the same steps differ by size alone.
  A gap whose sweep (or AdamW's) is unfinished is marked.
  """
  protocol = results["protocol"]
  columns = [(s, t) for s, tasks in protocol["sizes"].items() for t in tasks if base_of(protocol, s, t) is not None]
  rows = {column: {r.optimizer: r for r in rows_of(results, *column)} for column in columns}
  columns = [c for c in columns if BASE_OPTIMIZER in rows[c]]
  if len(columns) < 2:
    return ""

  def cell(column, name):
    if name not in rows[column]:
      return ""
    row, base = rows[column][name], rows[column][BASE_OPTIMIZER]
    text = _plus_minus(*gap_to(row, base))
    return text if row.finished and base.finished else f"{text} (partial)"

  names = [n for n in dict.fromkeys(n for c in columns for n in rows[c]) if n != BASE_OPTIMIZER]
  names = [n for n in names if sum(n in rows[c] for c in columns) >= 2]
  head = [
    f"{protocol['n_params'][s] / 1e6:.2g}M parameters, {protocol['sizes'][s][t]['steps']} steps from a"
    f" {base_of(protocol, s, t)[1]}-step base"
    for s, t in columns
  ]
  lines = [
    "Gap to AdamW fine-tuning, by model size, steps and base:",
    "",
    "| optimizer | " + " | ".join(head) + " |",
    "|---" * (1 + len(columns)) + "|",
  ]
  lines += [f"| {n} | " + " | ".join(cell(c, n) for c in columns) + " |" for n in names]
  return "\n".join(lines)


def _quality_at(results: dict, optimizer: str, size: str) -> str | None:
  """The gap to AdamW fine-tuning the ``size`` model, or None until both sweeps are finished."""
  rows = {r.optimizer: r for r in rows_of(results, size, "finetune")}
  if any(name not in rows or not rows[name].finished for name in (optimizer, BASE_OPTIMIZER)):
    return None
  row = rows[optimizer]
  if optimizer == BASE_OPTIMIZER:
    return f"+0.000 (loss {row.validation_loss:.3f})"
  text = _plus_minus(*gap_to(row, rows[BASE_OPTIMIZER]))
  return f"{text} (best rate at the grid's edge)" if row.at_edge else text


def quality_cell(results: dict, optimizer: str) -> str:
  """README's "fine-tuning: validation loss vs AdamW" cell for ``optimizer``, from the results.

  The small model's gap, then each larger model's where its sweep and
  AdamW's there are finished (``; 3.3M parameters: ...``).
  """
  cell = _quality_at(results, optimizer, "small") or "not measured yet"
  for size in [s for s in results["protocol"]["sizes"] if s != "small"]:
    larger = _quality_at(results, optimizer, size)
    if larger is not None:
      cell += f"; {results['protocol']['n_params'][size] / 1e6:.1f}M parameters: {larger}"
  return cell


def plot(results: dict) -> list[pathlib.Path]:
  """Each table's loss curves at the best rates, beside state bytes per parameter."""
  written = []
  for size, tasks in results["protocol"]["sizes"].items():
    for task in tasks:
      rows = rows_of(results, size, task)
      if not rows:
        continue
      path = figure_path(size, task)
      report.plot_losses(
        path,
        [
          {
            "optimizer": r.optimizer,
            "train_losses": r.train_losses,
            "diverged_at_step": r.diverged_at_step,
            "state_bytes_per_param": r.state_bytes_per_param,
            "state_bytes": r.state_bytes,
            "adamw_state_bytes": r.adamw_state_bytes,
            "adamw_state_bytes_per_param": r.adamw_state_bytes / r.state_bytes * r.state_bytes_per_param,
          }
          for r in rows
        ],
        f"{TASK_TITLES[task].split(' (')[0]}, {size} model",
        steps_per_point=LOSSES_EVERY,
      )
      written.append(path)
  return written


def protocol_json() -> dict:
  """The protocol as stored beside the runs: a resumed sweep must run the same one."""
  sizes = tuple(SIZES)
  return {
    "sizes": {
      s: {t: json.loads(json.dumps(dataclasses.asdict(task))) for t, task in PROTOCOL[s].items()} for s in sizes
    },
    "n_params": {s: model.parameter_count(SIZES[s]) for s in sizes},
    "configs": {s: dataclasses.asdict(SIZES[s]) for s in sizes},
    "base_pretrain_steps": {s: BASE_PRETRAIN_STEPS[s] for s in sizes},
    "batch_size": BATCH_SIZE,
    "seq_len": SEQ_LEN,
    "max_exponent": MAX_EXPONENT,
    "losses_every": LOSSES_EVERY,
  }


def same_runs(stored: dict, current: dict) -> bool:
  """Whether every run of the ``stored`` protocol is a run of the ``current`` one.

  The current protocol may add tasks and optimizers to a task's list; a task
  or model config stored before one of :class:`Task`'s or the config's fields
  existed reads as its default. Anything else that differs (a size, a task's
  steps, seeds or rates) makes other runs.
  """

  def settings(task: dict) -> Task:
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in task.items()}
    return dataclasses.replace(Task(**fields), optimizers=None)

  def rest(protocol: dict) -> dict:
    configs = {s: model.TransformerConfig(**config) for s, config in protocol["configs"].items()}
    return {k: v for k, v in protocol.items() if k != "sizes"} | {"configs": configs}

  if rest(stored) != rest(current):
    return False
  return all(
    task in current["sizes"].get(size, {}) and settings(setting) == settings(current["sizes"][size][task])
    for size, tasks in stored["sizes"].items()
    for task, setting in tasks.items()
  )


def load(path: pathlib.Path) -> dict:
  """The results so far, under the current protocol; an empty set for a file that does not exist yet."""
  if not path.exists():
    return {"protocol": protocol_json(), "bases": {}, "runs": []}
  results = json.loads(path.read_text())
  if not same_runs(results["protocol"], protocol_json()):
    raise SystemExit(f"{path} holds runs of another protocol; move it away or pass another --results")
  return results | {"protocol": protocol_json()}


def merge(results: dict, other: dict) -> int:
  """Adds the runs and bases of ``other`` (another results file of the protocol) missing from ``results``.

  Sweeps run in parallel processes each write their own file (:func:`save`
  rewrites the whole file); this gathers them. Returns the number of runs
  added.
  """
  for name, base in other["bases"].items():
    before = results["bases"].setdefault(name, base)["validation_loss_before"]
    if abs(before - base["validation_loss_before"]) > 1e-3:
      raise SystemExit(f"the {name} base differs between the files: they fine-tune other weights")
  key = lambda r: (r["size"], r["task"], r["optimizer"], r["exponent"], r["seed"])  # noqa: E731
  have = {key(r) for r in results["runs"]}
  added = [r for r in other["runs"] if key(r) not in have]
  results["runs"] += added
  return len(added)


def save(path: pathlib.Path, results: dict) -> None:
  """Writes the results through a temporary file, so an interruption never leaves half a file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_suffix(".json.partial")
  partial.write_text(json.dumps(results, indent=0, allow_nan=False) + "\n")
  partial.replace(path)


def _means_of(losses: list[float], every: int) -> list[float]:
  return [round(float(np.mean(losses[i : i + every])), 4) for i in range(0, len(losses), every)]


def train_task(
  config: model.TransformerConfig, tx, task: Task, *, seed: int, params=None
) -> tuple[loop.TrainResult, loop.NonFiniteLossError | None]:
  """``tx`` trained on ``task``'s corpus for its steps, in the protocol's batches; a divergence returned, not raised.

  As :func:`memopt_tools.training.loop.train_allowing_divergence`, from
  ``params`` (a fine-tuning base) or a fresh initialisation from ``seed``.
  """
  return loop.train_allowing_divergence(
    config,
    tx,
    steps=task.steps,
    batch_size=BATCH_SIZE,
    seq_len=SEQ_LEN,
    seed=seed,
    corpus=task.corpus,
    params=params,
  )


def train_once(name: str, size: str, task: str, exponent: int, seed: int, params=None) -> dict:
  """One run's record for the results: its losses, its state's size, its time."""
  setting = PROTOCOL[size][task]
  spec = optimizers.get(name)
  peak = spec.default_learning_rate * setting.lr_scale * 3.0**exponent
  config = SIZES[size]
  options = {}
  if name == TACO_FALLBACK_AT_ADAMW_RATE:
    options["fallback_learning_rate"] = learning_rate_schedule(ADAMW_BEST_FINETUNE_RATE[size], setting.steps)
  start = time.perf_counter()
  tx = spec.build(learning_rate_schedule(peak, setting.steps), config, **options)
  # A rate that diverges loses the sweep; the other rates still run.
  result, divergence = train_task(config, tx, setting, seed=seed, params=params)
  figures = report.summary(name, result, diverged_at_step=None if divergence is None else divergence.step)
  return {
    "size": size,
    "task": task,
    "optimizer": name,
    "exponent": exponent,
    "seed": seed,
    "learning_rate": peak,
    "validation_loss": figures["validation_loss"],
    "final_train_loss": figures["final_train_loss"],
    "diverged_at_step": figures["diverged_at_step"],
    "state_bytes": figures["state_bytes"],
    "adamw_state_bytes": figures["adamw_state_bytes"],
    "n_params": figures["n_params"],
    "ms_per_step": figures["ms_per_step"],
    "seconds": round(time.perf_counter() - start, 2),
    "train_losses": _means_of(figures["train_losses"], LOSSES_EVERY),
  }


def pretrained_base(size: str, steps: int, base: dict, cache: pathlib.Path):
  """AdamW's weights for ``size`` pre-trained for ``steps`` (trained once, then read from ``cache``) and their figures.

  ``base`` is the base's record in the results (empty before it is made): a
  cached base must give the validation loss recorded there.
  """
  config = SIZES[size]
  spec = optimizers.get(BASE_OPTIMIZER)
  graphdef, template = loop.init_params(config, BASE_SEED)
  base = dict(base)
  if cache.exists():
    params = flax.serialization.from_bytes(template, cache.read_bytes())
  else:
    print(f"pre-training the {size} model's base: {BASE_OPTIMIZER}, {steps} steps", flush=True)
    start = time.perf_counter()
    params = loop.train(
      config,
      spec.build(learning_rate_schedule(spec.default_learning_rate, steps), config),
      steps=steps,
      batch_size=BATCH_SIZE,
      seq_len=SEQ_LEN,
      seed=BASE_SEED,
      corpus=PRETRAIN_CORPUS,
    ).params
    base["seconds"] = round(time.perf_counter() - start, 2)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_bytes(flax.serialization.to_bytes(params))
  before = loop.evaluate(
    graphdef, params, data.split(data.load_corpus(FINETUNE_CORPUS))[1], batch_size=BATCH_SIZE, seq_len=SEQ_LEN
  )
  # Another machine's base differs in the last bits, not more: a larger change means other weights.
  if abs(base.get("validation_loss_before", before) - before) > 1e-3:
    raise SystemExit(f"{cache} is not the base the results' fine-tuning runs started from; delete it")
  return params, base | {"validation_loss_before": base.get("validation_loss_before", before)}


def pending(results: dict, name: str, size: str, task: str) -> list[tuple[int, int]]:
  """The (exponent, seed) runs the sweep needs next: the missing seeds of the next rate, or none."""
  seeds = seeds_of(results, size, task)
  runs = runs_of(results, size, task, name)
  done = {(r["exponent"], r["seed"]) for r in runs}
  partial = sorted({r["exponent"] for r in runs} - set(complete_rates(runs, seeds)))
  means = {e: mean_validation(rs) for e, rs in complete_rates(runs, seeds).items()}
  exponent = (
    partial[0]
    if partial
    else next_exponent(
      means, start=results["protocol"]["sizes"][size][task]["start"], limit=results["protocol"]["max_exponent"]
    )
  )
  return [] if exponent is None else [(exponent, s) for s in seeds if (exponent, s) not in done]


def seconds_per_run(results: dict, name: str, size: str, task: str, pace=np.median) -> float:
  """A run's time: ``steps`` at the optimizer's time per step, plus the compiling and evaluation measured.

  The time per step is ``pace`` (np.median: as measured; np.min: an idle
  machine) of this optimizer's runs at this size; without any, AdamW's there
  times this optimizer's ratio to AdamW at another size; for a size not run
  yet, another size's, scaled by the parameter count.
  """

  def per_step(optimizer, size):
    runs = [
      r["ms_per_step"]
      for r in results["runs"]
      if r["optimizer"] == optimizer and r["size"] == size and r["ms_per_step"] is not None
    ]
    return float(pace(runs)) / 1e3 if runs else math.nan

  measured = [s for s in SIZES if math.isfinite(per_step(BASE_OPTIMIZER, s))]
  if not measured:
    return math.nan
  ratios = [per_step(name, s) / per_step(BASE_OPTIMIZER, s) for s in measured]
  ratio = next((r for r in ratios if math.isfinite(r)), 1.0)
  n_params = results["protocol"]["n_params"]
  seconds = per_step(name, size)
  if not math.isfinite(seconds):
    base = size if size in measured else measured[0]
    seconds = per_step(BASE_OPTIMIZER, base) * ratio * n_params[size] / n_params[base]
  timed = [r for r in results["runs"] if r["ms_per_step"] is not None]
  # Compiling and evaluating take longer for a larger model: this size's runs where there are any.
  timed = [r for r in timed if r["size"] == size] or timed
  overhead = [r["seconds"] - r["ms_per_step"] / 1e3 * PROTOCOL[r["size"]][r["task"]].steps for r in timed]
  return PROTOCOL[size][task].steps * seconds + float(pace(overhead))


def estimate(results: dict, names, rates_per_sweep: int = 4) -> str:
  """The full protocol's time: the runs done as measured, the rest at :func:`seconds_per_run`.

  A sweep not finished is reckoned at ``rates_per_sweep`` rates (the three
  it starts with and one more), or one more rate than it has. The last
  figure is every run, done or not, at the fastest pace measured: the
  protocol's time on an idle machine, whatever else shared the cores.
  """
  lines, done, left, idle, whole_idle = [], 0.0, 0.0, 0.0, 0.0
  for size in SIZES:
    for key, steps in sorted({base_of(results["protocol"], size, task) for task in PROTOCOL[size]} - {None}):
      base = results["bases"].get(key, {})
      done += base.get("seconds", 0.0)
      # AdamW's pre-training, reckoned as a long fine-tuning run.
      base_seconds = {
        pace: seconds_per_run(results, BASE_OPTIMIZER, size, "finetune", pace)
        * (steps / PROTOCOL[size]["finetune"].steps)
        for pace in (np.median, np.min)
      }
      whole_idle += base_seconds[np.min]
      if "seconds" not in base:
        left += base_seconds[np.median]
        idle += base_seconds[np.min]
    for task in PROTOCOL[size]:
      for name in [n for n in names if n in (PROTOCOL[size][task].optimizers or names)]:
        runs = runs_of(results, size, task, name)
        row = row_of(results, size, task, name)
        rates = len({r["exponent"] for r in runs})
        seeds = len(PROTOCOL[size][task].seeds)
        to_run = 0 if row is not None and row.finished else max(rates_per_sweep, rates + 1) * seeds - len(runs)
        seconds = to_run * seconds_per_run(results, name, size, task) if to_run else 0.0
        idle += to_run * seconds_per_run(results, name, size, task, np.min) if to_run else 0.0
        whole_idle += (len(runs) + to_run) * seconds_per_run(results, name, size, task, np.min)
        done += sum(r["seconds"] for r in runs)
        left += seconds
        lines.append(f"  {size} {task} {name}: {len(runs)} runs done, about {to_run} to go ({seconds / 60:.0f} min)")
  lines.append(
    f"done: {done / 3600:.1f} h. To go: {left / 3600:.1f} h at the median pace measured,"
    f" {idle / 3600:.1f} h at the fastest (an idle machine). The whole protocol at the fastest pace:"
    f" {whole_idle / 3600:.1f} h."
  )
  return "\n".join(lines)


def run(results: dict, path: pathlib.Path, names, sizes, tasks, cache_dir: pathlib.Path) -> None:
  """Runs every missing run of the chosen sweeps, saving the results after each."""
  started = time.perf_counter()
  count = 0
  for task in tasks:
    for size in [s for s in sizes if task in PROTOCOL[s]]:
      params = None
      if (base := base_of(results["protocol"], size, task)) is not None:
        key, steps = base
        params, results["bases"][key] = pretrained_base(
          size, steps, results["bases"].get(key, {}), cache_dir / f"convergence_base_{key}.msgpack"
        )
        save(path, results)
      for name in [n for n in names if n in (PROTOCOL[size][task].optimizers or names)]:
        while todo := pending(results, name, size, task):
          for exponent, seed in todo:
            record = train_once(name, size, task, exponent, seed, params)
            results["runs"].append(record)
            save(path, results)
            count += 1
            print(
              f"[{count}, {(time.perf_counter() - started) / 60:.1f} min] {size} {task} {name}"
              f" {rate_name(exponent)} seed {seed}: validation {_loss(validation(record))}"
              f" ({record['seconds']:.0f} s)",
              flush=True,
            )
        row = row_of(results, size, task, name)
        print(
          f"  {size} {task} {name}: best {best_rate_cell(row)}, validation {_loss(row.validation_loss)}", flush=True
        )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--optimizers", nargs="+", default=list(NAMES), choices=list(NAMES))
  parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
  tasks = list(dict.fromkeys(task for size in PROTOCOL for task in PROTOCOL[size]))
  parser.add_argument("--tasks", nargs="+", default=tasks, choices=tasks)
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the JSON results, read and extended")
  parser.add_argument(
    "--cache",
    type=pathlib.Path,
    default=pathlib.Path("results"),
    help="folder for the pre-trained bases of fine-tuning (not results: they are recomputed)",
  )
  parser.add_argument("--render", action="store_true", help="print the tables, write the plots, and exit")
  parser.add_argument("--estimate", action="store_true", help="print the full protocol's time and exit")
  parser.add_argument(
    "--merge", nargs="+", type=pathlib.Path, default=[], help="add the runs of these results files to --results, exit"
  )
  args = parser.parse_args(argv)
  results = load(args.results)
  names = [BASE_OPTIMIZER] + [n for n in args.optimizers if n != BASE_OPTIMIZER]
  if args.render:
    print(render(results))
    for path in plot(results):
      print(f"wrote {path.relative_to(ROOT)}")
    return
  if args.estimate:
    print(estimate(results, NAMES))
    return
  if args.merge:
    added = sum(merge(results, load(other)) for other in args.merge)
    save(args.results, results)
    print(f"{added} runs added to {args.results}")
    return
  run(results, args.results, names, args.sizes, args.tasks, args.cache)
  print(estimate(results, NAMES))


if __name__ == "__main__":
  main()
