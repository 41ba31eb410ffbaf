"""A small decoder-only Transformer in Flax nnx, shaped like the models users fine-tune.

Llama's layout at toy scale: rotary positions, grouped-query attention,
RMSNorm before each sub-layer, a SwiGLU feed-forward block and an untied
output head. Projections are ``nnx.Linear`` with heads fused into the feature
axis, so a query kernel is ``(dim, n_heads * head_dim)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from optax_memopt.hyperparameters import check_int

# What each decoder layer keeps for the backward pass (``remat``): everything
# ("none"); only the outputs of matrix products without batch dimensions, the
# rest recomputed ("dots"); only the layer's input, the whole layer recomputed
# ("full").
REMAT_POLICIES = {
  "none": None,
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "full": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  vocab_size: int = 256
  dim: int = 64
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  ffn_dim: int = 128
  max_len: int = 128
  rope_base: float = 10_000.0
  remat: str = "none"  # A key of REMAT_POLICIES.

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_len"):
      check_int(name, getattr(self, name), 1)
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}; got {self.remat!r}.")
    if self.dim % self.n_heads:
      raise ValueError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}.")
    if (self.dim // self.n_heads) % 2:
      raise ValueError("dim // n_heads must be even for rotary positions.")

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads


# The sizes the main job trains (``python -m memopt_tools --model-size``) and the planner lists.
MODEL_SIZES = {
  "tiny": TransformerConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64),
  "small": TransformerConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
  "base": TransformerConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=384),
}


def rotate(x: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of ``x`` shaped ``[batch, seq, heads, head_dim]``."""
  seq, head_dim = x.shape[1], x.shape[-1]
  frequencies = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * frequencies[None, :]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  even, odd = x[..., 0::2], x[..., 1::2]
  rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    kv_features = config.n_kv_heads * config.head_dim
    self.query = nnx.Linear(config.dim, config.dim, use_bias=False, rngs=rngs)
    self.key = nnx.Linear(config.dim, kv_features, use_bias=False, rngs=rngs)
    self.value = nnx.Linear(config.dim, kv_features, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(config.dim, config.dim, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    batch, seq, _ = x.shape
    q = self.query(x).reshape(batch, seq, c.n_heads, c.head_dim)
    k = self.key(x).reshape(batch, seq, c.n_kv_heads, c.head_dim)
    v = self.value(x).reshape(batch, seq, c.n_kv_heads, c.head_dim)
    q, k = rotate(q, c.rope_base), rotate(k, c.rope_base)
    group = c.n_heads // c.n_kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(c.head_dim).astype(x.dtype)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, c.dim)
    return self.out(attended)


class FeedForward(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.gate = nnx.Linear(config.dim, config.ffn_dim, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(config.dim, config.ffn_dim, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(config.ffn_dim, config.dim, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.attention = Attention(config, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.mlp = FeedForward(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Maps token ids ``[batch, seq]`` to next-token logits ``[batch, seq, vocab]``."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.dim, rngs=rngs)
    self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
    self.final_norm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.lm_head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    if tokens.shape[-1] > self.config.max_len:
      raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_len={self.config.max_len}.")
    x = self.embed(tokens)
    for layer in self.layers:
      if self.config.remat == "none":
        x = layer(x)
      else:
        x = nnx.remat(lambda block, h: block(h), policy=REMAT_POLICIES[self.config.remat])(layer, x)
    return self.lm_head(self.final_norm(x))


def parameter_count(config: TransformerConfig) -> int:
  """How many parameters ``Transformer(config)`` has, found without allocating them."""
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
