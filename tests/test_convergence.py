"""The convergence benchmark's protocol on made-up results, its tables in the documents, its large base's start."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import pytest

from benchmarks import convergence

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


def fake_run(optimizer, exponent, seed, loss, *, task="finetune", seconds=10.0, size="small"):
  return {
    "size": size,
    "task": task,
    "optimizer": optimizer,
    "exponent": exponent,
    "seed": seed,
    "learning_rate": 1e-3 * 3.0**exponent,
    "validation_loss": loss,
    "final_train_loss": None if loss is None else loss - 0.4,
    "diverged_at_step": 7 if loss is None else None,
    "state_bytes": 800,
    "adamw_state_bytes": 800,
    "n_params": 100,
    "ms_per_step": 20.0,
    "seconds": seconds,
    "train_losses": [3.0, 2.5, 2.0],
  }


def fake_results(runs, *, max_exponent=2):
  return {
    "protocol": {
      "sizes": {
        "small": {
          "finetune": {
            "corpus": convergence.FINETUNE_CORPUS,
            "seeds": list(SEEDS),
            "steps": 30,
            "start": [-1, 0, 1],
            "optimizers": None,
          }
        }
      },
      "n_params": {"small": 100},
      "base_pretrain_steps": {"small": 50},
      "max_exponent": max_exponent,
    },
    "bases": {"small": {"validation_loss_before": 2.5}},
    "runs": runs,
  }


def sweep(optimizer, losses_by_exponent, offsets=(0.0, 0.01, -0.01)):
  """Runs of every seed at each rate, the seeds ``offsets`` away from the rate's loss."""
  return [
    fake_run(optimizer, e, s, None if loss is None else loss + offset)
    for e, loss in losses_by_exponent.items()
    for s, offset in zip(SEEDS, offsets)
  ]


def test_standard_error_is_the_sample_deviation_over_root_n():
  assert convergence.standard_error([1.0, 2.0, 3.0, 4.0]) == pytest.approx(math.sqrt(5 / 3) / 2)
  assert convergence.standard_error([1.0]) is None
  assert convergence.standard_error([1.0, math.inf]) is None


@pytest.mark.parametrize(
  "means, expected",
  [
    ({}, -1),
    ({-1: 2.0, 0: 1.9}, 1),
    ({-1: 2.0, 0: 1.9, 1: 1.8}, 2),  # Best at the top: one rate up.
    ({-1: 1.7, 0: 1.9, 1: 2.0}, -2),  # Best at the bottom: one rate down.
    ({-1: 2.0, 0: 1.7, 1: 1.8}, None),  # Bracketed.
    ({-1: 2.0, 0: 1.9, 1: 1.8, 2: 1.7}, None),  # At the limit.
    ({-2: 1.6, -1: 1.7, 0: 1.9, 1: 2.0}, None),
    ({-1: 1.8, 0: 1.8, 1: 1.9}, -2),  # A tie goes to the smaller rate, here an edge.
    ({-1: math.inf, 0: math.inf, 1: math.inf}, -2),  # All diverged: smaller rates.
  ],
)
def test_a_sweep_adds_the_next_rate_beyond_an_edge_best_until_the_limit(means, expected):
  assert convergence.next_exponent(means, start=(-1, 0, 1), limit=2) == expected


def test_a_row_is_the_best_complete_rate_with_its_standard_error_and_gap():
  results = fake_results(
    sweep("adamw", {-1: 2.0, 0: 1.8, 1: 1.9})
    + sweep("other", {-1: 2.1, 0: 2.0, 1: 1.9, 2: 1.95})
    + [fake_run("other", -2, 0, 1.0)]
  )  # One seed of a rate: not complete, not counted.
  adamw, other = convergence.rows_of(results, "small", "finetune")
  assert (adamw.exponent, adamw.validation_loss, adamw.finished, adamw.at_edge) == (0, pytest.approx(1.8), True, False)
  assert adamw.standard_error == pytest.approx(0.01 / math.sqrt(3))
  assert (other.exponent, other.means.keys()) == (1, {-1, 0, 1, 2})
  assert convergence.gap_to(other, adamw) == (pytest.approx(0.1), pytest.approx(0.0))


