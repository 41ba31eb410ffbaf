"""CI's check of a compile's bytes and temporaries against the committed figures (``benchmarks.h100_compile``)."""

import json

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


def test_a_rewritten_row_keeps_other_rows_and_drops_figures_of_deleted_kernels(tmp_path):
  path = tmp_path / "h100_compile.json"
  header = {"layers": 2, "jax": "0.10.2"}
  figures = {"moved": 19.0, "temporaries": 0.8}
  committed = _results(adamw=28.0, microadam=28.0)
  committed["rows"]["float32"]["microadam"]["pallas"] = figures
  committed["rows"]["float32"]["taco"] = {"default": figures, "pallas": figures}
  path.write_text(json.dumps(header | committed))
  measured = header | _results(adamw=28.0, taco=17.0)  # TACO has no kernels: no "pallas" figures.
  rows = h100_compile.merged(measured, path)["rows"]["float32"]
  assert rows["taco"] == {"default": {"moved": 17.0, "temporaries": 0.1}}
  assert rows["microadam"] == committed["rows"]["float32"]["microadam"]
