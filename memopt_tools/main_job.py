"""The main job: how close to AdamW does a memory-lean optimizer train, for how much memory?

``python -m optax_memopt`` trains a byte-level Llama-style model on CPython's
own help pages twice, with AdamW and with MicroAdam, on the same data, seed
and model; shows progress; and prints each run's losses, its optimizer-state
bytes next to AdamW's, its step time, and a table with the validation loss's
gap to AdamW. ``--optimizer`` trains one optimizer alone, ``--compare`` any
several. Each invocation writes its results (JSON, markdown table, loss-curve
plot) into a folder of its own under ``--out``, named after what it trained.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import pathlib
import sys
import time

import jax
import optax

from memopt_tools.training import loop, model, optimizers, report
from optax_memopt.hyperparameters import check_int

MODEL_SIZES = model.MODEL_SIZES
DEFAULT_OPTIMIZER = "microadam"
# What a run with neither --optimizer nor --compare trains: the baseline and one compressed optimizer.
DEFAULT_RUN = (report.BASELINE, DEFAULT_OPTIMIZER)
RESULTS_JSON, RESULTS_TABLE, RESULTS_PLOT = "results.json", "results.md", "losses.png"


def learning_rate_schedule(peak: float, steps: int) -> optax.Schedule:
  """Linear warm-up from 0 over the first 5% of ``steps``, then cosine decay to ``peak / 10``.

  Args:
    peak: the largest learning rate, a finite number ``>= 0`` (0 keeps the
      parameters where they are); a negative one would climb the loss, so it
      is refused here rather than inside the optimizer, which cannot check a
      schedule.
    steps: the length of the run, ``>= 1``.

  Returns:
    An ``optax.Schedule`` from the step count to the learning rate.
  """
  if isinstance(peak, bool) or not isinstance(peak, numbers.Real) or not (math.isfinite(peak) and peak >= 0):
    raise ValueError(f"peak learning rate must be a finite number >= 0; got {peak!r}.")
  steps = check_int("steps", steps, 1)
  warmup_steps = max(1, steps // 20)
  return optax.warmup_cosine_decay_schedule(
    0.0,
    peak,
    warmup_steps=warmup_steps,
    decay_steps=max(steps, warmup_steps + 1),
    end_value=peak / 10,
  )


def _learning_rate(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text!r}")
  return value


def _int_at_least(low: int):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = low - 1
    if value < low:
      raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {text!r}")
    return value

  return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Appends each default, except where the help text already says what happens by default."""

  def _get_help_string(self, action):
    if action.default is None or action.default is False:
      return action.help
    return super()._get_help_string(action)


def _epilog() -> str:
  width = max(map(len, optimizers.OPTIMIZERS))
  lines = ["optimizers, with the peak learning rate each uses by default:"]
  for name, spec in optimizers.OPTIMIZERS.items():
    lines.append(f"  {name:<{width}}  {spec.default_learning_rate:<6g}  {spec.summary}")
  lines += [
    "",
    "The learning rate warms up linearly from 0 over the first 5% of the steps,",
    "then decays as a cosine to a tenth of its peak.",
    "",
    "A run whose loss becomes NaN or infinite stops there and says at which step;",
    "under --compare the other optimizers still train, and the run exits with",
    "status 1 after writing every result, the diverged runs marked.",
    "",
    "How long a run takes depends on the machine: the progress line shows the pace",
    "and the time left, and the run ends by saying how long --compare of every",
    "optimizer would take at that pace.",
  ]
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m optax_memopt",
    description=__doc__.split("\n\n")[0],
    epilog=_epilog(),
    formatter_class=_HelpFormatter,
  )
  which = parser.add_mutually_exclusive_group()
  which.add_argument(
    "--optimizer",
    choices=list(optimizers.OPTIMIZERS),
    default=None,
    help=f"train this optimizer alone (default: neither this nor --compare: {' and '.join(DEFAULT_RUN)}, compared)",
  )
  which.add_argument(
    "--compare",
    nargs="*",
    metavar="OPTIMIZER",
    default=None,
    help="train each of these optimizers in turn and compare them"
    f" (all {len(optimizers.OPTIMIZERS)} when none is named)",
  )
  parser.add_argument("--steps", type=_int_at_least(1), default=2000, help="training steps per optimizer")
  sizes = ", ".join(f"{name} {model.parameter_count(c):,}" for name, c in MODEL_SIZES.items())
  parser.add_argument(
    "--model-size", default="small", choices=list(MODEL_SIZES), help=f"the Transformer's size (parameters: {sizes})"
  )
  parser.add_argument("--batch-size", type=_int_at_least(1), default=16, help="sequences per step")
  parser.add_argument(
    "--seq-len",
    type=_int_at_least(1),
    default=64,
    help=f"bytes per sequence (at most the model's max_len, {min(c.max_len for c in MODEL_SIZES.values())})",
  )
  parser.add_argument(
    "--seed", type=_int_at_least(0), default=0, help="initialisation and batches; the same for every optimizer"
  )
  parser.add_argument(
    "--learning-rate",
    type=_learning_rate,
    default=None,
    help="peak learning rate, a finite number >= 0 (default: each optimizer's own, listed below)",
  )
  parser.add_argument(
    "--corpus",
    default="pydoc_topics",
    choices=sorted(loop.data.CORPORA),
    help="the text to train on, shipped with Python",
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("results"),
    help="each run writes its JSON, markdown and PNG results into a folder of its"
    " own in this one, named after the optimizers it trains (created if missing)",
  )
  parser.add_argument("--quiet", action="store_true", help="no progress line")
  return parser