def test_the_table_marks_a_best_rate_at_the_edge_of_its_grid():
  at_limit = fake_results(sweep("adamw", {0: 2.0, 1: 1.9, -1: 2.1, 2: 1.8}))
  unfinished = fake_results(sweep("adamw", {0: 2.0, 1: 1.9, -1: 2.1}))
  low = fake_results(sweep("adamw", {0: 1.9, 1: 2.0, -1: 1.8}))
  inside = fake_results(sweep("adamw", {0: 1.8, 1: 1.9, -1: 2.1}))
  assert "(x9), edge: at the limit |" in convergence.render(at_limit, ["adamw"])
  assert "(x3), edge: sweep unfinished |" in convergence.render(unfinished, ["adamw"])
  assert "(x1/3), edge: sweep unfinished |" in convergence.render(low, ["adamw"])
  assert "edge" not in convergence.render(inside, ["adamw"])


def test_render_gives_means_standard_errors_gaps_and_what_is_missing():
  results = fake_results(sweep("adamw", {-1: 2.0, 0: 1.8, 1: 1.9}) + sweep("other", {-1: 2.1, 0: 2.0, 1: None}))
  assert convergence.render(results, ["adamw", "other", "third"]) == "\n".join(
    [
      "Fine-tuning AdamW's pre-trained weights on the standard library's source (`stdlib_source`), small model"
      " (100 parameters), 30 steps, 3 seeds (validation loss before: 2.500). Partial (not run yet: third).",
      "",
      "| optimizer | best rate | validation loss | gap to AdamW | train loss | x1/3 | x1 | x3 | state bytes/param |",
      "|---|---|---|---|---|---|---|---|---|",
      "| adamw | 1.0e-03 (x1) | 1.800 ± 0.006 | +0.000 ± 0.000 | 1.400 | 2.000 | 1.800 | 1.900 | 8.000 |",
      "| other | 1.0e-03 (x1) | 2.000 ± 0.006 | +0.200 ± 0.000 | 1.600 | 2.100 | 2.000 | diverged | 8.000 |",
      "",
      "![finetune, small](figures/convergence_finetune_small.png)",
    ]
  )


def test_the_readmes_quality_cell_waits_for_both_sweeps():
  finished_adamw = sweep("adamw", {-1: 2.0, 0: 1.8, 1: 1.9})
  other = sweep("other", {-1: 2.1, 0: 2.0, 1: 2.05}, offsets=(0.0, 0.02, -0.01))
  assert convergence.quality_cell(fake_results(finished_adamw + other), "other") == "+0.203 ± 0.003"
  assert convergence.quality_cell(fake_results(finished_adamw + other), "adamw") == "+0.000 (loss 1.800)"
  assert convergence.quality_cell(fake_results(finished_adamw + other[:6]), "other") == "not measured yet"
  assert convergence.quality_cell(fake_results(finished_adamw[3:] + other), "other") == "not measured yet"
  assert convergence.quality_cell(fake_results(finished_adamw), "third") == "not measured yet"


def test_the_readmes_quality_cell_adds_the_larger_model_once_both_its_sweeps_finish():
  results = fake_results(sweep("adamw", {-1: 2.0, 0: 1.8, 1: 1.9}) + sweep("other", {-1: 2.1, 0: 2.0, 1: 2.05}))
  results["protocol"]["sizes"]["large"] = results["protocol"]["sizes"]["small"]
  results["protocol"]["n_params"]["large"] = 3_300_000
  large = [
    fake_run(name, e, s, loss + offset, size="large")
    for name, losses in (("adamw", {-1: 1.9, 0: 1.7, 1: 1.75}), ("other", {-1: 1.85, 0: 1.8, 1: 1.82}))
    for e, loss in losses.items()
    for s, offset in zip(SEEDS, (0.0, 0.01, -0.01))
  ]
  results["runs"] += large[:12]  # the other optimizer's large sweep unfinished
  assert convergence.quality_cell(results, "other") == "+0.200 ± 0.000"
  assert convergence.quality_cell(results, "adamw") == "+0.000 (loss 1.800); 3.3M parameters: +0.000 (loss 1.700)"
  results["runs"] += large[12:]
  assert convergence.quality_cell(results, "other") == "+0.200 ± 0.000; 3.3M parameters: +0.100 ± 0.000"


