"""The optimizers the main job and the benchmarks compare.

Each entry builds a full optimizer (direction, weight decay, learning rate)
from a learning rate and the model's config (Adam-mini needs the head counts
to cut fused query and key kernels into heads); ``default_learning_rate`` is
the one the main job uses
on its small Transformer, tuned per method because their steps differ in
scale (TACO's is a signed, dimension-normalized step, not Adam's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optax

import optax_memopt

WEIGHT_DECAY = 0.01


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  # build(learning_rate, config: training.model.TransformerConfig), plus implementation=None
  # where has_kernels.
  build: Callable[..., optax.GradientTransformation]
  default_learning_rate: float
  summary: str
  has_kernels: bool = False


def _with_kernels(alias: Callable[..., optax.GradientTransformation], **options) -> Callable[..., Any]:
  """``build`` for one of our aliases that takes ``implementation=``, with the shared weight decay."""
  return lambda lr, config, implementation=None: alias(
      lr, weight_decay=WEIGHT_DECAY, implementation=implementation, **options
  )


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(
        lambda lr, config: optax.adamw(lr, weight_decay=WEIGHT_DECAY),
        3e-3,
        "optax.adamw, fp32 m and v: the baseline",
    ),
    "adamw_bf16": OptimizerSpec(
        lambda lr, config: optax.adamw(lr, weight_decay=WEIGHT_DECAY, mu_dtype="bfloat16"),
        3e-3,
        "optax.adamw with a bf16 first moment",
    ),
    "adafactor": OptimizerSpec(
        # optax.adafactor's weight_decay_rate is not scaled by the learning
        # rate and makes this model diverge; it runs without decay, as usual.
        lambda lr, config: optax.adafactor(lr),
        1e-2,
        "optax.adafactor: factored second moment, no first moment",
    ),
    "microadam": OptimizerSpec(
        _with_kernels(optax_memopt.microadam),
        3e-3,
        "MicroAdam: window of 10 top-1% sparse gradients plus 4-bit error feedback",
        has_kernels=True,
    ),
    "adam_mini": OptimizerSpec(
        lambda lr, config: optax_memopt.adam_mini(
            lr, weight_decay=WEIGHT_DECAY, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads
        ),
        3e-3,
        "Adam-mini: one second moment per head, neuron or token",
    ),
    "ternary_adam": OptimizerSpec(
        lambda lr, config: optax_memopt.ternary_adam(lr, weight_decay=WEIGHT_DECAY),
        3e-3,
        "ternary-state Adam: base-3 trits with block scales for m, factored v",
    ),
    "taco": OptimizerSpec(
        _with_kernels(optax_memopt.taco),
        1e-2,
        "TACO: signed argmax per input feature, one fp8 heavy hitter in each of 16 parts of a row; Adam on vectors and embeddings",
        has_kernels=True,
    ),
    "taco_one_segment": OptimizerSpec(
        _with_kernels(optax_memopt.taco, segments=1),
        1e-2,
        "TACO keeping each row's 16 largest momenta wherever they are (segments=1): a per-row top-k",
        has_kernels=True,
    ),
    "adamw_8bit": OptimizerSpec(
        lambda lr, config: optax_memopt.adamw_8bit(lr, weight_decay=WEIGHT_DECAY),
        3e-3,
        "8-bit AdamW (bitsandbytes/torchao): dynamic-map codes of m and v, absmax per 256",
    ),
    "adamw_4bit": OptimizerSpec(
        lambda lr, config: optax_memopt.adamw_4bit(lr, weight_decay=WEIGHT_DECAY),
        3e-3,
        "4-bit AdamW (torchao): dynamic map for m, linear map without zero for v, absmax per 128",
    ),
    "adamw_fp8": OptimizerSpec(
        lambda lr, config: optax_memopt.adamw_fp8(lr, weight_decay=WEIGHT_DECAY),
        3e-3,
        "fp8 AdamW (torchao): float8 e4m3fn m and v, absmax / 448 per 256",
    ),
}


def get(name: str) -> OptimizerSpec:
  if name not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {name!r}.")
  return OPTIMIZERS[name]
