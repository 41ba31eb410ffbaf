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
import warnings
from typing import Any, Callable, Sequence

import optax

import optax_memopt
from optax_memopt import vocabulary

WEIGHT_DECAY = 0.01


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  # build(learning_rate, config: training.model.TransformerConfig), plus implementation=None
  # where has_kernels.
  build: Callable[..., optax.GradientTransformation]
  default_learning_rate: float
  summary: str
  has_kernels: bool = False


def _with_weight_decay(alias: Callable[..., optax.GradientTransformation], **options) -> Callable[..., Any]:
  """``build`` for an alias at the shared weight decay, with ``options``; the model's config is not read."""
  return lambda lr, config: alias(lr, weight_decay=WEIGHT_DECAY, **options)


def _with_kernels(alias: Callable[..., optax.GradientTransformation], **options) -> Callable[..., Any]:
  """``build`` for one of our aliases that takes ``implementation=``, with the shared weight decay."""
  return lambda lr, config, implementation=None: alias(
    lr, weight_decay=WEIGHT_DECAY, implementation=implementation, **options
  )


OPTIMIZERS: dict[str, OptimizerSpec] = {
  "adamw": OptimizerSpec(
    _with_weight_decay(optax.adamw),
    3e-3,
    "optax.adamw, fp32 m and v: the baseline",
  ),
  "adamw_bf16": OptimizerSpec(
    _with_weight_decay(optax.adamw, mu_dtype="bfloat16"),
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
    _with_weight_decay(optax_memopt.ternary_adam),
    3e-3,
    "ternary-state Adam: base-3 trits with block scales for m, factored v",
  ),
  "taco": OptimizerSpec(
    _with_weight_decay(optax_memopt.taco),
    1e-2,
    "TACO: signed argmax per input feature, one fp8 heavy hitter in each of 16 parts of a row;"
    " Adam on vectors and embeddings",
  ),
  "taco_one_segment": OptimizerSpec(
    _with_weight_decay(optax_memopt.taco, segments=1),
    1e-2,
    "TACO keeping each row's 16 largest momenta wherever they are (segments=1): a per-row top-k",
  ),
  "adamw_8bit": OptimizerSpec(
    _with_weight_decay(optax_memopt.adamw_8bit),
    3e-3,
    "8-bit AdamW (bitsandbytes/torchao): dynamic-map codes of m and v, absmax per 256",
  ),
  "adamw_4bit": OptimizerSpec(
    _with_weight_decay(optax_memopt.adamw_4bit),
    3e-3,
    "4-bit AdamW (torchao): dynamic map for m, linear map without zero for v, absmax per 128",
  ),
  "adamw_fp8": OptimizerSpec(
    _with_weight_decay(optax_memopt.adamw_fp8),
    3e-3,
    "fp8 AdamW (torchao): float8 e4m3fn m and v, absmax / 448 per 256",
  ),
  "galore": OptimizerSpec(
    # optax's, not ours, at its defaults (rank 128, a new projection every 200 steps, Adam inside).
    _with_weight_decay(optax.contrib.galore),
    3e-3,
    "optax.contrib.galore (optax's): Adam on each matrix's gradient projected on its top 128 singular vectors,"
    " an SVD every 200 steps",
  ),
}


def __getattr__(name: str) -> Any:
  # The remedy moved to the library (optax_memopt.vocabulary); the old names still import, with a warning.
  if name in ("vocabulary_in_float32", "VOCABULARY_NAMES"):
    warnings.warn(
      f"memopt_tools.training.optimizers.{name} is deprecated; use optax_memopt.vocabulary.{name}"
      " (vocabulary_in_float32 is also optax_memopt.vocabulary_in_float32).",
      DeprecationWarning,
      stacklevel=2,
    )
    return getattr(vocabulary, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _vocabulary_in_float32(
  alias: Callable[..., optax.GradientTransformation], names: tuple[str, ...] = vocabulary.VOCABULARY_NAMES
) -> Callable[..., Any]:
  """``build`` for a low-bit AdamW whose parameters named in ``names`` keep ``optax.adamw``'s float32 state."""
  return lambda lr, config: optax.partition(
    {
      "quantized": alias(lr, weight_decay=WEIGHT_DECAY),
      "float32": optax.adamw(lr, weight_decay=WEIGHT_DECAY),
    },
    lambda params: vocabulary.vocabulary_in_float32(params, names),
  )


# Settings the convergence benchmark compares beside the entries above, kept out
# of OPTIMIZERS (and so out of the main job's and fit's lists).
VARIANTS: dict[str, OptimizerSpec] = {
  "adamw_8bit_vocab_fp32": OptimizerSpec(
    _vocabulary_in_float32(optax_memopt.adamw_8bit),
    3e-3,
    "8-bit AdamW with the embedding and output head in float32 AdamW state (vocabulary_in_float32)",
  ),
  # Which of the two vocabulary tensors the 8-bit codes fail on: the head alone, the embedding alone.
  "adamw_8bit_head_fp32": OptimizerSpec(
    _vocabulary_in_float32(optax_memopt.adamw_8bit, ("lm_head",)),
    3e-3,
    "8-bit AdamW with only the output head in float32 AdamW state",
  ),
  "adamw_8bit_embed_fp32": OptimizerSpec(
    _vocabulary_in_float32(optax_memopt.adamw_8bit, ("embed",)),
    3e-3,
    "8-bit AdamW with only the embedding in float32 AdamW state",
  ),
  "adamw_fp8_vocab_fp32": OptimizerSpec(
    _vocabulary_in_float32(optax_memopt.adamw_fp8),
    3e-3,
    "fp8 AdamW with the embedding and output head in float32 AdamW state (vocabulary_in_float32)",
  ),
  # benchmarks/convergence.py passes the fallback's rate: AdamW's best, not TACO's.
  "taco_fallback_adamw_rate": OptimizerSpec(
    lambda lr, config, fallback_learning_rate=None: optax_memopt.taco(
      lr, weight_decay=WEIGHT_DECAY, fallback_learning_rate=fallback_learning_rate
    ),
    1e-2,
    "TACO with its fallback group (Adam on embeddings, norms, vectors) at its own rate (fallback_learning_rate)",
  ),
  "microadam_5pct": OptimizerSpec(
    _with_kernels(optax_memopt.microadam, density=0.05),
    3e-3,
    "MicroAdam keeping the top 5% of each block (density=0.05) instead of 1%",
    has_kernels=True,
  ),
  "galore_rank8": OptimizerSpec(
    # A state the size of ours (about 12 * 8 / dim bytes per parameter of a square matrix), and
    # a projection every 50 steps, so that the shortest (100-step) runs renew it.
    _with_weight_decay(optax.contrib.galore, rank=8, update_proj_gap=50),
    3e-3,
    "optax.contrib.galore (optax's) at rank 8, an SVD every 50 steps",
  ),
}


def checked_names(names: Sequence[str] | None = None) -> list[str]:
  """``names``, each an entry of OPTIMIZERS or VARIANTS (else ``get``'s ValueError); by default OPTIMIZERS' entries."""
  names = list(OPTIMIZERS) if names is None else list(names)
  for name in names:
    get(name)
  return names


def get(name: str) -> OptimizerSpec:
  """The entry ``name`` of OPTIMIZERS or VARIANTS."""
  if name not in OPTIMIZERS | VARIANTS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS | VARIANTS)}; got {name!r}.")
  return (OPTIMIZERS | VARIANTS)[name]