def test_pending_finishes_a_rate_before_deciding_the_next():
  results = fake_results(sweep("adamw", {-1: 2.0, 0: 1.9, 1: 1.8}) + [fake_run("adamw", 2, 1, 1.7)])
  assert convergence.pending(results, "adamw", "small", "finetune") == [(2, 0), (2, 2)]
  results["runs"] += [fake_run("adamw", 2, s, 1.7) for s in (0, 2)]
  assert convergence.pending(results, "adamw", "small", "finetune") == []  # x9 is the limit.
  assert convergence.pending(results, "new", "small", "finetune") == [(-1, 0), (-1, 1), (-1, 2)]


class Interrupted(Exception):
  pass


def test_a_resumed_sweep_runs_only_what_is_missing_and_saves_after_every_run(tmp_path, monkeypatch):
  path = tmp_path / "results.json"
  results = fake_results(sweep("adamw", {-1: 2.0, 0: 1.8}))
  losses = {-1: 2.0, 0: 1.8, 1: 1.9}
  trained, interrupt_at = [], [2]

  def train_once(name, size, task, exponent, seed, params):
    trained.append((name, exponent, seed))
    if len(trained) in interrupt_at:
      raise Interrupted
    return fake_run(name, exponent, seed, losses[exponent])

  monkeypatch.setattr(convergence, "train_once", train_once)
  monkeypatch.setattr(convergence, "pretrained_base", lambda size, steps, base, cache: (None, base))
  with pytest.raises(Interrupted):
    convergence.run(results, path, ["adamw"], ["small"], ["finetune"], tmp_path)
  saved = json.loads(path.read_text())
  assert len(saved["runs"]) == 7 and trained == [("adamw", 1, 0), ("adamw", 1, 1)]

  trained.clear()
  interrupt_at.clear()
  convergence.run(saved, path, ["adamw"], ["small"], ["finetune"], tmp_path)
  assert trained == [("adamw", 1, 1), ("adamw", 1, 2)]
  assert len(json.loads(path.read_text())["runs"]) == 9


def test_a_stored_protocol_loads_when_the_current_one_only_adds_tasks_optimizers_or_defaulted_fields():
  current = convergence.protocol_json()
  stored = json.loads(json.dumps(current))
  del stored["sizes"]["small"]["finetune_short"]  # a task added since
  stored["sizes"]["large"]["finetune"]["optimizers"] = ["adamw", "microadam"]  # optimizers added since
  for task in stored["sizes"]["small"].values():
    del task["base_steps"]  # a field added since, at its default
  assert convergence.same_runs(stored, current)
  for change in (("steps", 99), ("seeds", [0, 1]), ("start", [0, 1, 2])):
    other = json.loads(json.dumps(stored))
    other["sizes"]["small"]["finetune"][change[0]] = change[1]
    assert not convergence.same_runs(other, current), change
  other = json.loads(json.dumps(stored))
  other["sizes"]["small"]["retired"] = other["sizes"]["small"]["finetune"]  # a task the current one lacks
  assert not convergence.same_runs(other, current)
  other = json.loads(json.dumps(stored))
  other["base_pretrain_steps"]["small"] = 10
  assert not convergence.same_runs(other, current)


def test_merge_adds_the_runs_a_file_lacks_and_refuses_another_base():
  results = fake_results(sweep("adamw", {-1: 2.0, 0: 1.8}) + [fake_run("adamw", 1, 0, 1.9)])
  other = fake_results(sweep("adamw", {0: 1.8, 1: 1.9}) + sweep("other", {0: 2.0}))
  other["bases"]["small_50"] = {"validation_loss_before": 2.6}
  assert convergence.merge(results, other) == 5  # adamw x3's other two seeds, other's x1
  assert len(results["runs"]) == 12 and results["bases"]["small_50"] == {"validation_loss_before": 2.6}
  assert convergence.merge(results, other) == 0
  other["bases"]["small"] = {"validation_loss_before": 2.4}
  with pytest.raises(SystemExit, match="the small base differs"):
    convergence.merge(results, other)


