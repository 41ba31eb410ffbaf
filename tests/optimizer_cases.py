"""The optimizers every generic property test runs against.

Each entry builds an alias with small block sizes so that tiny test tensors
still span several blocks. ``optax.adamw`` is a control: a property that it
fails is a broken test, not a broken optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optax

import optax_memopt


@dataclasses.dataclass(frozen=True)
class OptimizerCase:
  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict[str, Any]
  # Hyper-parameters that fix shapes: static under inject_hyperparams.
  static_args: tuple[str, ...] = ()
  # The parameters' dtype where a harness makes its own (tests.sharding_check).
  param_dtype: str = "float32"


CASES: dict[str, OptimizerCase] = {
  "optax_adamw": OptimizerCase(optax.adamw, dict(learning_rate=1e-2)),
  # Flax rules on the test tree: per output neuron (40 blocks), per token
  # (50), whole tensor (norm scale), per element (bias).
  "adam_mini": OptimizerCase(
    optax_memopt.adam_mini,
    dict(learning_rate=1e-2, weight_decay=1e-4, n_heads=4),
    static_args=("n_heads",),
  ),
  # Blocks of 256 (the kernel's row) cut the (24, 40) kernel into three full
  # blocks and a tail; buckets of 64 make several per block.
  "microadam": OptimizerCase(
    optax_memopt.microadam,
    dict(
      learning_rate=1e-2,
      weight_decay=1e-4,
      window=4,
      density=0.1,
      block_size=256,
      bucket_size=64,
    ),
    static_args=("window", "density", "block_size", "bucket_size"),
  ),
  # k = 4 of the kernel's 40 outputs per row, so entries get evicted; the
  # embedding, bias and norm scale take the Adam fallback.
  "taco": OptimizerCase(
    optax_memopt.taco,
    dict(learning_rate=1e-2, k=4, weight_decay=1e-4),
    static_args=("k",),
  ),
  # min_quantized_size=32 makes the kernel and the embedding ternary with factored nu
  # and the bias ternary with full nu; the norm scale stays float32. Blocks
  # of 32 cut them into 30, 38 (with a tail) and 2 blocks.
  "ternary_adam": OptimizerCase(
    optax_memopt.ternary_adam,
    dict(learning_rate=1e-2, weight_decay=1e-4, block_size=32, min_quantized_size=32),
    static_args=("block_size", "min_quantized_size", "key"),
  ),
  # min_quantized_size=32 quantizes the kernel, the embedding and the bias;
  # the norm scale keeps float32 moments. Blocks of 16 do not divide the
  # (24, 40) kernel's, the (50, 24) embedding's or the bias's rows (flat
  # blocks, the last one short); fp8's blocks of 8 tile the kernel's and
  # the embedding's rows (scales shaped like the rows). Both divide the
  # tensor-parallel shards of the sharded tests' matrices (48 columns).
  "adamw_8bit": OptimizerCase(
    optax_memopt.adamw_8bit,
    dict(learning_rate=1e-2, weight_decay=1e-4, block_size=16, min_quantized_size=32),
    static_args=("block_size", "min_quantized_size"),
  ),
  "adamw_4bit": OptimizerCase(
    optax_memopt.adamw_4bit,
    dict(learning_rate=1e-2, weight_decay=1e-4, block_size=16, min_quantized_size=32),
    static_args=("block_size", "min_quantized_size"),
  ),
  "adamw_fp8": OptimizerCase(
    optax_memopt.adamw_fp8,
    dict(learning_rate=1e-2, weight_decay=1e-4, block_size=8, min_quantized_size=32),
    static_args=("block_size", "min_quantized_size"),
  ),
}


def _sgd_with_stochastic_rounding(**kwargs) -> optax.GradientTransformation:
  return optax_memopt.with_stochastic_rounding(optax.sgd(**kwargs), seed=7)


def _sgd_with_kahan_summation(**kwargs) -> optax.GradientTransformation:
  return optax_memopt.with_kahan_summation(optax.sgd(**kwargs))


def _ternary_adam_every_two_steps(**kwargs) -> optax.GradientTransformation:
  return optax.MultiSteps(optax_memopt.ternary_adam(**kwargs), every_k_schedule=2).gradient_transformation()


# Layouts that only the sharded tests tell apart, on tests.sharding_check's
# tree (matrices 96, 256 and 512 wide, tensor parallelism of 2 over the
# outputs).
SHARDING_CASES: dict[str, OptimizerCase] = {
  **CASES,
  # Three parts of a row do not split over tp = 2: they stay whole over it
  # (256 and 512 wide), or the rows split over it (96 wide, parts of 32).
  "taco_parts_across_tp": OptimizerCase(optax_memopt.taco, dict(learning_rate=1e-2, k=3), static_args=("k",)),
  # One part: the row's k largest, wherever they are.
  "taco_one_segment": OptimizerCase(
    optax_memopt.taco, dict(learning_rate=1e-2, k=4, segments=1), static_args=("k", "segments")
  ),
  # Blocks of 32: the 96-wide kernel's rows hold three, which do not split
  # over tp = 2; their scales follow the rows over fsdp, replicated over tp,
  # as every device holding part of a row needs them.
  "adamw_4bit_blocks_across_tp": OptimizerCase(
    optax_memopt.adamw_4bit,
    dict(learning_rate=1e-2, block_size=32, min_quantized_size=32),
    static_args=("block_size", "min_quantized_size"),
  ),
  # Blocks of 64 cross the 96-wide kernel's rows: flat block-major codes and
  # their (blocks, 1) scales, both split over the whole mesh.
  "ternary_adam_blocks_across_rows": OptimizerCase(
    optax_memopt.ternary_adam,
    dict(learning_rate=1e-2, block_size=64, min_quantized_size=32),
    static_args=("block_size", "min_quantized_size", "key"),
  ),
  # Inside optax.MultiSteps, whose gradient buffer has the parameters'
  # shapes: ternary Adam's three blocks of a 96-wide row still split their
  # rows over both mesh axes (the buffer is not a field of its state).
  "ternary_adam_in_multisteps": OptimizerCase(
    _ternary_adam_every_two_steps,
    dict(learning_rate=1e-2, block_size=32, min_quantized_size=32),
    static_args=("block_size", "min_quantized_size", "key"),
  ),
  # bfloat16 parameters, rounded stochastically: the rounding's key is
  # replicated and each device draws its elements' bits in place. After
  # SGD with momentum, whose elementwise update is the same bits on any
  # mesh (an optimizer whose float32 update moves by an ulp on another
  # mesh moves the rare entry whose random bits sit at its remainder).
  "sgd_stochastic_rounding_bf16": OptimizerCase(
    _sgd_with_stochastic_rounding, dict(learning_rate=1e-2, momentum=0.9), param_dtype="bfloat16"
  ),
  # Its compensation buffers shaped and sharded like the parameters.
  "sgd_kahan_bf16": OptimizerCase(
    _sgd_with_kahan_summation, dict(learning_rate=1e-2, momentum=0.9), param_dtype="bfloat16"
  ),
  # The default top-k blocks of 16384: the 512 x 96 kernel has 3 blocks,
  # which do not split over 8 devices.
  "microadam_default_blocks": OptimizerCase(
    optax_memopt.microadam, dict(learning_rate=1e-2, window=4), static_args=("window",)
  ),
}
