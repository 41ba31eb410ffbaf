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

from optax_memopt import __main__ as main_job
from optax_memopt.training import data, loop, model, optimizers


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


def test_random_windows_are_consecutive_text():
  tokens = np.arange(5000, dtype=np.int64)
  batch = next(data.random_windows(tokens, batch_size=4, seq_len=16, seed=np.random.randint(1 << 30)))
  assert batch.shape == (4, 17)
  np.testing.assert_array_equal(np.diff(batch, axis=1), 1)


def test_transformer_is_causal_and_shapes_follow_the_config():
  config = model.TransformerConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48)
  net = model.Transformer(config, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(np.random.randint(1 << 30)), (2, 12), 0, 256)
  logits = net(tokens)
  assert logits.shape == (2, 12, 256)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 256)
  chex.assert_trees_all_close(net(changed)[:, :8], logits[:, :8], atol=1e-5)
  assert not np.allclose(net(changed)[:, 8:], logits[:, 8:])


def test_transformer_config_rejects_bad_heads():
  with pytest.raises(ValueError, match="n_kv_heads"):
    model.TransformerConfig(n_heads=4, n_kv_heads=3)


def test_adamw_learns_the_text():
  result = loop.train(
      main_job.MODEL_SIZES["tiny"], optax.adamw(3e-3), steps=60, batch_size=8, seq_len=32
  )
  # Uniform guessing over bytes costs ln(256) = 5.55 nats; English bytes are
  # far more predictable, so 60 steps must clearly beat it.
  assert result.train_losses[0] > 5.0
  assert np.mean(result.train_losses[-10:]) < 3.6
  assert result.validation_loss < 3.8
  assert result.state_bytes == 8 * result.n_params + 4


def test_main_job_compares_optimizers_and_writes_results(tmp_path, capsys):
  main_job.main([
      "--compare", "adamw", "adafactor", "--steps", "12", "--model-size", "tiny",
      "--batch-size", "4", "--seq-len", "16", "--out", str(tmp_path), "--quiet",
  ])
  out = capsys.readouterr().out
  assert "adamw: train loss" in out and "| adafactor |" in out
  rows = json.loads((tmp_path / "compare.json").read_text())
  assert [r["optimizer"] for r in rows] == ["adamw", "adafactor"]
  assert len(rows[0]["train_losses"]) == 12
  for name in ("compare.png", "compare.md", "adamw.png", "adamw.json", "adafactor.png"):
    assert (tmp_path / name).stat().st_size > 0


def test_main_job_rejects_unknown_optimizer():
  with pytest.raises(SystemExit):
    main_job.main(["--compare", "sgd-with-dreams"])


@pytest.mark.parametrize("name", sorted(optimizers.OPTIMIZERS))
def test_every_listed_optimizer_builds_and_steps(name):
  config = main_job.MODEL_SIZES["tiny"]
  params = loop.init_params(config, seed=0)[1]
  opt = optimizers.get(name).build(1e-3, config)
  state = opt.init(params)
  updates, _ = jax.jit(opt.update)(jax.tree.map(jnp.ones_like, params), state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