def test_a_task_with_its_own_base_length_has_its_own_base():
  protocol = convergence.protocol_json()
  assert convergence.base_of(protocol, "small", "finetune") == ("small", 1000)
  assert convergence.base_of(protocol, "small", "finetune_short") == ("small_500", 500)
  assert convergence.base_of(protocol, "large", "finetune") == ("large", 500)
  assert convergence.base_of(protocol, "small", "pretrain") is None


def test_the_gap_table_sets_each_fine_tuning_beside_the_others():
  results = fake_results(sweep("adamw", {-1: 2.0, 0: 1.8, 1: 1.9}) + sweep("other", {-1: 2.1, 0: 2.0, 1: 2.05}))
  assert convergence.gap_table(results) == ""  # one fine-tuning table: nothing to set beside it
  results["protocol"]["sizes"]["large"] = results["protocol"]["sizes"]["small"]
  results["protocol"]["n_params"]["large"] = 3_300_000
  results["protocol"]["base_pretrain_steps"]["large"] = 20
  results["runs"] += [
    fake_run(name, e, s, loss + offset, size="large")
    for name, losses in (("adamw", {-1: 1.9, 0: 1.7, 1: 1.75}), ("other", {-1: 1.85, 0: 1.8}))
    for e, loss in losses.items()
    for s, offset in zip(SEEDS, (0.0, 0.01, -0.01))
  ]
  assert convergence.gap_table(results).splitlines()[2:] == [
    "| optimizer | 0.0001M parameters, 30 steps from a 50-step base | 3.3M parameters, 30 steps from a 20-step base |",
    "|---|---|---|",
    "| other | +0.200 ± 0.000 | +0.100 ± 0.000 (partial) |",
  ]


def test_tacos_fallback_runs_at_adamws_best_rate_in_the_committed_results(committed):
  for size, rate in convergence.ADAMW_BEST_FINETUNE_RATE.items():
    assert convergence.row_of(committed, size, "finetune", "adamw").learning_rate == pytest.approx(rate), size


def test_the_large_models_base_starts_as_the_base_of_the_committed_runs_did():
  """The first 3 steps of the large model's base pre-training give the losses the committed runs' code gave.

  Recorded from the code that made the committed large runs (``tests/data/convergence``). A change to what the
  model (its default ``remat`` included), the loss, AdamW, the schedule or the batches compute moves them by far
  more than ``rel``; a change of machine or of XLA:CPU's thread count moves only their last bits (one core against
  two: 1e-7 at the fourth step). The 500 steps of the large base amplify those bits to about 0.02 of validation
  loss, so its base reproduces only on a machine that computes the same bits (benchmarks/README.md, "Convergence").
  """
  golden = json.loads((ROOT / "tests" / "data" / "convergence" / "large_base_first_steps.json").read_text())
  config = convergence.SIZES["large"]
  assert {k: v for k, v in dataclasses.asdict(config).items() if k in golden["config"]} == golden["config"]
  spec = convergence.optimizers.get(convergence.BASE_OPTIMIZER)
  schedule = convergence.learning_rate_schedule(spec.default_learning_rate, convergence.BASE_PRETRAIN_STEPS["large"])
  result = convergence.loop.train(
    config,
    spec.build(schedule, config),
    steps=len(golden["train_losses"]),
    batch_size=convergence.BATCH_SIZE,
    seq_len=convergence.SEQ_LEN,
    seed=convergence.BASE_SEED,
    corpus=convergence.PRETRAIN_CORPUS,
  )
  assert result.train_losses == pytest.approx(golden["train_losses"], rel=1e-5, abs=0)
  assert result.validation_loss == pytest.approx(golden["validation_loss"], rel=1e-5, abs=0)


@pytest.fixture(name="committed", scope="module")
def committed_results():
  return json.loads(convergence.RESULTS.read_text())


