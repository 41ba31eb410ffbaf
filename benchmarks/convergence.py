"""Does the model still learn? Pre-training and fine-tuning runs for every optimizer.

1. Pre-training: each optimizer trains the demo model from scratch on
   CPython's help pages (``pydoc_topics``).
2. Fine-tuning, the use case MicroAdam and TACO were made for: AdamW
   pre-trains the model on ``pydoc_topics`` (its default learning rate, the
   first seed), the weights are saved, then each optimizer fine-tunes them on
   a different real corpus, the Python source of standard-library modules
   (``stdlib_source``), at ``--finetune-lr-scale`` of its default rate.

Each optimizer runs at three peak learning rates (its default times 1/3, 1
and 3) and three seeds (initialisation and batches; batches only when
fine-tuning). Its row is the rate with the lowest mean validation loss over
the seeds, with the mean and spread (largest minus smallest) of that rate's
runs and the mean validation loss at every rate, so that no optimizer is
judged at a rate that happened to suit another. Seeds are shared: every
optimizer sees the same initialisations and batches.

Prints both tables with the gap to AdamW, writes ``results/convergence.json``,
``results/convergence_pretrain.png`` and ``results/convergence_finetune.png``
(the winning rate's loss curves, averaged over the seeds).

    python -m benchmarks.convergence
"""

from __future__ import annotations

import argparse
import fractions
import math
import pathlib

import flax.serialization
import numpy as np

from optax_memopt.__main__ import MODEL_SIZES, learning_rate_schedule
from optax_memopt.training import loop, optimizers, report

LR_MULTIPLIERS = (1 / 3, 1.0, 3.0)
SEEDS = (0, 1, 2)


def multiplier_name(multiplier: float) -> str:
  return f"x{fractions.Fraction(multiplier).limit_denominator(100)}"


def _validation_loss(figures: dict) -> float:
  """A run's validation loss; infinite for a run that diverged."""
  return math.inf if figures["validation_loss"] is None else figures["validation_loss"]


def _finite_or_none(value: float) -> float | None:
  """None for a diverged figure, which JSON cannot hold as a number."""
  return value if math.isfinite(value) else None


def sweep(name, config, args, *, corpus, steps, params=None, lr_scale=1.0):
  """Every (rate, seed) run of one optimizer; returns its row at the best rate and every run's figures."""
  spec = optimizers.get(name)
  runs = {}
  for multiplier in args.lr_multipliers:
    peak = spec.default_learning_rate * lr_scale * multiplier
    runs[multiplier] = []
    for seed in args.seeds:
      try:
        result = loop.train(
            config, spec.build(learning_rate_schedule(peak, steps), config), steps=steps,
            batch_size=args.batch_size, seq_len=args.seq_len, seed=seed, corpus=corpus, params=params,
        )
        figures = report.summary(name, result)
      except loop.NonFiniteLossError as error:
        # A rate that diverges loses the sweep; the other rates still run.
        figures = report.summary(name, error.result, diverged_at_step=error.step)
      runs[multiplier].append(figures | {"learning_rate": peak, "seed": seed})
      print(f"  {name} lr {peak:.2e} ({multiplier_name(multiplier)}) seed {seed}:"
            f" validation loss {_validation_loss(figures):.3f}", flush=True)
  mean_validation = {m: float(np.mean([_validation_loss(r) for r in rs])) for m, rs in runs.items()}
  best = min(args.lr_multipliers, key=lambda m: mean_validation[m])
  best_runs = runs[best]
  validation = [_validation_loss(r) for r in best_runs]
  shortest = min(len(r["train_losses"]) for r in best_runs)
  # The state's size does not depend on the rate or the seed.
  sizes = ("state_bytes", "state_bytes_per_param", "adamw_state_bytes", "adamw_state_bytes_per_param", "n_params")
  row = {key: best_runs[0][key] for key in sizes} | {
      "optimizer": name,
      "learning_rate": best_runs[0]["learning_rate"],
      "lr_multiplier": best,
      # Set only where every seed of every rate diverged.
      "diverged_at_step": min((r["diverged_at_step"] for r in best_runs if r["diverged_at_step"]), default=None)
      if not math.isfinite(mean_validation[best]) else None,
      "validation_loss": _finite_or_none(float(np.mean(validation))),
      "validation_spread": _finite_or_none(float(np.max(validation) - np.min(validation))),
      "final_train_loss": float(np.mean([math.nan if r["final_train_loss"] is None else r["final_train_loss"] for r in best_runs])),
      "validation_by_multiplier": {multiplier_name(m): _finite_or_none(v) for m, v in mean_validation.items()},
      "ms_per_step": float(np.median([r["ms_per_step"] for rs in runs.values() for r in rs if r["ms_per_step"] is not None])),
      # The winning rate's curve, averaged over the seeds, for the plot (cut
      # to the shortest run where every rate diverged).
      "train_losses": list(np.mean([r["train_losses"][:shortest] for r in best_runs], axis=0)),
  }
  for rs in runs.values():
    for r in rs:
      del r["train_losses"]
  return row, runs


