"""The main job: train a small Transformer on real text with a memory-lean optimizer.

``python -m optax_memopt`` trains a byte-level Llama-style model on CPython's
own help pages with the chosen optimizer, shows progress, and prints the
losses, the optimizer-state bytes next to AdamW's, and the step time. It
writes the loss curve as JSON and PNG. ``--compare`` runs several optimizers
on the same data, seed and model and writes one plot and a markdown table.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import pathlib
import sys

import jax
import optax

from optax_memopt.hyperparameters import check_int
from optax_memopt.training import loop, model, optimizers, report

MODEL_SIZES = {
    "tiny": model.TransformerConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64),
    "small": model.TransformerConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "base": model.TransformerConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=384),
}
DEFAULT_OPTIMIZER = "microadam"

# Wall-clock times of the defaults on 2 CPU cores, rounded: 4000 steps at the
# 14-21 ms per step that `python -m benchmarks.convergence` measures for each
# optimizer on this model and batch (benchmarks/README.md), plus compiling.
DEFAULT_RUN_TIME = (
    "On 2 CPU cores the defaults take about 1.5 minutes for one run (4000 steps of\n"
    "14-21 ms, plus compiling), and about as long per optimizer for --compare with\n"
    f"no names ({len(optimizers.OPTIMIZERS)} optimizers, about {round(1.5 * len(optimizers.OPTIMIZERS))} minutes). For a first look:\n"
    "  python -m optax_memopt --compare adamw microadam --model-size tiny --steps 300"
)


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
  if isinstance(peak, bool) or not isinstance(peak, numbers.Real) or not (
      math.isfinite(peak) and peak >= 0
  ):
    raise ValueError(f"peak learning rate must be a finite number >= 0; got {peak!r}.")
  steps = check_int("steps", steps, 1)
  warmup_steps = max(1, steps // 20)
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup_steps=warmup_steps, decay_steps=max(steps, warmup_steps + 1),
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
      DEFAULT_RUN_TIME,
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
  which.add_argument("--optimizer", choices=list(optimizers.OPTIMIZERS), default=None,
                     help=f"the optimizer to train with (default: {DEFAULT_OPTIMIZER})")
  which.add_argument("--compare", nargs="*", metavar="OPTIMIZER", default=None,
                     help="train each of these optimizers in turn and compare them"
                          f" (all {len(optimizers.OPTIMIZERS)} when none is named)")
  parser.add_argument("--steps", type=_int_at_least(1), default=4000, help="training steps")
  sizes = ", ".join(f"{name} {model.parameter_count(c):,}" for name, c in MODEL_SIZES.items())
  parser.add_argument("--model-size", default="small", choices=list(MODEL_SIZES),
                      help=f"the Transformer's size (parameters: {sizes})")
  parser.add_argument("--batch-size", type=_int_at_least(1), default=16, help="sequences per step")
  parser.add_argument("--seq-len", type=_int_at_least(1), default=64,
                      help="bytes per sequence (at most the model's max_len,"
                           f" {min(c.max_len for c in MODEL_SIZES.values())})")
  parser.add_argument("--seed", type=_int_at_least(0), default=0,
                      help="initialisation and batches; the same for every optimizer")
  parser.add_argument("--learning-rate", type=_learning_rate, default=None,
                      help="peak learning rate, a finite number >= 0 (default: each"
                           " optimizer's own, listed below)")
  parser.add_argument("--corpus", default="pydoc_topics", choices=sorted(loop.data.CORPORA),
                      help="the text to train on, shipped with Python")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"),
                      help="folder for the JSON, PNG and markdown results (created if missing)")
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


def progress_printer(name: str, steps: int):
  def show(step: int, loss: float, steps_per_second: float) -> None:
    done = int(30 * step / steps)
    sys.stderr.write(
        f"\r{name:>12} [{'#' * done}{'.' * (30 - done)}] {step}/{steps}"
        f"  loss {loss:.3f}  {steps_per_second:.1f} steps/s"
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
  try:
    result = loop.train(
        config, optimizer, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        seed=args.seed, corpus=args.corpus,
        progress=None if args.quiet else progress_printer(name, args.steps),
    )
  except loop.NonFiniteLossError as error:
    if not args.quiet:
      sys.stderr.write("\n")
    print(f"error: {name}: {error} (peak learning rate {peak:g}); try a smaller --learning-rate",
          file=sys.stderr)
    return report.summary(name, error.result, diverged_at_step=error.step) | {"learning_rate": peak}
  return report.summary(name, result) | {"learning_rate": peak}


def print_result(row: dict) -> None:
  if row["diverged_at_step"] is not None:
    print(f"{row['optimizer']}: diverged at step {row['diverged_at_step']}", flush=True)
    return
  print(
      f"{row['optimizer']}: train loss {row['final_train_loss']:.3f} (mean of the last 20 steps),"
      f" validation loss {row['validation_loss']:.3f}; optimizer state {row['state_bytes']:,}"
      f" bytes = {row['state_bytes_per_param']:.3f} B/param"
      + ("" if row["optimizer"] == report.BASELINE else
         f", {row['adamw_state_bytes'] / row['state_bytes']:.1f}x less than AdamW's"
         f" {row['adamw_state_bytes_per_param']:.3f}")
      + f"; {report.milliseconds(row['ms_per_step'])} ms/step", flush=True,
  )


def run_title(row: dict, args) -> str:
  """The single-run plot's title: what was trained, and its state next to AdamW's."""
  title = (f"{row['optimizer']} on {args.corpus}, {args.model_size} model"
           f" ({row['n_params']:,} parameters): state {row['state_bytes_per_param']:.2f} B/param")
  if row["optimizer"] != report.BASELINE:
    title += (f", {row['adamw_state_bytes'] / row['state_bytes']:.1f}x less than"
              f" AdamW's {row['adamw_state_bytes_per_param']:.2f}")
  return title


def main(argv=None) -> int:
  args = parse_args(argv)
  config = MODEL_SIZES[args.model_size]
  if args.compare is None:
    names = [args.optimizer or DEFAULT_OPTIMIZER]
  else:
    names = args.compare or list(optimizers.OPTIMIZERS)
  print(
      f"JAX {jax.__version__} on {jax.default_backend()}: {args.model_size} model"
      f" ({model.parameter_count(config):,} parameters), {args.steps} steps of"
      f" {args.batch_size}x{args.seq_len} bytes of {args.corpus}, seed {args.seed}"
  )
  rows = []
  for name in names:
    row = run(name, args, config)
    print_result(row)
    rows.append(row)
    report.write_json(args.out / f"{name}.json", row)
    # AdamW's curve for reference when this invocation has already trained it.
    reference = [r for r in rows if r["optimizer"] == report.BASELINE and r is not row]
    report.plot_losses(args.out / f"{name}.png", [row] + reference, run_title(row, args))
  if args.compare is not None:
    table = report.markdown_table(rows)
    print(table)
    (args.out / "compare.md").write_text(table + "\n")
    report.plot_losses(
        args.out / "compare.png", rows,
        f"{args.model_size} model ({rows[0]['n_params']:,} parameters) on {args.corpus},"
        f" {args.steps} steps",
    )
    report.write_json(args.out / "compare.json", rows)
  print(f"results written to {args.out}/")
  diverged = [r["optimizer"] for r in rows if r["diverged_at_step"] is not None]
  if diverged:
    print(f"error: {len(diverged)} of {len(rows)} runs diverged: {', '.join(diverged)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
