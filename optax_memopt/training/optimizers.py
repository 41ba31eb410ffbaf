"""The optimizers the main job, the benchmarks and the notebook compare.

Each entry builds a full optimizer (direction, weight decay, learning rate)
from a learning rate; ``default_learning_rate`` is the one the main job uses
on its small Transformer, tuned per method because their steps differ in
scale (TACO's is a signed, dimension-normalized step, not Adam's).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import optax

import optax_memopt

WEIGHT_DECAY = 0.01


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  build: Callable[[optax.ScalarOrSchedule], optax.GradientTransformation]
  default_learning_rate: float
  summary: str
  ours: bool = True


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(
        lambda lr: optax.adamw(lr, weight_decay=WEIGHT_DECAY),
        3e-3,
        "optax.adamw, fp32 m and v: the baseline",
        ours=False,
    ),
    "adamw_bf16": OptimizerSpec(
        lambda lr: optax.adamw(lr, weight_decay=WEIGHT_DECAY, mu_dtype="bfloat16"),
        3e-3,
        "optax.adamw with a bf16 first moment",
        ours=False,
    ),
    "adafactor": OptimizerSpec(
        # optax.adafactor's weight_decay_rate is not scaled by the learning
        # rate and makes this model diverge; it runs without decay, as usual.
        lambda lr: optax.adafactor(lr),
        1e-2,
        "optax.adafactor: factored second moment, no first moment",
        ours=False,
    ),
}


def get(name: str) -> OptimizerSpec:
  if name not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {name!r}.")
  return OPTIMIZERS[name]
