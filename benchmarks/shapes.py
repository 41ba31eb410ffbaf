"""The model shapes every benchmark measures, shared so the tables line up."""

from __future__ import annotations

import jax
from flax import nnx

from optax_memopt.training import model

MODELS = {
  # The main job's default model.
  "demo": model.TransformerConfig(),
  # About 10M parameters: the size the issues' memory targets are stated for.
  "10M": model.TransformerConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_len=256),
  # Tens of millions, for step time.
  "40M": model.TransformerConfig(dim=640, n_layers=8, n_heads=10, n_kv_heads=5, ffn_dim=1792, max_len=256),
  # Hundreds of millions: step time on a GPU, where tens of millions are launch-bound.
  "300M": model.TransformerConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816, max_len=256),
  # Llama-2-7B: only ever built abstractly, with jax.eval_shape.
  "llama2_7b": model.TransformerConfig(
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_len=4096
  ),
  # Llama-3-8B: a 128K-token vocabulary, so the embedding and the head are
  # 525M parameters each (13% of the model); abstract only.
  "llama3_8b": model.TransformerConfig(
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    max_len=8192,
    rope_base=500_000.0,
  ),
}


def params(name: str, *, abstract: bool = False, seed: int = 0):
  """The parameters of ``MODELS[name]`` as a plain dict (``ShapeDtypeStruct`` leaves if abstract)."""
  build = lambda: nnx.to_pure_dict(nnx.split(model.Transformer(MODELS[name], rngs=nnx.Rngs(seed)))[1])
  return jax.eval_shape(build) if abstract else build()


def gradients(params, seed: int = 1):
  """Gradients shaped like ``params``: normal with standard deviation 0.01, one key per leaf."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, p.shape, p.dtype) * 1e-2 for k, p in zip(keys, leaves)])


def count(tree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))
