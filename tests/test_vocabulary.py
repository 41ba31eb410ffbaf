"""optax_memopt.vocabulary_in_float32: which parameters keep float32 AdamW state beside a low-bit AdamW."""

from __future__ import annotations

import jax
import pytest

import optax_memopt
from memopt_tools.training import loop, model


def labels_by_path(labels) -> dict[str, str]:
  return {jax.tree_util.keystr(path): label for path, label in jax.tree_util.tree_leaves_with_path(labels)}


def demo_params():
  config = model.TransformerConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
  return jax.eval_shape(lambda: loop.init_params(config, 0)[1])


def test_the_demo_transformers_embedding_and_head_are_float32_and_nothing_else():
  labels = labels_by_path(optax_memopt.vocabulary_in_float32(demo_params()))
  assert {path for path, label in labels.items() if label == "float32"} == {
    "['embed']['embedding']",
    "['lm_head']['kernel']",
  }
  assert set(labels.values()) == {"float32", "quantized"} and len(labels) == 12


def test_names_choose_the_tensors():
  params = {"embed": {"embedding": 0.0}, "lm_head": {"kernel": 0.0}, "mlp": {"kernel": 0.0}}
  assert optax_memopt.vocabulary_in_float32(params, names=("lm_head",)) == {
    "embed": {"embedding": "quantized"},
    "lm_head": {"kernel": "float32"},
    "mlp": {"kernel": "quantized"},
  }
  assert set(labels_by_path(optax_memopt.vocabulary_in_float32(params, names=())).values()) == {"quantized"}
  with pytest.raises(ValueError, match="names must be a sequence of path substrings"):
    optax_memopt.vocabulary_in_float32(params, names="lm_head")


def test_the_old_import_path_still_works_with_a_deprecation_warning():
  from memopt_tools.training import optimizers

  with pytest.warns(DeprecationWarning, match="optax_memopt.vocabulary.vocabulary_in_float32"):
    old = optimizers.vocabulary_in_float32
  assert old is optax_memopt.vocabulary_in_float32
  with pytest.warns(DeprecationWarning):
    assert optimizers.VOCABULARY_NAMES == ("embed", "lm_head")