def test_the_convergence_tables_are_rendered_from_the_committed_results(committed):
  assert convergence.render(committed) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_large_model_fine_tunes_every_optimizer_of_the_small_models_table(committed):
  """Every row of the small model's fine-tuning table has a finished sweep on the large model, its best rate inside."""
  small = {row.optimizer for row in convergence.rows_of(committed, "small", "finetune")}
  large = {row.optimizer: row for row in convergence.rows_of(committed, "large", "finetune")}
  assert sorted(small - set(large)) == []
  assert [name for name, row in large.items() if not row.finished or row.at_edge] == []


def test_the_readmes_quality_column_quotes_the_results(committed):
  """ "Choosing an optimizer": each row's fine-tuning gap to AdamW, from the committed results."""
  readme = (ROOT / "README.md").read_text()
  table = readme.split("## Choosing an optimizer")[1].split("\n\n")[1].splitlines()
  header = [cell.strip() for cell in table[0].strip("|").split("|")]
  column = next(i for i, name in enumerate(header) if name.startswith("fine-tuning: validation loss vs AdamW"))
  quoted = {}
  for line in table[2:]:
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    quoted[re.match(r"`(?:optax\.(?:contrib\.)?)?(\w+)`", cells[0]).group(1)] = cells[column]
  assert quoted == {name: convergence.quality_cell(committed, name) for name in quoted}
  assert len(quoted) >= 8


def test_8bit_adamw_forgets_the_second_moment_of_gradients_tiny_beside_their_blocks_largest():
  """The cause of 8-bit AdamW's poor fine-tuning seeds, and the remedy the benchmark measures.

  An output-head row scores every byte; bytes the corpus never shows get
  gradients ~1e-4 of the row's largest. Squared, that is 1e-8 of the block's
  absmax of ``v``, under the 8-bit map's smallest non-zero entry (3.25e-7):
  ``v`` is stored as 0 while ``m`` is kept, so when the next gradient there is
  smaller, the step is ``m`` over that gradient alone, hundreds of times Adam's.
  """
  import jax.numpy as jnp
  import optax

  import optax_memopt

  # 4096 elements: the smallest tensor 8-bit AdamW quantizes.
  params = {"lm_head": {"kernel": jnp.zeros((16, 256))}, "layer": {"kernel": jnp.zeros((16, 256))}}

  def second_step(optimizer):
    state = optimizer.init(params)
    for small in (1e-4, 1e-7):
      grads = jnp.full((16, 256), small).at[:, 0].set(1.0)
      updates, state = optimizer.update({"lm_head": {"kernel": grads}, "layer": {"kernel": grads}}, state, params)
    return {name: abs(float(u["kernel"][0, 1])) for name, u in updates.items()}

  adam = second_step(optax.adam(1.0))
  eight_bit = second_step(optax_memopt.adamw_8bit(1.0))
  remedy = second_step(
    optax.partition(
      {"quantized": optax_memopt.adamw_8bit(1.0), "float32": optax.adam(1.0)},
      lambda p: optax_memopt.vocabulary_in_float32(p, names=("lm_head",)),
    )
  )
  assert adam["layer"] < 1.0
  assert eight_bit["layer"] > 100 * adam["layer"]
  assert remedy["lm_head"] == pytest.approx(adam["lm_head"], rel=1e-4) and remedy["layer"] == eight_bit["layer"]


def bf16_run(optimizer, exponent, rounding, seed, loss, draw=0):
  return {
    "optimizer": optimizer,
    "exponent": exponent,
    "rounding": rounding,
    "seed": seed,
    "rounding_draw": draw,
    "learning_rate": 1e-3 * 3.0**exponent,
    "validation_loss": loss,
    "diverged_at_step": None,
    "final_train_loss": loss - 0.4,
    "ms_per_step": 20.0,
    "seconds": 10.0,
  }


