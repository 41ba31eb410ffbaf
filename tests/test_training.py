"""The training task behind the main job, the benchmarks and the notebook."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from memopt_tools import main_job
from memopt_tools.training import data, loop, model, optimizers


@pytest.mark.parametrize("corpus", sorted(data.CORPORA))
def test_corpora_are_real_text_of_useful_size(corpus):
  tokens = data.load_corpus(corpus)
  assert tokens.dtype == np.uint8 and tokens.size > 100_000
  text = tokens.tobytes().decode("utf-8")
  assert text.count(" ") > tokens.size // 20  # Prose or code, not binary.


def test_corpora_differ_and_unknown_corpus_is_rejected():
  a, b = data.load_corpus("pydoc_topics"), data.load_corpus("stdlib_source")
  assert a[:1000].tobytes() != b[:1000].tobytes()
  with pytest.raises(ValueError, match="corpus"):
    data.load_corpus("wikipedia")


def test_split_holds_out_the_tail():
  tokens = np.arange(1000) % 256
  train, valid = data.split(tokens, validation_fraction=0.2)
  np.testing.assert_array_equal(np.concatenate([train, valid]), tokens)
  assert len(valid) == 200
  with pytest.raises(ValueError, match="validation_fraction"):
    data.split(tokens, validation_fraction=1.0)


def test_random_windows_are_consecutive_text(seed):
  tokens = np.arange(5000, dtype=np.int64)
  batch = next(data.random_windows(tokens, batch_size=4, seq_len=16, seed=seed))
  assert batch.shape == (4, 17)
  np.testing.assert_array_equal(np.diff(batch, axis=1), 1)


def test_transformer_is_causal_and_shapes_follow_the_config(seed):
  config = model.TransformerConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48)
  net = model.Transformer(config, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(seed), (2, 12), 0, 256)
  logits = net(tokens)
  assert logits.shape == (2, 12, 256)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 256)
  chex.assert_trees_all_close(net(changed)[:, :8], logits[:, :8], atol=1e-5)
  assert not np.allclose(net(changed)[:, 8:], logits[:, 8:])


def test_transformer_config_rejects_bad_heads():
  with pytest.raises(ValueError, match="n_kv_heads"):
    model.TransformerConfig(n_heads=4, n_kv_heads=3)


def test_adamw_learns_the_text():
  result = loop.train(main_job.MODEL_SIZES["tiny"], optax.adamw(3e-3), steps=60, batch_size=8, seq_len=32)
  # Uniform guessing over bytes costs ln(256) = 5.55 nats; English bytes are
  # far more predictable, so 60 steps must clearly beat it.
  assert result.train_losses[0] > 5.0
  assert np.mean(result.train_losses[-10:]) < 3.6
  assert result.validation_loss < 3.8
  assert result.state_bytes == 8 * result.n_params + 4


def test_parameter_count_follows_the_layout():
  c = main_job.MODEL_SIZES["tiny"]
  kv = c.n_kv_heads * c.head_dim
  per_layer = 2 * c.dim + 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim
  expected = 2 * c.vocab_size * c.dim + c.n_layers * per_layer + c.dim
  assert model.parameter_count(c) == expected == 25_696


TINY_RUN = ["--model-size", "tiny", "--batch-size", "2", "--seq-len", "8", "--quiet"]


def test_main_job_compares_optimizers_and_writes_results(tmp_path, capsys):
  code = main_job.main(["--compare", "adamw", "adafactor", "--steps", "12", "--out", str(tmp_path)] + TINY_RUN)
  out = capsys.readouterr().out
  assert code == 0
  rows = json.loads((tmp_path / "adamw-vs-adafactor" / "results.json").read_text())
  assert [r["optimizer"] for r in rows] == ["adamw", "adafactor"]
  assert len(rows[0]["train_losses"]) == 12
  assert [r["learning_rate"] for r in rows] == [3e-3, 1e-2]  # Each optimizer's own.
  n = 25_696
  # fp32 m and v, and two int32 step counts (Adam's and the schedule's).
  assert rows[0]["n_params"] == n and rows[0]["state_bytes"] == 8 * n + 8
  adafactor = rows[1]
  assert f"adafactor: train loss {adafactor['final_train_loss']:.3f}" in out
  assert f"= {adafactor['state_bytes'] / n:.3f} B/param, {(8 * n + 4) / adafactor['state_bytes']:.1f}x less" in out
  assert f"| adafactor | {adafactor['final_train_loss']:.3f} | {adafactor['validation_loss']:.3f}" in out
  assert sorted(path.name for path in tmp_path.iterdir()) == ["adamw-vs-adafactor"]
  for name in ("results.json", "results.md", "losses.png"):
    assert (tmp_path / "adamw-vs-adafactor" / name).stat().st_size > 0


def test_the_default_run_compares_adamw_with_a_compressed_optimizer(tmp_path, capsys, monkeypatch):
  """How close to AdamW, for how much memory: both trained, the gap and the state ratio printed."""
  monkeypatch.setitem(main_job.MODEL_SIZES, "small", main_job.MODEL_SIZES["tiny"])
  code = main_job.main(["--steps", "4", "--batch-size", "2", "--seq-len", "8", "--quiet", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert code == 0
  rows = json.loads((tmp_path / "adamw-vs-microadam" / "results.json").read_text())
  adamw, microadam = rows
  assert (adamw["optimizer"], microadam["optimizer"]) == ("adamw", "microadam")
  gap = microadam["validation_loss"] - adamw["validation_loss"]
  ratio = adamw["state_bytes"] / microadam["state_bytes"]
  assert f"| microadam | {microadam['final_train_loss']:.3f} | {microadam['validation_loss']:.3f} | {gap:+.3f}" in out
  assert f"| {ratio:.1f}x |" in out
  assert "--compare alone trains all 12 (about" in out


def test_each_run_writes_its_own_folder_and_says_when_it_replaces_one(tmp_path, capsys):
  single = ["--optimizer", "adafactor", "--steps", "3", "--out", str(tmp_path)] + TINY_RUN
  compare = ["--compare", "adafactor", "adamw", "--steps", "3", "--out", str(tmp_path)] + TINY_RUN
  assert main_job.main(single) == 0
  first = capsys.readouterr().out
  assert "replacing" not in first
  assert "How close to AdamW does it train? python -m optax_memopt --compare adamw adafactor" in first
  assert main_job.main(compare) == 0
  assert "replacing" not in capsys.readouterr().out
  assert [row["optimizer"] for row in json.loads((tmp_path / "adafactor" / "results.json").read_text())] == [
    "adafactor"
  ]
  assert [row["optimizer"] for row in json.loads((tmp_path / "adafactor-vs-adamw" / "results.json").read_text())] == [
    "adafactor",
    "adamw",
  ]
  assert main_job.main(single) == 0
  assert f"replacing the results of an earlier run in {tmp_path / 'adafactor'}/" in capsys.readouterr().out


@pytest.mark.parametrize(
  "args, message",
  [
    (["--learning-rate=-1e-3"], "argument --learning-rate: must be a finite number >= 0; got '-1e-3'"),
    (["--learning-rate", "nan"], "argument --learning-rate: must be a finite number >= 0; got 'nan'"),
    (["--learning-rate", "inf"], "argument --learning-rate: must be a finite number >= 0; got 'inf'"),
    (["--steps", "0"], "argument --steps: must be an integer >= 1; got '0'"),
    (["--seq-len", "129"], "--seq-len must be <= 128; got 129"),
    (["--compare", "sgd-with-dreams"], "--compare: unknown optimizer 'sgd-with-dreams'"),
    (["--compare", "adamw", "adamw"], "--compare: adamw is named more than once"),
    (["--optimizer", "adamw", "--compare", "taco"], "argument --compare: not allowed with argument --optimizer"),
  ],
)
def test_main_job_refuses_bad_input_before_training(args, message, tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main_job.main(args + ["--out", str(tmp_path / "results")])
  captured = capsys.readouterr()
  assert exit_info.value.code == 2
  assert f"python -m optax_memopt: error: {message}" in captured.err
  assert captured.out == ""  # Nothing trained.


def test_main_job_refuses_an_unusable_out_folder_before_training(tmp_path, capsys):
  a_file = tmp_path / "notes.txt"
  a_file.write_text("")
  for out, message in (
    (a_file, f"--out {a_file} is a file; name a folder"),
    (a_file / "results", f"--out: cannot create the folder {a_file / 'results'}: Not a directory"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      main_job.main(["--out", str(out)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert message in captured.err and captured.out == ""


def test_learning_rate_zero_is_honoured(tmp_path):
  config = main_job.MODEL_SIZES["tiny"]
  code = main_job.main(
    ["--optimizer", "adamw", "--learning-rate", "0", "--steps", "3", "--out", str(tmp_path)] + TINY_RUN
  )
  (row,) = json.loads((tmp_path / "adamw" / "results.json").read_text())
  assert code == 0 and row["learning_rate"] == 0.0
  # The parameters did not move: the held-out loss is the initial model's.
  graphdef, initial = loop.init_params(config, seed=0)
  held_out = data.split(data.load_corpus("pydoc_topics"))[1]
  expected = loop.evaluate(graphdef, initial, held_out, batch_size=2, seq_len=8)
  np.testing.assert_allclose(row["validation_loss"], expected, rtol=1e-6)


def test_a_diverging_run_is_reported_and_the_comparison_finishes(tmp_path, capsys, monkeypatch):
  # The same huge rate makes AdamW diverge within a few steps but not an AdamW that ignores it.
  monkeypatch.setitem(
    optimizers.OPTIMIZERS,
    "adamw_at_1e-3",
    optimizers.OptimizerSpec(lambda lr, config: optax.adamw(1e-3), 1e-3, "AdamW whatever the rate it is given"),
  )
  code = main_job.main(
    ["--compare", "adamw", "adamw_at_1e-3", "--learning-rate", "1000", "--steps", "6", "--out", str(tmp_path)]
    + TINY_RUN
  )
  captured = capsys.readouterr()
  folder = tmp_path / "adamw-vs-adamw_at_1e-3"
  diverged, steady = json.loads((folder / "results.json").read_text())
  step = diverged["diverged_at_step"]
  assert code == 1
  assert 1 < step <= 6 and len(diverged["train_losses"]) == step - 1
  assert np.all(np.isfinite(diverged["train_losses"])) and diverged["validation_loss"] is None
  assert f"error: adamw: the training loss became nan at step {step} of 6" in captured.err
  assert "error: 1 of 2 runs diverged: adamw" in captured.err
  assert f"| adamw | diverged at step {step} |" in captured.out
  assert steady["diverged_at_step"] is None and np.isfinite(steady["validation_loss"])
  assert (folder / "losses.png").stat().st_size > 0


def test_help_lists_every_default_and_how_to_see_the_time_a_run_takes(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main_job.main(["--help"])
  out = " ".join(capsys.readouterr().out.split())  # Undo argparse's line wrapping.
  assert exit_info.value.code == 0
  assert "(default: neither this nor --compare: adamw and microadam, compared)" in out
  for default in ("2000", "small", "16", "64", "0", "pydoc_topics", "results"):
    assert f"(default: {default})" in out
  assert out.count("(default:") == 9  # Each option's once.
  for name, spec in optimizers.OPTIMIZERS.items():
    assert f"{name} {spec.default_learning_rate:g} " in out
  assert "the progress line shows the pace and the time left" in out


@pytest.mark.parametrize("peak", [-1e-3, float("nan"), float("inf"), "3e-3"])
def test_schedule_refuses_a_peak_that_is_not_a_finite_non_negative_number(peak):
  with pytest.raises(ValueError, match="peak learning rate must be a finite number >= 0"):
    main_job.learning_rate_schedule(peak, 100)


def test_schedule_warms_up_then_decays_to_a_tenth():
  peak, end = 2e-3, 2e-4
  schedule = main_job.learning_rate_schedule(peak, 100)  # 5 warm-up steps, then 95 of cosine.
  for step in (0, 2, 5, 30, 52, 99, 100):
    t = (step - 5) / 95
    expected = peak * step / 5 if step < 5 else end + (peak - end) * (1 + np.cos(np.pi * t)) / 2
    np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-5, err_msg=f"step {step}")
  assert float(main_job.learning_rate_schedule(0.0, 100)(50)) == 0.0
  assert float(main_job.learning_rate_schedule(1.0, 1)(0)) == 0.0  # A one-step run gets a schedule.


@pytest.mark.parametrize("name", sorted(optimizers.OPTIMIZERS))
def test_every_listed_optimizer_builds_and_steps(name):
  config = main_job.MODEL_SIZES["tiny"]
  params = loop.init_params(config, seed=0)[1]
  opt = optimizers.get(name).build(1e-3, config)
  state = opt.init(params)
  updates, _ = jax.jit(opt.update)(jax.tree.map(jnp.ones_like, params), state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
