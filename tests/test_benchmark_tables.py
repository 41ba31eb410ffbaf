"""Figures quoted in the documents equal the committed results they come from."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from benchmarks import h100_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]
H100_RESULTS = json.loads((ROOT / "benchmarks" / "data" / "h100_compile.json").read_text())
# A row's name: `taco`, `optax.adamw`, `optax.contrib.galore` (optax's peers), then what the row adds.
OPTIMIZER_CELL = r"`(?:optax\.(?:contrib\.)?)?(\w+)`"


def test_the_h100_compile_tables_are_rendered_from_the_results():
  assert h100_compile.render(H100_RESULTS) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_readmes_bytes_moved_column_quotes_the_results():
  """ "Choosing an optimizer": each row's float32 bytes moved, as a ratio to AdamW's, from the same file."""
  readme = (ROOT / "README.md").read_text()
  table = readme.split("## Choosing an optimizer")[1].split("\n\n")[1].splitlines()
  header = [cell.strip() for cell in table[0].strip("|").split("|")]
  column = header.index("bytes one step moves on an H100, vs AdamW's")
  rows = H100_RESULTS["rows"]["float32"]
  adamw = rows["adamw"]["default"]["moved"]
  quoted = {}
  for line in table[2:]:
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    name = re.match(OPTIMIZER_CELL, cells[0]).group(1)
    quoted[name] = cells[column]
  expected = {}
  for name in quoted:
    row = rows[name]["default"]
    expected[name] = f"{row['moved'] / adamw:.2f}x"
    if "moved_cheapest_branch" in row:  # GaLore: most steps, then the step that recomputes its projections.
      expected[name] = f"{row['moved_cheapest_branch'] / adamw:.2f}x; {expected[name]} on a step with an SVD"
  assert quoted == expected
  assert len(quoted) >= 8


def choosing_table() -> tuple[list[str], dict[str, list[str]]]:
  """README's "Choosing an optimizer" table: its header, and each row's cells by optimizer name."""
  readme = (ROOT / "README.md").read_text()
  table = readme.split("## Choosing an optimizer")[1].split("\n\n")[1].splitlines()
  header = [cell.strip() for cell in table[0].strip("|").split("|")]
  rows = {}
  for line in table[2:]:
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    rows[re.match(OPTIMIZER_CELL, cells[0]).group(1)] = cells
  return header, rows


def test_the_readmes_state_bytes_column_is_what_the_states_hold():
  """ "Choosing an optimizer": each row's state bytes per parameter, as benchmarks.memory computes them."""
  from benchmarks import memory

  header, rows = choosing_table()
  column = header.index("state bytes/param (Llama-2-7B)")
  computed = {}
  for name in rows:
    nbytes, n_params = memory.state_bytes(name, "llama2_7b")
    computed[name] = f"{nbytes / n_params:.2f}"
  assert {name: cells[column] for name, cells in rows.items()} == computed


def test_the_readme_quotes_no_step_time_outside_its_table():
  """Step times live in benchmarks/README.md: the README's prose names none (they drift between runs)."""
  readme = (ROOT / "README.md").read_text()
  prose = re.sub(r"```.*?```", "", readme, flags=re.S).replace(
    readme.split("## Choosing an optimizer")[1].split("\n\n")[1], ""
  )
  assert not re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:ms|x\b|minutes|seconds)", prose)


def test_the_cpu_step_time_table_is_rendered_from_the_results():
  from benchmarks import step_time

  results = json.loads((ROOT / "benchmarks" / "data" / "step_time.json").read_text())
  assert step_time.render(results) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_cpu_step_time_table_of_galore_is_rendered_from_its_results():
  from benchmarks import step_time

  results = json.loads((ROOT / "benchmarks" / "data" / "step_time_galore.json").read_text())
  assert {row["optimizer"] for row in results["rows"]} >= {"adamw", "galore", "galore_svd_step"}
  assert step_time.render(results) in (ROOT / "benchmarks" / "README.md").read_text()


@pytest.mark.parametrize("name", ["step_time_1_bf16", "step_time_1_rest", "step_time_2", "step_time_2_bf16"])
def test_the_h200_step_time_tables_are_rendered_from_the_results(name):
  from benchmarks import step_time

  results = json.loads((ROOT / "benchmarks" / "data" / "h200" / f"{name}.json").read_text())
  assert step_time.render(results) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_h200_kernel_table_is_rendered_from_the_results():
  from benchmarks import kernels

  results = json.loads((ROOT / "benchmarks" / "data" / "h200" / "kernels.json").read_text())
  assert kernels.render(results) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_cpu_step_memory_table_is_rendered_from_the_results():
  from benchmarks import memory

  results = json.loads((ROOT / "benchmarks" / "data" / "cpu_step_memory.json").read_text())
  assert memory.render_step_peak(results) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_sharding_table_is_rendered_from_the_results():
  from benchmarks import sharding

  results = json.loads((ROOT / "benchmarks" / "data" / "sharding.json").read_text())
  assert sharding.render(results) in (ROOT / "benchmarks" / "README.md").read_text()


