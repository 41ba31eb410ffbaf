"""optax_memopt: optimizers for optax whose state is a fraction of Adam's."""

from optax_memopt.adam_mini import ScaleByAdamMiniState, adam_mini, scale_by_adam_mini
from optax_memopt.adam_mini_blocks import BlockRule, adam_mini_partition
from optax_memopt.kahan_summation import KahanSummationState, kahan_summation, with_kahan_summation
from optax_memopt.lowbit_adamw import ScaleByLowbitAdamState, adamw_4bit, adamw_8bit, adamw_fp8, scale_by_lowbit_adam
from optax_memopt.microadam import ScaleByMicroAdamState, microadam, scale_by_microadam
from optax_memopt.sharding import state_shardings
from optax_memopt.state_bytes import state_nbytes
from optax_memopt.stochastic_rounding import StochasticRoundingState, stochastic_rounding, with_stochastic_rounding
from optax_memopt.taco import MatrixAxes, ScaleByTacoState, scale_by_taco, taco, taco_labels
from optax_memopt.ternary_adam import ScaleByTernaryAdamState, TernaryAdamNu, scale_by_ternary_adam, ternary_adam
from optax_memopt.vocabulary import vocabulary_in_float32

__version__ = "0.1.0"

__all__ = [
  "adam_mini",
  "adam_mini_partition",
  "adamw_4bit",
  "adamw_8bit",
  "adamw_fp8",
  "BlockRule",
  "kahan_summation",
  "KahanSummationState",
  "MatrixAxes",
  "microadam",
  "scale_by_adam_mini",
  "scale_by_lowbit_adam",
  "scale_by_microadam",
  "scale_by_taco",
  "scale_by_ternary_adam",
  "ScaleByAdamMiniState",
  "ScaleByLowbitAdamState",
  "ScaleByMicroAdamState",
  "ScaleByTacoState",
  "ScaleByTernaryAdamState",
  "state_nbytes",
  "state_shardings",
  "stochastic_rounding",
  "StochasticRoundingState",
  "taco",
  "taco_labels",
  "ternary_adam",
  "TernaryAdamNu",
  "vocabulary_in_float32",
  "with_kahan_summation",
  "with_stochastic_rounding",
]


# Public names before issue 42, kept readable with a DeprecationWarning.
_RENAMED = {"FactoredSecondMoment": "TernaryAdamNu"}


def __getattr__(name: str):
  if name in _RENAMED:
    import warnings

    warnings.warn(f"optax_memopt.{name} is optax_memopt.{_RENAMED[name]}.", DeprecationWarning, stacklevel=2)
    return globals()[_RENAMED[name]]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
