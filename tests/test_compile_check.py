"""CI's check of a compile's bytes and temporaries against the committed figures (``benchmarks.h100_compile``)."""

from benchmarks import h100_compile


def _results(**moved):
  rows = {name: {"default": {"moved": m, "temporaries": 0.1}} for name, m in moved.items()}
  return {"rows": {"float32": rows}}


def test_a_rise_over_5_percent_of_the_bytes_ratio_fails_and_a_subset_checks_only_its_optimizers():
  committed = _results(adamw=28.0, microadam=28.0, taco=19.0)
  assert h100_compile.regressions(_results(adamw=28.0, microadam=29.0, taco=19.0), committed) == []
  assert h100_compile.regressions(_results(adamw=28.0, microadam=29.5, taco=19.0), committed) == [
    "float32 microadam default: bytes / adamw 1.000 -> 1.054"
  ]
  subset = _results(adamw=28.0, microadam=28.0)
  assert h100_compile.regressions(subset, committed) == ["float32 taco default: not measured"]
  assert h100_compile.regressions(subset, committed, ["adamw", "microadam"]) == []