def test_ternary_adams_docstrings_quote_the_readmes_state_bytes():
  """The state bytes per parameter in ternary Adam's docstrings are the README's (checked by the test above)."""
  import importlib

  module = importlib.import_module("optax_memopt.ternary_adam")  # The package's name is the alias.
  header, rows = choosing_table()
  figure = rows["ternary_adam"][header.index("state bytes/param (Llama-2-7B)")]
  for doc in (module.__doc__, module.ternary_adam.__doc__):
    assert re.findall(r"(\d+\.\d+) bytes (?:of\s+state\s+)?per\s+parameter", doc) == [figure]


def test_the_b200_compile_tables_are_rendered_from_the_results():
  results = json.loads((ROOT / "benchmarks" / "data" / "b200_compile.json").read_text())
  assert h100_compile.render(results) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_kernel_registers_table_is_rendered_from_the_results():
  from benchmarks import kernel_registers

  results = json.loads((ROOT / "benchmarks" / "data" / "kernel_registers.json").read_text())
  assert kernel_registers.render(results) in (ROOT / "docs" / "kernels.md").read_text()


def test_the_readmes_one_gpu_table_is_what_fit_computes():
  """ "Llama-3-8B on one 80 GB H100": parameters + gradients + state per optimizer, float32 and bfloat16, from fit."""
  from benchmarks import memory

  assert memory.one_gpu_table() in (ROOT / "README.md").read_text()


def test_the_training_step_table_is_rendered_from_the_results():
  from benchmarks import train_step_compile

  results = json.loads((ROOT / "benchmarks" / "data" / "train_step_compile.json").read_text())
  assert train_step_compile.render(results) in (ROOT / "docs" / "memory-planning.md").read_text()


def test_the_training_step_rows_hold_the_parts_they_should():
  """Each compiled step: parameters and gradients at the dtype's bytes per parameter, the state its optimizer builds,
  a peak of at least parameters and state (donated arguments, live throughout the step), and at batch 1 less than
  parameters, gradients and state together (XLA updates some parameters before every gradient is made); the
  activations those of the forward and backward pass alone, one figure for every optimizer, growing with the batch."""
  import jax
  import jax.numpy as jnp

  from memopt_tools import fit, train_compile
  from optax_memopt.state_bytes import state_nbytes

  results = json.loads((ROOT / "benchmarks" / "data" / "train_step_compile.json").read_text())
  states = {}
  for row in results["rows"]:
    dtype = jnp.dtype(row["param_dtype"])
    assert row["params"] == row["gradients"] == row["n_params"] * dtype.itemsize
    key = (row["model"], row["param_dtype"], row["optimizer"])
    if key not in states:
      config = fit.MODELS[row["model"]]
      tx = train_compile.registered_optimizer(
        row["optimizer"], n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, stochastic_rounding=dtype != jnp.float32
      )
      states[key] = state_nbytes(jax.eval_shape(tx.init, fit.model_params(row["model"], dtype)))
    assert row["state"] == states[key], key
    assert row["peak"] >= row["params"] + row["state"]
    if row["batch"] == 1:  # docs/memory-planning.md: at batch 1 the peak holds less than one set of gradients.
      assert row["peak"] < row["params"] + row["gradients"] + row["state"], key
    assert row["fits"] == (row["peak"] <= int(row["memory"] * (1 - row["margin"])))
  activations = {}
  for row in results["rows"]:
    key = tuple(row[k] for k in ("model", "target", "param_dtype", "remat", "seq_len", "batch"))
    assert activations.setdefault(key, row["activations"]) == row["activations"], key
  for (*step, batch), kept in activations.items():
    smaller = [activations[(*step, b)] for (*s, b) in activations if s == step and b < batch]
    assert all(0 < k < kept for k in smaller), step


def test_the_sharded_compile_tables_are_rendered_from_the_results():
  from benchmarks import sharded_compile

  results = json.loads((ROOT / "benchmarks" / "data" / "sharded_compile.json").read_text())
  assert sharded_compile.render(results) in (ROOT / "benchmarks" / "README.md").read_text()


def test_stochastic_rounding_adds_no_pass_to_any_bfloat16_step():
  """Each optimizer's committed bfloat16 step followed by stochastic rounding moves what it moves without (+0.01)."""
  from memopt_tools.training import optimizers

  rows = H100_RESULTS["rows"]["bfloat16"]
  assert set(optimizers.OPTIMIZERS) <= {name for name, row in rows.items() if "stochastic_rounding" in row}
  added = {name: row["stochastic_rounding"]["moved"] - row["default"]["moved"] for name, row in rows.items()}
  assert all(0 <= extra < 0.01 for extra in added.values()), added