def _loss(value: float | None) -> str:
  return "diverged" if value is None or not math.isfinite(value) else f"{value:.3f}"


def markdown_table(rows, multipliers) -> str:
  base = next((r for r in rows if r["optimizer"] == "adamw"), None)
  rates = [multiplier_name(m) for m in multipliers]
  lines = [
      "| optimizer | best rate | train loss | validation loss | spread | gap to AdamW | "
      + " | ".join(f"validation at {r}" for r in rates) + " | state bytes/param |",
      "|---" * (7 + len(rates)) + "|",
  ]
  for r in rows:
    gap = (f"{r['validation_loss'] - base['validation_loss']:+.3f}"
           if base and None not in (r["validation_loss"], base["validation_loss"]) else "n/a")
    lines.append(
        f"| {r['optimizer']} | {r['learning_rate']:.1e} ({multiplier_name(r['lr_multiplier'])})"
        f" | {_loss(r['final_train_loss'])} | {_loss(r['validation_loss'])} | {_loss(r['validation_spread'])} | {gap} | "
        + " | ".join(_loss(r["validation_by_multiplier"][name]) for name in rates)
        + f" | {r['state_bytes_per_param']:.3f} |"
    )
  return "\n".join(lines)


def positive_fraction(text: str) -> float:
  value = float(fractions.Fraction(text))
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be > 0; got {text}")
  return value


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--optimizers", nargs="+", default=list(optimizers.OPTIMIZERS),
                      choices=list(optimizers.OPTIMIZERS))
  parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
  parser.add_argument("--pretrain-steps", type=int, default=1000)
  parser.add_argument("--finetune-steps", type=int, default=300)
  parser.add_argument("--finetune-lr-scale", type=float, default=0.3,
                      help="fine-tuning learning rate as a fraction of each optimizer's default")
  parser.add_argument("--lr-multipliers", nargs="+", type=positive_fraction, default=list(LR_MULTIPLIERS),
                      help="peak learning rates tried, as multiples of each optimizer's default (1/3 allowed)")
  parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  args = parser.parse_args(argv)
  for flag in ("pretrain_steps", "finetune_steps", "batch_size", "seq_len"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1")
  config = MODEL_SIZES[args.model_size]
  names = ["adamw"] + [n for n in args.optimizers if n != "adamw"]
  print(f"{len(names)} optimizers x {len(args.lr_multipliers)} learning rates x {len(args.seeds)} seeds")

  print(f"pre-training on pydoc_topics, {args.pretrain_steps} steps")
  pretrain, pretrain_runs = [], {}
  for name in names:
    row, pretrain_runs[name] = sweep(name, config, args, corpus="pydoc_topics", steps=args.pretrain_steps)
    pretrain.append(row)

  # The fine-tuning starting point: AdamW at its default rate, the first seed.
  base = loop.train(
      config, optimizers.get("adamw").build(
          learning_rate_schedule(optimizers.get("adamw").default_learning_rate, args.pretrain_steps), config),
      steps=args.pretrain_steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seeds[0],
  )
  checkpoint = args.out / "pretrained_adamw.msgpack"
  checkpoint.parent.mkdir(parents=True, exist_ok=True)
  checkpoint.write_bytes(flax.serialization.to_bytes(base.params))
  pretrained = flax.serialization.from_bytes(base.params, checkpoint.read_bytes())
  before = loop.evaluate(
      loop.init_params(config, args.seeds[0])[0], pretrained,
      loop.data.split(loop.data.load_corpus("stdlib_source"))[1], batch_size=args.batch_size, seq_len=args.seq_len,
  )
  print(f"fine-tuning on stdlib_source, {args.finetune_steps} steps (validation loss before: {before:.3f})")
  finetune, finetune_runs = [], {}
  for name in names:
    row, finetune_runs[name] = sweep(name, config, args, corpus="stdlib_source", steps=args.finetune_steps,
                                     params=pretrained, lr_scale=args.finetune_lr_scale)
    finetune.append(row)

  for title, rows in (("pre-training on pydoc_topics", pretrain), ("fine-tuning on stdlib_source", finetune)):
    print(f"\n{title}\n{markdown_table(rows, args.lr_multipliers)}")
  report.plot_losses(args.out / "convergence_pretrain.png", pretrain, "pre-training on pydoc_topics")
  report.plot_losses(args.out / "convergence_finetune.png", finetune, "fine-tuning on stdlib_source")
  runs_by_rate = lambda runs: {n: {multiplier_name(m): rs for m, rs in by_rate.items()} for n, by_rate in runs.items()}
  report.write_json(args.out / "convergence.json", {
      "pretrain": pretrain, "finetune": finetune, "finetune_validation_loss_before": before,
      "pretrain_runs": runs_by_rate(pretrain_runs), "finetune_runs": runs_by_rate(finetune_runs),
      "lr_multipliers": args.lr_multipliers, "seeds": args.seeds,
  })


if __name__ == "__main__":
  main()