def parse_args(argv):
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.compare is not None:
    for name in args.compare:
      if name not in optimizers.OPTIMIZERS:
        parser.error(f"--compare: unknown optimizer {name!r}; choose from {list(optimizers.OPTIMIZERS)}")
      if args.compare.count(name) > 1:
        parser.error(f"--compare: {name} is named more than once")
  if args.seq_len > MODEL_SIZES[args.model_size].max_len:
    parser.error(f"--seq-len must be <= {MODEL_SIZES[args.model_size].max_len}; got {args.seq_len}")
  _prepare_output_folder(parser, args.out)
  return args


def _prepare_output_folder(parser: argparse.ArgumentParser, out: pathlib.Path) -> None:
  """Creates ``out`` now, so that a run is not lost for want of a place to write it."""
  if out.exists() and not out.is_dir():
    parser.error(f"--out {out} is a file; name a folder (it is created if missing)")
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    parser.error(f"--out: cannot create the folder {out}: {error.strerror}")
  if not os.access(out, os.W_OK | os.X_OK):
    parser.error(f"--out: cannot write into the folder {out}")


def run_folder(out: pathlib.Path, names: list[str]) -> pathlib.Path:
  """Where a run of ``names`` writes: its own folder, so that no run overwrites another's results."""
  if sorted(names) == sorted(optimizers.OPTIMIZERS):
    return out / "all-optimizers"
  return out / "-vs-".join(names)


def _duration(seconds: float) -> str:
  return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def progress_printer(name: str, steps: int):
  def show(step: int, loss: float, steps_per_second: float) -> None:
    done = int(30 * step / steps)
    left = f"  {_duration((steps - step) / steps_per_second)} left" if steps_per_second > 0 else ""
    sys.stderr.write(
      f"\r{name:>12} [{'#' * done}{'.' * (30 - done)}] {step}/{steps}"
      f"  loss {loss:.3f}  {steps_per_second:.1f} steps/s{left}\x1b[K"
    )
    if step == steps:
      sys.stderr.write("\n")
    sys.stderr.flush()

  return show


def run(name: str, args, config: model.TransformerConfig) -> dict:
  """Trains ``name`` as ``args`` say; a run that diverges gives a row with ``diverged_at_step``."""
  spec = optimizers.get(name)
  peak = spec.default_learning_rate if args.learning_rate is None else args.learning_rate
  optimizer = spec.build(learning_rate_schedule(peak, args.steps), config)
  started = time.perf_counter()
  result, divergence = loop.train_allowing_divergence(
    config,
    optimizer,
    steps=args.steps,
    batch_size=args.batch_size,
    seq_len=args.seq_len,
    seed=args.seed,
    corpus=args.corpus,
    progress=None if args.quiet else progress_printer(name, args.steps),
  )
  if divergence is not None:
    if not args.quiet:
      sys.stderr.write("\n")
    print(f"error: {name}: {divergence} (peak learning rate {peak:g}); try a smaller --learning-rate", file=sys.stderr)
  row = report.summary(name, result, diverged_at_step=None if divergence is None else divergence.step)
  return row | {"learning_rate": peak, "seconds": time.perf_counter() - started}


