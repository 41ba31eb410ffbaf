"""The model shapes every benchmark measures, shared so the tables line up."""

from __future__ import annotations

import jax
from flax import nnx

from memopt_tools import fit
from memopt_tools.training import model

MODELS = {
  # The main job's default model.
  "demo": model.TransformerConfig(),
  # About 10M parameters: the size the issues' memory targets are stated for.
  "10M": model.TransformerConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_len=256),
  # Tens of millions, for step time.
  "40M": model.TransformerConfig(dim=640, n_layers=8, n_heads=10, n_kv_heads=5, ffn_dim=1792, max_len=256),
  # Hundreds of millions: step time on a GPU, where tens of millions are launch-bound.
  "300M": model.TransformerConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816, max_len=256),
  # The planner's published Llama configurations (``memopt_tools.fit.MODELS``),
  # only ever built abstractly, with jax.eval_shape. Llama-3-8B's 128K-token
  # vocabulary makes the embedding and the head 525M parameters each.
  "llama2_7b": fit.MODELS["llama2_7b"],
  "llama3_8b": fit.MODELS["llama3_8b"],
}


def params(name: str, *, abstract: bool = False, seed: int = 0):
  """The parameters of ``MODELS[name]`` as a plain dict (``ShapeDtypeStruct`` leaves if abstract)."""
  if abstract:
    return fit.abstract_transformer_params(MODELS[name])
  return nnx.to_pure_dict(nnx.split(model.Transformer(MODELS[name], rngs=nnx.Rngs(seed)))[1])


def gradients(params, seed: int = 1):
  """Gradients shaped like ``params``: normal with standard deviation 0.01, one key per leaf."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, p.shape, p.dtype) * 1e-2 for k, p in zip(keys, leaves)])


def count(tree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))
