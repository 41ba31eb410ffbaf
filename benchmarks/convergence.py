"""Does the model still learn? Pre-training and fine-tuning runs for every optimizer.

1. Pre-training: each optimizer trains the demo model from scratch on
   CPython's help pages (``pydoc_topics``), same seed and batches.
2. Fine-tuning, the use case MicroAdam and TACO were made for: AdamW
   pre-trains the model on ``pydoc_topics``, the weights are saved, then each
   optimizer fine-tunes them on a different real corpus, the Python source of
   standard-library modules (``stdlib_source``).

Prints both tables with the gap to AdamW, writes ``results/convergence.json``,
``results/convergence_pretrain.png`` and ``results/convergence_finetune.png``.

    python -m benchmarks.convergence
"""

from __future__ import annotations

import argparse
import pathlib

import flax.serialization

from optax_memopt.__main__ import MODEL_SIZES, learning_rate_schedule
from optax_memopt.training import loop, optimizers, report


def train_all(names, config, args, *, corpus, steps, params=None, lr_scale=1.0):
  rows, results = [], []
  for name in names:
    spec = optimizers.get(name)
    peak = spec.default_learning_rate * lr_scale
    result = loop.train(
        config, spec.build(learning_rate_schedule(peak, steps), config), steps=steps,
        batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, corpus=corpus, params=params,
    )
    rows.append(report.summary(name, result) | {"learning_rate": peak})
    results.append(result)
    print(f"  {name}: validation loss {result.validation_loss:.3f}", flush=True)
  return rows, results


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--optimizers", nargs="+", default=list(optimizers.OPTIMIZERS))
  parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
  parser.add_argument("--pretrain-steps", type=int, default=1000)
  parser.add_argument("--finetune-steps", type=int, default=300)
  parser.add_argument("--finetune-lr-scale", type=float, default=0.3,
                      help="fine-tuning learning rate as a fraction of each optimizer's default")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  args = parser.parse_args(argv)
  config = MODEL_SIZES[args.model_size]
  names = ["adamw"] + [n for n in args.optimizers if n != "adamw"]

  print(f"pre-training on pydoc_topics, {args.pretrain_steps} steps")
  pretrain, results = train_all(names, config, args, corpus="pydoc_topics", steps=args.pretrain_steps)

  base = results[names.index("adamw")]
  checkpoint = args.out / "pretrained_adamw.msgpack"
  checkpoint.parent.mkdir(parents=True, exist_ok=True)
  checkpoint.write_bytes(flax.serialization.to_bytes(base.params))
  pretrained = flax.serialization.from_bytes(base.params, checkpoint.read_bytes())
  before = loop.evaluate(
      loop.init_params(config, args.seed)[0], pretrained,
      loop.data.split(loop.data.load_corpus("stdlib_source"))[1], batch_size=args.batch_size, seq_len=args.seq_len,
  )
  print(f"fine-tuning on stdlib_source, {args.finetune_steps} steps (validation loss before: {before:.3f})")
  finetune, _ = train_all(names, config, args, corpus="stdlib_source", steps=args.finetune_steps,
                       params=pretrained, lr_scale=args.finetune_lr_scale)

  for title, rows in (("pre-training on pydoc_topics", pretrain), ("fine-tuning on stdlib_source", finetune)):
    print(f"\n{title}\n{report.markdown_table(rows)}")
  report.plot_losses(args.out / "convergence_pretrain.png", pretrain, "pre-training on pydoc_topics")
  report.plot_losses(args.out / "convergence_finetune.png", finetune, "fine-tuning on stdlib_source")
  report.write_json(args.out / "convergence.json",
                    {"pretrain": pretrain, "finetune": finetune, "finetune_validation_loss_before": before})


if __name__ == "__main__":
  main()