def test_the_bfloat16_table_runs_each_optimizer_at_its_best_float32_rate_and_gaps_it_seed_by_seed(monkeypatch):
  """Gaps to the optimizer's own float32 runs at the same rate and seeds, with the standard error of the differences."""
  from benchmarks import convergence_bf16 as bf16

  # The figures below are worked out for these three seeds, stochastic rounding's two draws a seed.
  monkeypatch.setattr(bf16, "SEEDS", SEEDS)
  monkeypatch.setattr(bf16, "ROUNDING_DRAWS", 2)
  monkeypatch.setattr(bf16, "KAHAN_TOO", ("compensated",))
  reference = fake_results(
    sweep("adamw", {0: 2.0, 1: 1.9, 2: 2.1})
    + sweep("other", {-1: 2.2, 0: 2.3, 1: 2.4})
    + sweep("compensated", {-1: 2.4, 0: 2.3, 1: 2.2})
  )
  Case = bf16.Case
  roundings = ("stochastic", "nearest", "kahan")
  assert bf16.cases(reference, ["adamw", "other", "not_swept", "compensated"]) == [
    Case("adamw", 1, "stochastic"),
    Case("adamw", 1, "nearest"),
    Case("adamw", 1, "kahan"),
    *[Case("adamw", -1, r) for r in roundings],
    *[Case(bf16.FLOAT32_MOMENTS, e, r) for e in (-1, 1) for r in roundings],
    Case("other", -1, "stochastic"),
    Case("compensated", 1, "stochastic"),
    Case("compensated", 1, "kahan"),
  ]
  float32 = {s: 1.9 + offset for s, offset in zip(SEEDS, (0.0, 0.01, -0.01))}
  # Each seed's draws 0.003 either side of its difference: the draws' means are the differences.
  stochastic = [
    bf16_run("adamw", 1, "stochastic", s, float32[s] + d + spread, draw)
    for s, d in zip(SEEDS, (0.004, 0.006, 0.011))
    for draw, spread in enumerate((-0.003, 0.003))
  ]
  nearest = [bf16_run("adamw", 1, "nearest", s, float32[s] + d) for s, d in zip(SEEDS, (0.05, 0.06, 0.07))]
  results = {"protocol": bf16.protocol_json(), "runs": stochastic[:-1] + nearest}
  # The last seed's second draw is missing: no row yet.
  assert bf16.row_of(results, reference, Case("adamw", 1, "stochastic")) is None
  results["runs"].append(stochastic[-1])
  # Differences 0.004, 0.006, 0.011: mean 0.007, sample deviation sqrt(26e-6 / 2), over sqrt(3): 0.00208.
  # The losses 1.904, 1.916, 1.901: deviation sqrt(126e-6 / 2), over sqrt(3): 0.00458.
  assert bf16.render(results, reference, ["adamw", "other"]).splitlines()[4:] == [
    "| adamw | 3.0e-03 (x3) | stochastic rounding | 1.907 ± 0.005 | 1.900 ± 0.006 | +0.007 ± 0.002 | yes |",
    "| adamw | 3.0e-03 (x3) | round-to-nearest | 1.960 ± 0.006 | 1.900 ± 0.006 | +0.060 ± 0.006 | no |",
  ]
  assert "Partial (not run yet: adamw x3 kahan, adamw x1/3 stochastic, adamw x1/3 nearest, adamw x1/3 kahan," in (
    bf16.render(results, reference, ["adamw", "other"])
  )
  # AdamW with float32 moments compares with AdamW's float32-parameter runs.
  moments = [bf16_run(bf16.FLOAT32_MOMENTS, 1, "nearest", s, float32[s] + 0.02) for s in SEEDS]
  results["runs"] += moments
  assert bf16.render(results, reference, ["adamw"]).splitlines()[6] == (
    "| adamw_float32_moments | 3.0e-03 (x3) | round-to-nearest | 1.920 ± 0.006 | 1.900 ± 0.006 | +0.020 ± 0.000 | no |"
  )


def test_the_bfloat16_table_is_rendered_from_the_committed_results(committed):
  from benchmarks import convergence_bf16 as bf16

  results = json.loads(bf16.RESULTS.read_text())
  assert bf16.render(results, committed) in (ROOT / "benchmarks" / "README.md").read_text()
