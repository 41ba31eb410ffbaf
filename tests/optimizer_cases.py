"""The optimizers every generic property test runs against.

Each entry builds an alias with small block sizes so that tiny test tensors
still span several blocks. ``optax.adamw`` is a control: a property that it
fails is a broken test, not a broken optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optax


@dataclasses.dataclass(frozen=True)
class OptimizerCase:
  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict[str, Any]
  # Hyper-parameters that fix shapes: static under inject_hyperparams.
  static_args: tuple[str, ...] = ()


CASES: dict[str, OptimizerCase] = {
    "optax_adamw": OptimizerCase(optax.adamw, dict(learning_rate=1e-2)),
}
