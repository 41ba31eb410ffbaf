"""The main job: train a small Transformer on real text with a memory-lean optimizer.

``python -m optax_memopt`` trains a byte-level Llama-style model on CPython's
own help pages with the chosen optimizer, shows progress, and prints the
losses, the optimizer-state bytes next to AdamW's, and the step time. It
writes the loss curve as JSON and PNG. ``--compare`` runs several optimizers
on the same data, seed and model and writes one plot and a markdown table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import optax

from optax_memopt.training import loop, model, optimizers, report

MODEL_SIZES = {
    "tiny": model.TransformerConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64),
    "small": model.TransformerConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "base": model.TransformerConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=384),
}


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="python -m optax_memopt",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--optimizer", default="microadam", choices=sorted(optimizers.OPTIMIZERS))
  parser.add_argument("--compare", nargs="*", metavar="OPTIMIZER", default=None,
                      help="train each of these optimizers (all when none is named) and compare")
  parser.add_argument("--steps", type=int, default=4000)
  parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--learning-rate", type=float, default=None,
                      help="peak learning rate (default: each optimizer's own)")
  parser.add_argument("--corpus", default="pydoc_topics", choices=sorted(loop.data.CORPORA))
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  parser.add_argument("--quiet", action="store_true", help="no progress line")
  args = parser.parse_args(argv)
  for name in args.compare or ():
    if name not in optimizers.OPTIMIZERS:
      parser.error(f"--compare: unknown optimizer {name!r}; choose from {sorted(optimizers.OPTIMIZERS)}")
  for flag in ("steps", "batch_size", "seq_len"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1")
  if args.seq_len > MODEL_SIZES[args.model_size].max_len:
    parser.error(f"--seq-len must be <= {MODEL_SIZES[args.model_size].max_len}")
  return args


def learning_rate_schedule(peak: float, steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup_steps=max(1, steps // 20), decay_steps=steps, end_value=peak / 10
  )


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
  spec = optimizers.get(name)
  peak = args.learning_rate or spec.default_learning_rate
  optimizer = spec.build(learning_rate_schedule(peak, args.steps), config)
  result = loop.train(
      config, optimizer, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
      seed=args.seed, corpus=args.corpus,
      progress=None if args.quiet else progress_printer(name, args.steps),
  )
  return report.summary(name, result) | {"learning_rate": peak}


def print_result(row: dict) -> None:
  print(
      f"{row['optimizer']}: train loss {row['final_train_loss']:.3f}, validation loss"
      f" {row['validation_loss']:.3f}; optimizer state {row['state_bytes']:,} bytes"
      f" ({row['state_bytes_per_param']:.3f} B/param) vs AdamW {row['adamw_state_bytes']:,}"
      f" ({row['adamw_state_bytes_per_param']:.3f} B/param); {row['ms_per_step']:.1f} ms/step"
  )


def main(argv=None) -> int:
  args = parse_args(argv)
  config = MODEL_SIZES[args.model_size]
  names = args.compare if args.compare is not None else [args.optimizer]
  if args.compare is not None and not names:
    names = list(optimizers.OPTIMIZERS)
  print(
      f"JAX {jax.__version__} on {jax.default_backend()}: {args.model_size} model, {args.steps}"
      f" steps of {args.batch_size}x{args.seq_len} bytes of {args.corpus}, seed {args.seed}"
  )
  rows = []
  for name in names:
    row = run(name, args, config)
    print_result(row)
    rows.append(row)
    report.write_json(args.out / f"{name}.json", row)
    report.plot_losses(args.out / f"{name}.png", [row], f"{name} on {args.corpus}")
  if args.compare is not None:
    table = report.markdown_table(rows)
    print(table)
    (args.out / "compare.md").write_text(table + "\n")
    report.plot_losses(args.out / "compare.png", rows, f"{args.model_size} model on {args.corpus}")
    report.write_json(args.out / "compare.json", rows)
  print(f"results written to {args.out}/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