def print_result(row: dict) -> None:
  if row["diverged_at_step"] is not None:
    print(f"{row['optimizer']}: diverged at step {row['diverged_at_step']}", flush=True)
    return
  print(
    f"{row['optimizer']}: train loss {row['final_train_loss']:.3f} (mean of the last 20 steps),"
    f" validation loss {row['validation_loss']:.3f}; optimizer state {row['state_bytes']:,}"
    f" bytes = {row['state_bytes_per_param']:.3f} B/param"
    + (
      ""
      if row["optimizer"] == report.BASELINE
      else f", {row['adamw_state_bytes'] / row['state_bytes']:.1f}x less than AdamW's"
      f" {row['adamw_state_bytes_per_param']:.3f}"
    )
    + f"; {report.milliseconds(row['ms_per_step'])} ms/step",
    flush=True,
  )


def run_title(row: dict, args) -> str:
  """The single-run plot's title: what was trained, and its state next to AdamW's."""
  title = (
    f"{row['optimizer']} on {args.corpus}, {args.model_size} model"
    f" ({row['n_params']:,} parameters): state {row['state_bytes_per_param']:.2f} B/param"
  )
  if row["optimizer"] != report.BASELINE:
    title += (
      f", {row['adamw_state_bytes'] / row['state_bytes']:.1f}x less than"
      f" AdamW's {row['adamw_state_bytes_per_param']:.2f}"
    )
  return title


def main(argv=None) -> int:
  args = parse_args(argv)
  config = MODEL_SIZES[args.model_size]
  if args.optimizer is not None:
    names = [args.optimizer]
  elif args.compare is not None:
    names = args.compare or list(optimizers.OPTIMIZERS)
  else:
    names = list(DEFAULT_RUN)
  folder = run_folder(args.out, names)
  print(
    f"JAX {jax.__version__} on {jax.default_backend()}: {args.model_size} model"
    f" ({model.parameter_count(config):,} parameters), {args.steps} steps of"
    f" {args.batch_size}x{args.seq_len} bytes of {args.corpus}, seed {args.seed}:"
    f" {', '.join(names)}"
  )
  if (folder / RESULTS_JSON).exists():
    print(f"replacing the results of an earlier run in {folder}/")
  rows = []
  for name in names:
    row = run(name, args, config)
    print_result(row)
    rows.append(row)
    report.write_json(folder / RESULTS_JSON, rows)  # After each run: an interrupted comparison keeps what it did.
  if len(rows) > 1:
    table = report.markdown_table(rows)
    print(table)
    title = f"{args.model_size} model ({rows[0]['n_params']:,} parameters) on {args.corpus}, {args.steps} steps"
  else:
    table = report.markdown_table(rows, baseline=None)
    title = run_title(rows[0], args)
  (folder / RESULTS_TABLE).write_text(table + "\n")
  report.plot_losses(folder / RESULTS_PLOT, rows, title)
  print(f"results written to {folder}/ ({RESULTS_JSON}, {RESULTS_TABLE}, {RESULTS_PLOT})")
  print(next_steps(names, rows))
  diverged = [r["optimizer"] for r in rows if r["diverged_at_step"] is not None]
  if diverged:
    print(f"error: {len(diverged)} of {len(rows)} runs diverged: {', '.join(diverged)}", file=sys.stderr)
    return 1
  return 0


def next_steps(names: list[str], rows: list[dict]) -> str:
  """What to run next, with how long training every optimizer would take at this run's measured pace."""
  every = len(optimizers.OPTIMIZERS)
  pace = sum(r["seconds"] for r in rows) / len(rows)
  compare_all = f"--compare alone trains all {every} (about {_duration(every * pace)} at this run's pace)"
  if report.BASELINE not in names:
    return (
      f"How close to AdamW does it train? python -m optax_memopt --compare {report.BASELINE}"
      f" {' '.join(names)} (and this run's options); {compare_all}."
    )
  return f"Next: python -m optax_memopt --compare NAME ... trains the optimizers you name; {compare_all}."


if __name__ == "__main__":
  sys.exit(main())
