"""Adam-mini against the reference's trajectories, numpy re-derivations and memory formulas.

Generic optimizer properties (jit, dtypes, inject_hyperparams, ...) live in
``test_transformation_properties.py``; the block partition in
``test_adam_mini_partition.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_memopt
from optax_memopt import state_nbytes

# The reference's trajectories (adam-mini 1.1.1), kept in the repository; the
# README beside them says how they were made.
GOLDEN = Path(__file__).resolve().parent / "data" / "adam_mini"


def load_golden(name):
  path = GOLDEN / f"{name}.npz"
  if not path.exists():
    pytest.fail(f"golden data {path} is missing: it is part of the repository (tests/data/adam_mini)")
  data = np.load(path)
  return data, json.loads(str(data["meta"]))


def torch_to_flax(name, array):
  """Golden torch names and (out, in) weights as a Flax-layout nested dict entry."""
  parts = name.split(".")
  if name == "model.embed_tokens.weight":
    return ("embed", "embedding"), array
  if name == "lm_head.weight":
    return ("lm_head", "kernel"), array.T
  if name == "model.norm.weight":
    return ("final_norm", "scale"), array
  if name == "model.position_scale":
    return ("position_scale",), array
  layer = f"layers_{parts[2]}"
  if parts[3] == "self_attn":
    module = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "out"}[parts[4]]
    if parts[5] == "bias":
      return (layer, "attention", module, "bias"), array
    return (layer, "attention", module, "kernel"), array.T
  if parts[3] == "mlp":
    return (layer, "mlp", parts[4].removesuffix("_proj"), "kernel"), array.T
  norm = {"input_layernorm": "attention_norm", "post_attention_layernorm": "mlp_norm"}
  return (layer, norm[parts[3]], "scale"), array


def nest(flat):
  tree = {}
  for keys, value in flat.items():
    node = tree
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = value
  return tree


def replay(data, meta, layout):
  """Runs the public alias over the golden gradients; yields (step, ours, theirs) per tensor."""
  names = meta["names"]
  if layout == "torch":
    convert, rules = (lambda name, array: (name, array)), "torch"
    build = lambda flat: dict(flat)
    read = lambda tree, key: tree[key]
  else:
    convert, rules = (lambda name, array: torch_to_flax(name, array)), "flax"
    build = nest
    read = lambda tree, keys: _get(tree, keys)
  keys = {name: convert(name, data[f"init/{name}"])[0] for name in names}
  params = build({keys[n]: jnp.asarray(convert(n, data[f"init/{n}"])[1]) for n in names})
  optimizer = optax_memopt.adam_mini(
    meta["lr"],
    meta["b1"],
    meta["b2"],
    meta["eps"],
    meta["weight_decay"],
    rules=rules,
    n_heads=meta["n_heads"],
    n_kv_heads=meta["n_kv_heads"],
  )
  state = optimizer.init(params)
  update = jax.jit(optimizer.update)
  for step in range(1, meta["steps"] + 1):
    grads = build({keys[n]: jnp.asarray(convert(n, data[f"grad/{step}/{n}"])[1]) for n in names})
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    for name in names:
      expected = convert(name, data[f"param/{step}/{name}"])[1]
      yield step, name, np.asarray(read(params, keys[name])), expected


def _get(tree, keys):
  for key in keys:
    tree = tree[key]
  return tree


@pytest.mark.parametrize("layout", ["torch", "flax"])
def test_float64_matches_reference_to_1e12(layout):
  data, meta = load_golden("llama_gqa_f64")
  with jax.enable_x64(True):
    for step, name, ours, theirs in replay(data, meta, layout):
      assert ours.dtype == np.float64
      np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12, err_msg=f"{layout} step {step} {name}")


@pytest.mark.parametrize("layout", ["torch", "flax"])
def test_float32_matches_reference_to_1e5_relative(layout):
  data, meta = load_golden("llama_gqa_f32")
  for step, name, ours, theirs in replay(data, meta, layout):
    assert ours.dtype == np.float32
    # Relative to the tensor's scale: single elements near zero carry the
    # absolute float32 rounding of their neighbours.
    error = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
    assert error < 1e-5, f"{layout} step {step} {name}: relative error {error:.2e}"


def numpy_adam_mini(param_grads, block_axes, b1, b2, eps):
  """Adam-mini in float64 numpy: block means over ``block_axes`` of a reshaped view."""
  m = v = None
  for t, (grad, view) in enumerate(param_grads, start=1):
    g = grad.astype(np.float64).reshape(view)
    m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
    block = np.mean(g * g, axis=block_axes, keepdims=True)
    v = (1 - b2) * block if v is None else b2 * v + (1 - b2) * block
    h = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
    direction = (m / (1 - b1**t) / h).reshape(grad.shape)
  return direction


# (params path, shape, numpy view of one leaf, axes averaged within a block)
FLAX_CASES = [
  (("dense", "kernel"), (12, 10), (12, 10), (0,)),
  (("attn", "query", "kernel"), (12, 3, 4), (12, 3, 4), (0, 2)),  # DenseGeneral
  (("attn", "key", "kernel"), (12, 8), (12, 2, 4), (0, 2)),  # fused, overridden
  (("attn", "value", "kernel"), (12, 3, 4), (12, 3, 4), (0,)),
  (("attn", "out", "kernel"), (3, 4, 12), (3, 4, 12), (0, 1)),
  (("embed", "embedding"), (7, 12), (7, 12), (1,)),
  (("norm", "scale"), (12,), (12,), (0,)),
  (("dense", "bias"), (10,), (10,), ()),
  (("conv", "kernel"), (3, 3, 2, 5), (3, 3, 2, 5), (0, 1, 2)),
  # Stacked by scan (stacked_modules="blocks"): axis 0 is the layer.
  (("blocks", "mlp", "kernel"), (2, 12, 6), (2, 12, 6), (1,)),
  (("blocks", "query", "kernel"), (2, 12, 12), (2, 12, 3, 4), (1, 3)),
]


def test_flax_rules_match_numpy_rederivation_over_steps(seed):
  rng = np.random.default_rng(seed)
  b1, b2, eps = 0.8, 0.9, 1e-6
  params = nest({keys: jnp.zeros(shape) for keys, shape, _, _ in FLAX_CASES})

  def two_key_heads(path, leaf):
    del leaf
    return optax_memopt.BlockRule("per head", split=(-1, 2)) if path == "attn/key/kernel" else None

  optimizer = optax_memopt.scale_by_adam_mini(
    b1, b2, eps, rules=(two_key_heads, "flax"), n_heads=3, stacked_modules="blocks"
  )
  state = optimizer.init(params)
  history = []
  for _ in range(3):
    grads = {
      keys: rng.normal(size=shape).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0])
      for keys, shape, _, _ in FLAX_CASES
    }
    history.append(grads)
    updates, state = jax.jit(optimizer.update)(nest(grads), state)
  for keys, _, view, block_axes in FLAX_CASES:
    expected = numpy_adam_mini([(grads[keys], view) for grads in history], block_axes, b1, b2, eps)
    np.testing.assert_allclose(
      _get(updates, keys),
      expected,
      rtol=2e-5,
      atol=1e-6,
      err_msg=f"{'/'.join(keys)} (seed {seed})",
    )


def test_state_shapes_and_mu_dtype():
  params = {"dense": {"kernel": jnp.zeros((6, 5)), "bias": jnp.zeros(5)}, "norm": {"scale": jnp.zeros(6, jnp.bfloat16)}}
  state = optax_memopt.scale_by_adam_mini(mu_dtype=jnp.bfloat16).init(params)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state.nu) == {
    "dense": {"kernel": ((1, 5), jnp.float32), "bias": ((5,), jnp.float32)},
    # v stays at least float32 however narrow the parameter.
    "norm": {"scale": ((1,), jnp.float32)},
  }
  assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(state.mu))
  assert state.count.dtype == jnp.int32


def golden_shaped_params(dtype):
  data, meta = load_golden("llama_gqa_f32")
  return {n: jnp.zeros(data[f"init/{n}"].shape, dtype) for n in meta["names"]}, meta


def blocks_of_golden_model(meta):
  """Adam-mini blocks of the golden Llama model, counted from its config."""
  dim, heads, kv_heads, ffn, vocab = (meta[k] for k in ("dim", "n_heads", "n_kv_heads", "ffn", "vocab"))
  head_dim = dim // heads
  per_layer = heads + kv_heads + kv_heads * head_dim + dim + 2 * ffn + dim + 2
  # embed, lm_head: one per token; final norm and position_scale: one each.
  return meta["n_layers"] * per_layer + 2 * vocab + 2


def test_float32_state_bytes_are_adamw_times_n_plus_b_over_2n():
  params, meta = golden_shaped_params(jnp.float32)
  n = sum(p.size for p in jax.tree.leaves(params))
  b = blocks_of_golden_model(meta)
  count_bytes = 4
  ours = (
    state_nbytes(jax.eval_shape(optax_memopt.adam_mini(1e-3, rules="torch", n_heads=4, n_kv_heads=2).init, params))
    - count_bytes
  )
  adamw = state_nbytes(jax.eval_shape(optax.adamw(1e-3).init, params)) - count_bytes
  assert ours * 2 * n == adamw * (n + b)
  assert ours == 4 * (n + b)


def test_bfloat16_mu_halves_the_state_again():
  params, meta = golden_shaped_params(jnp.float32)
  n = sum(p.size for p in jax.tree.leaves(params))
  b = blocks_of_golden_model(meta)
  optimizer = optax_memopt.adam_mini(1e-3, rules="torch", n_heads=4, n_kv_heads=2, mu_dtype=jnp.bfloat16)
  ours = state_nbytes(jax.eval_shape(optimizer.init, params)) - 4
  assert ours == 2 * n + 4 * b


def llama2_7b_torch_shapes(dtype=jnp.float32):
  vocab, dim, layers, ffn = 32000, 4096, 32, 11008
  shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
  for i in range(layers):
    prefix = f"model.layers.{i}."
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      shapes[prefix + f"self_attn.{proj}.weight"] = (dim, dim)
    shapes[prefix + "mlp.gate_proj.weight"] = (ffn, dim)
    shapes[prefix + "mlp.up_proj.weight"] = (ffn, dim)
    shapes[prefix + "mlp.down_proj.weight"] = (dim, ffn)
    shapes[prefix + "input_layernorm.weight"] = (dim,)
    shapes[prefix + "post_attention_layernorm.weight"] = (dim,)
  return {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape in shapes.items()}


def test_llama2_7b_state_bytes_halve_adamw():
  params = llama2_7b_torch_shapes()
  n = sum(int(np.prod(p.shape)) for p in params.values())
  assert n == 6_738_415_616
  # Per layer: q, k one block per head (32 each), v, o, down one per output
  # neuron (4096 each), gate and up one per neuron (11008 each), two norms;
  # embed and lm_head one per token; the final norm one.
  b = 32 * (32 + 32 + 3 * 4096 + 2 * 11008 + 2) + 2 * 32000 + 1
  optimizer = optax_memopt.adam_mini(1e-3, rules="torch", n_heads=32)
  ours = state_nbytes(jax.eval_shape(optimizer.init, params))
  adamw = state_nbytes(jax.eval_shape(optax.adamw(1e-3).init, params))
  assert adamw == 8 * n + 4  # 53.91 GB (the paper rounds to 53.92 GB)
  assert ours == 4 * (n + b) + 4  # 26.96 GB
  assert round(ours / 1e9, 2) == 26.96


def test_weight_decay_uses_the_old_parameter_and_skips_norms_and_biases(seed):
  rng = np.random.default_rng(seed)
  lr, wd, b1, b2, eps = 0.1, 0.5, 0.9, 0.999, 1e-8
  # (path, shape, block axes of the Flax rules, decayed by the reference's mask)
  leaves = {
    ("dense", "kernel"): ((4, 3), (0,), True),  # per output neuron
    ("dense", "bias"): ((3,), (), False),  # per element
    ("ln_f", "scale"): ((3,), (0,), False),  # whole tensor
  }
  params = {keys: rng.normal(size=shape) for keys, (shape, _, _) in leaves.items()}
  grads = [{keys: rng.normal(size=shape) for keys, (shape, _, _) in leaves.items()} for _ in range(3)]
  optimizer = optax_memopt.adam_mini(lr, b1, b2, eps, weight_decay=wd)
  ours = nest({keys: jnp.asarray(p, jnp.float32) for keys, p in params.items()})
  state = optimizer.init(ours)
  for step in range(1, len(grads) + 1):
    updates, state = optimizer.update(
      nest({keys: jnp.asarray(g, jnp.float32) for keys, g in grads[step - 1].items()}), state, ours
    )
    ours = optax.apply_updates(ours, updates)
  for keys, (shape, block_axes, decayed) in leaves.items():
    # p_t = p_{t-1} - lr * (u_t + wd * p_{t-1}): the decay reads p_{t-1}.
    old, new = params[keys], params[keys]
    for step in range(1, len(grads) + 1):
      history = [(g[keys], shape) for g in grads[:step]]
      direction = numpy_adam_mini(history, block_axes, b1, b2, eps)
      old = old - lr * (direction + wd * decayed * old)
      new = (new - lr * direction) * (1 - lr * wd * decayed)  # decaying the stepped parameter
    message = f"{'/'.join(keys)} (seed {seed})"
    np.testing.assert_allclose(_get(ours, keys), old, rtol=1e-5, atol=1e-6, err_msg=message)
    if decayed:  # The other order is far outside the tolerance.
      assert np.max(np.abs(new - old)) > 1e-3, message


@pytest.mark.parametrize(
  "kwargs, static_args, traced",
  [
    (dict(n_heads=4), (), "n_heads"),
    (dict(n_heads=4, n_kv_heads=2), ("n_heads",), "n_kv_heads"),
    # A type: inject_hyperparams takes it for a schedule and calls it.
    (dict(n_heads=4, mu_dtype=jnp.bfloat16), ("n_heads",), "mu_dtype"),
  ],
)
def test_traced_shape_fixing_hyperparameter_is_named_with_static_args(kwargs, static_args, traced):
  params = {"attention": {"query": {"kernel": jnp.zeros((8, 8))}}}
  injected = optax.inject_hyperparams(optax_memopt.adam_mini, static_args=static_args)
  with pytest.raises(ValueError, match=rf"{traced}.*static_args=\('{traced}',\)"):
    injected(learning_rate=1e-3, **kwargs).init(params)
  static = optax.inject_hyperparams(optax_memopt.adam_mini, static_args=tuple(kwargs))
  state = static(learning_rate=1e-3, **kwargs).init(params).inner_state[0]
  plain = optax_memopt.scale_by_adam_mini(**kwargs).init(params)
  assert jax.tree.map(jnp.shape, state.nu) == jax.tree.map(jnp.shape, plain.nu)
  assert jax.tree.map(lambda m: m.dtype, state.mu) == jax.tree.map(lambda m: m.dtype, plain.mu)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(b1=1.0), "b1"),
    (dict(b2=-0.1), "b2"),
    (dict(eps=-1.0), "eps"),
    (dict(n_heads=0), "n_heads"),
    (dict(n_heads=8, n_kv_heads=3), "n_kv_heads=3 must divide"),
    (dict(n_kv_heads=2), "needs n_heads"),
    (dict(rules="pytorch"), "unknown rule set 'pytorch'"),
    (dict(rules=("flax", 3)), "rules"),
    (dict(stacked_modules=("layers", "")), "stacked_modules"),
  ],
)
def test_bad_arguments_raise_at_build_time(kwargs, message):
  with pytest.raises(ValueError, match=message):
    optax_memopt.scale_by_adam_mini(**kwargs)


def test_steps_under_optax_partition_when_no_parameter_is_routed_to_it():
  params = {"dense": {"kernel": jnp.ones((4, 3))}, "layers": (jnp.ones(3), None)}
  grads = jax.tree.map(lambda p: 2 * p, params)
  labels = {"dense": {"kernel": "adam"}, "layers": ("adam", None)}
  tx = optax.partition({"adam_mini": optax_memopt.scale_by_adam_mini(), "adam": optax.scale_by_adam()}, labels)
  updates, _ = tx.update(grads, tx.init(params))
  adam = optax.scale_by_adam()
  chex.assert_trees_all_close(updates, adam.update(grads, adam.init(params))[0])


def test_integer_parameter_is_refused_at_init_naming_it():
  params = {"dense": {"kernel": jnp.zeros((4, 3))}, "step": {"table": jnp.zeros((2, 3), jnp.int32)}}
  with pytest.raises(ValueError, match=r"adam_mini supports floating-point and complex .* 'step/table' is int32"):
    optax_memopt.adam_mini(1e-3).init(params)


def test_trains_the_small_transformer_about_as_well_as_adamw():
  from memopt_tools.training import loop, model

  config = model.TransformerConfig()
  run = dict(steps=120, batch_size=8, seq_len=64, seed=0)
  adamw = loop.train(config, optax.adamw(3e-3, weight_decay=0.01), **run)
  ours = loop.train(
    config,
    optax_memopt.adam_mini(3e-3, weight_decay=0.01, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads),
    **run,
  )
  # Byte-level cross-entropy starts near ln(256) = 5.5; both must learn far
  # below it, Adam-mini within 5% of AdamW, with about half its state.
  assert adamw.validation_loss < 3.0
  assert ours.validation_loss < 1.05 * adamw.validation_loss, (ours.validation_loss, adamw.validation_loss)
  assert ours.state_bytes < 0.55 * adamw.state_bytes
