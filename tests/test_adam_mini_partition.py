"""Adam-mini's block partition: the rule every leaf of real Flax models gets.

Covers the library's Llama-style nnx model (``training.model``) with
grouped-query attention (plain and with layers stacked by
``nnx.vmap``/``nnx.scan``), a linen model scanned by ``nn.scan`` with
``DenseGeneral`` attention, the PyTorch-name rules where the reference
crashes, overrides, and the errors that name a parameter.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_memopt
from memopt_tools.training import model
from optax_memopt import BlockRule

CONFIG = model.TransformerConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


class ScannedTransformer(nnx.Module):
  """The library's Transformer with its blocks stacked on a leading layer axis."""

  def __init__(self, config: model.TransformerConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(config.vocab_size, config.dim, rngs=rngs)

    @nnx.split_rngs(splits=config.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked_blocks(rngs):
      return model.Block(config, rngs=rngs)

    self.layers = stacked_blocks(rngs)
    self.final_norm = nnx.RMSNorm(config.dim, rngs=rngs)
    self.lm_head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)

    return self.lm_head(self.final_norm(run(self.embed(tokens), self.layers)))


def llama(scan: bool) -> nnx.Module:
  return (ScannedTransformer if scan else model.Transformer)(CONFIG, rngs=nnx.Rngs(0))


def expected_llama_rows(c: model.TransformerConfig, scan: bool):
  """(shape, rule, blocks) per path, from the config alone."""
  kv_dim = c.n_kv_heads * c.head_dim
  layer = {
    "attention/query/kernel": ((c.dim, c.dim), "per head", c.n_heads),
    "attention/key/kernel": ((c.dim, kv_dim), "per head", c.n_kv_heads),
    "attention/value/kernel": ((c.dim, kv_dim), "per output neuron", kv_dim),
    "attention/out/kernel": ((c.dim, c.dim), "per output neuron", c.dim),
    "attention_norm/scale": ((c.dim,), "whole tensor", 1),
    "mlp/gate/kernel": ((c.dim, c.ffn_dim), "per output neuron", c.ffn_dim),
    "mlp/up/kernel": ((c.dim, c.ffn_dim), "per output neuron", c.ffn_dim),
    "mlp/down/kernel": ((c.ffn_dim, c.dim), "per output neuron", c.dim),
    "mlp_norm/scale": ((c.dim,), "whole tensor", 1),
  }
  rows = {
    "embed/embedding": ((c.vocab_size, c.dim), "per token", c.vocab_size),
    "final_norm/scale": ((c.dim,), "whole tensor", 1),
    "lm_head/kernel": ((c.dim, c.vocab_size), "per output neuron", c.vocab_size),
  }
  for path, (shape, rule, blocks) in layer.items():
    if scan:
      rows[f"layers/{path}"] = ((c.n_layers, *shape), f"{rule}, per layer", c.n_layers * blocks)
    else:
      for i in range(c.n_layers):
        rows[f"layers/{i}/{path}"] = (shape, rule, blocks)
  return rows


def llama_heads(scan):
  """The partition's keyword arguments for ``llama(scan)``: its heads, and its stacked layers when scanned."""
  return dict(n_heads=CONFIG.n_heads, n_kv_heads=CONFIG.n_kv_heads, stacked_modules="layers" if scan else ())


@pytest.mark.parametrize("scan", [False, True], ids=["layer_list", "scanned"])
def test_nnx_llama_gqa_partition_table(scan):
  config, network, kwargs = CONFIG, llama(scan), llama_heads(scan)
  partition = optax_memopt.adam_mini_partition(nnx.state(network, nnx.Param), **kwargs)
  expected = expected_llama_rows(config, scan)
  assert {row.path: (row.shape, row.rule, row.blocks) for row in partition.rows} == expected

  lines = str(partition).splitlines()
  assert lines[0].split() == ["path", "shape", "rule", "blocks"]
  for row, line in zip(partition.rows, lines[2:-1]):
    assert line.startswith(row.path + " ")
    assert f"  {row.shape}  " in line and f"  {row.rule}  " in line
    assert line.endswith(f"  {row.blocks:,}")
  n_params = sum(int(np.prod(shape)) for shape, _, _ in expected.values())
  n_blocks = sum(blocks for _, _, blocks in expected.values())
  assert lines[-1].startswith(f"{len(expected)} tensors, {n_params:,} parameters, {n_blocks:,} blocks")


@pytest.mark.parametrize("scan", [False, True], ids=["layer_list", "scanned"])
def test_nnx_llama_trains_with_state_in_block_shapes(scan):
  config, network, kwargs = CONFIG, llama(scan), llama_heads(scan)
  optimizer = nnx.Optimizer(network, optax_memopt.adam_mini(3e-3, weight_decay=0.1, **kwargs), wrt=nnx.Param)
  partition = optax_memopt.adam_mini_partition(nnx.state(network, nnx.Param), **kwargs)
  nu_shapes = [v.shape for v in jax.tree.leaves(optimizer.opt_state[0].nu)]
  assert nu_shapes == [row.block_shape for row in partition.rows]

  tokens = jax.random.randint(jax.random.key(0), (4, 12), 0, config.vocab_size)

  def loss_fn(network):
    logits = network(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @nnx.jit
  def train_step(network, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(network)
    optimizer.update(network, grads)
    return loss

  losses = [float(train_step(network, optimizer)) for _ in range(8)]
  # Memorising one small batch: any working optimizer lowers the loss.
  assert losses[-1] < losses[0] - 0.1, losses


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    attention = nn.MultiHeadDotProductAttention(num_heads=4, name="attention")
    x = x + attention(nn.RMSNorm(name="attention_norm")(x))
    return x + nn.Dense(32, name="mlp")(x), None


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(50, 32, name="embed")(tokens)
    layers = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
    x, _ = layers(name="layers")(x, None)
    return nn.Dense(50, name="lm_head")(x)


def test_linen_scanned_dense_general_attention_partition():
  params = jax.eval_shape(LinenModel().init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  partition = optax_memopt.adam_mini_partition(params, n_heads=4, stacked_modules="layers")
  rows = {row.path: (row.shape, row.rule, row.block_shape) for row in partition.rows}
  layers = "params/layers/"
  assert rows == {
    "params/embed/embedding": ((50, 32), "per token", (50, 1)),
    "params/lm_head/bias": ((50,), "per element", (50,)),
    "params/lm_head/kernel": ((32, 50), "per output neuron", (1, 50)),
    # (layers, in, heads, head_dim): one block per layer and head.
    layers + "attention/query/kernel": ((3, 32, 4, 8), "per head, per layer", (3, 1, 4, 1)),
    layers + "attention/key/kernel": ((3, 32, 4, 8), "per head, per layer", (3, 1, 4, 1)),
    layers + "attention/value/kernel": ((3, 32, 4, 8), "per output neuron, per layer", (3, 1, 4, 8)),
    # (layers, heads, head_dim, out): one block per layer and output neuron.
    layers + "attention/out/kernel": ((3, 4, 8, 32), "per output neuron, per layer", (3, 1, 1, 32)),
    layers + "attention/query/bias": ((3, 4, 8), "per element", (3, 4, 8)),
    layers + "attention/key/bias": ((3, 4, 8), "per element", (3, 4, 8)),
    layers + "attention/value/bias": ((3, 4, 8), "per element", (3, 4, 8)),
    layers + "attention/out/bias": ((3, 32), "per element", (3, 32)),
    layers + "attention_norm/scale": ((3, 32), "whole tensor, per layer", (3, 1)),
    layers + "mlp/kernel": ((3, 32, 32), "per output neuron, per layer", (3, 1, 32)),
    layers + "mlp/bias": ((3, 32), "per element", (3, 32)),
  }


def test_torch_rules_give_blocks_where_the_reference_crashes():
  params = {
    # A 1-D tensor under a per-neuron name (reference: IndexError).
    "model.layers.0.mlp.scale": jnp.ones(8),
    # A conv weight (out, in, width) under a per-neuron name.
    "model.layers.0.feed_forward.conv.weight": jnp.ones((6, 4, 3)),
    # Fused query/key/value rows: 4 query + 2 key + 2 value heads of 2 rows.
    "model.layers.0.attention.query_key_value.weight": jnp.ones((16, 8)),
    "model.layers.0.self_attn.k_proj.weight": jnp.ones((4, 8)),
    "model.final_layernorm.weight": jnp.ones(8),
  }
  partition = optax_memopt.adam_mini_partition(params, "torch", n_heads=4, n_kv_heads=2)
  rows = {row.path: (row.rule, row.block_shape) for row in partition.rows}
  assert rows == {
    "model.layers.0.mlp.scale": ("whole tensor", (1,)),
    "model.layers.0.feed_forward.conv.weight": ("per output neuron", (6, 1, 1)),
    "model.layers.0.attention.query_key_value.weight": ("per head", (8, 1)),
    "model.layers.0.self_attn.k_proj.weight": ("per head", (2, 1)),
    # Holds the reference's output name "final_layer": 1-D, so one block.
    "model.final_layernorm.weight": ("whole tensor", (1,)),
  }
  optimizer = optax_memopt.adam_mini(1e-2, rules="torch", n_heads=4, n_kv_heads=2)
  updates, _ = jax.jit(optimizer.update)(params, optimizer.init(params), params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_stacked_norm_scale_gets_one_block_per_layer():
  params = {"layers": {"norm": {"scale": jnp.ones((3, 4))}}}
  (row,) = optax_memopt.adam_mini_partition(params, stacked_modules="layers").rows
  assert (row.rule, row.block_shape) == ("whole tensor, per layer", (3, 1))


def test_rule_functions_override_and_fall_through():
  params = {"encoder": {"proj": {"kernel": jnp.ones((6, 4))}}, "decoder": {"proj": {"kernel": jnp.ones((6, 4))}}}

  def whole_encoder(path, leaf):
    del leaf
    return "tensor" if path.startswith("encoder/") else None

  partition = optax_memopt.adam_mini_partition(params, (whole_encoder, "flax"))
  rows = {row.path: (row.rule, row.blocks) for row in partition.rows}
  assert rows == {
    "encoder/proj/kernel": ("whole tensor", 1),
    "decoder/proj/kernel": ("per output neuron", 4),
  }


@pytest.mark.parametrize(
  "params, kwargs, message",
  [
    # A rule returning an unknown name.
    ({"w": jnp.ones(3)}, dict(rules=lambda path, leaf: "per_row"), "unknown rule name 'per_row'"),
    # Nothing matched and no rule set to fall back on.
    ({"w": jnp.ones(3)}, dict(rules=lambda path, leaf: None), "no entry of `rules` matched"),
    # A rule whose axis the leaf lacks.
    ({"w": jnp.ones(3)}, dict(rules=lambda path, leaf: BlockRule("x", keep=(1,))), "'w' has shape"),
    # Heads that do not divide the rows (reference: a reshape error mid-step).
    (
      {"model.q_proj.weight": jnp.ones((30, 8))},
      dict(rules="torch", n_heads=4),
      "'model.q_proj.weight'.*does not divide 30",
    ),
    ({"model.q_proj.weight": jnp.ones((32, 8))}, dict(rules="torch"), "'model.q_proj.weight'.*pass n_heads"),
    # A scanned query kernel without stacked_modules looks like (in, heads, head_dim).
    (
      {"layers": {"query": {"kernel": jnp.ones((2, 16, 16))}}},
      dict(n_heads=4),
      "'layers/query/kernel'.*stacked_modules",
    ),
    ({"layers": {"w": jnp.ones(())}}, dict(stacked_modules="layers"), "fewer axes"),
  ],
)
def test_partition_errors_name_the_parameter(params, kwargs, message):
  with pytest.raises(ValueError, match=message):
    optax_memopt.adam_mini_partition(params, **kwargs)
  with pytest.raises(ValueError, match=message):
    optax_memopt.scale_by_adam_mini(**kwargs).init(params)
