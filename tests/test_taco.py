"""What is specific to TACO: the direction against numpy, the heavy-hitter state, routing, errors, training."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_memopt
from memopt_tools.training import loop, model
from optax_memopt import MatrixAxes
from tests.test_gpu_compile import gpu_compile, needs_plugin


def numpy_direction(u, batch_dims=0, input_dims=1):
  """TACO's direction for ``u`` as ``(*batch, n_in, n_out)`` matrices: per row, the sign of the first largest |u|."""
  shape = u.shape
  n_in = int(np.prod(shape[batch_dims : batch_dims + input_dims]))
  rows = np.asarray(u, np.float64).reshape(-1, int(np.prod(shape[batch_dims + input_dims :])))
  n_out = rows.shape[1]
  top = np.argmax(np.abs(rows), axis=1)  # the first maximum: ties toward the lower index
  direction = np.zeros_like(rows, np.float32)
  direction[np.arange(len(rows)), top] = np.float32(n_out / n_in) * np.sign(rows[np.arange(len(rows)), top])
  return direction.reshape(shape)


def first_by_magnitude(u, columns):
  """``columns`` by decreasing |u|, then increasing column."""
  return columns[np.lexsort((columns, -np.abs(u[columns])))]


def numpy_heavy_hitters(grads, k, beta, segments=1):
  """The merge rule on one ``(n_in, n_out)`` matrix per step, in float64, without quantization.

  Rows are cut into ``segments`` parts of ``ceil(n_out / segments)`` columns, each keeping
  ``min(k // segments, last part's width)`` entries. Returns each step's direction and the
  final tracked (columns, momenta) per row: segment by segment, each by decreasing
  |momentum| then increasing column.
  """
  n_in, n_out = grads[0].shape
  width = -(-n_out // segments)
  starts = range(0, n_out, width)
  per_segment = min(k // segments, n_out - starts[-1])
  tracked = [dict() for _ in range(n_in)]
  directions = []
  for g in grads:
    direction = np.zeros((n_in, n_out), np.float32)
    for row in range(n_in):
      u = (1 - beta) * g[row].astype(np.float64)
      for column, momentum in tracked[row].items():
        u[column] += beta * momentum
      kept = [
        c for start in starts for c in first_by_magnitude(u, np.arange(start, min(start + width, n_out)))[:per_segment]
      ]
      tracked[row] = {int(c): u[c] for c in kept}
      top = first_by_magnitude(u, np.arange(n_out))[0]
      direction[row, top] = np.float32(n_out / n_in) * np.sign(u[top])
    directions.append(direction)
  columns = np.array([list(t) for t in tracked])
  momenta = np.array([list(t.values()) for t in tracked])
  return directions, columns, momenta


def dequantized(state_momentum, state_scale):
  return np.asarray(state_momentum, np.float32) * np.asarray(state_scale, np.float32)


def ternary_grads(seed, steps, shape):
  """Entries in {-1, 0, 1}: with beta = 1/2, four steps of momentum are multiples of 1/16 up to 15/16, exact in e4m3."""
  rng = np.random.default_rng(seed)
  return [rng.integers(-1, 2, shape).astype(np.float32) for _ in range(steps)]


def assert_exact_in_float8(values, seed):
  # The precondition of the exact comparisons below, checked rather than assumed.
  values = np.asarray(values, np.float64)
  scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(values).max(-1, keepdims=True), 1e-30) / 448))
  codes = (values / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  np.testing.assert_array_equal(codes * scale, values, err_msg=f"seed={seed}: not exact in e4m3")


AXES_BY_NAME = {
  "dense": MatrixAxes(),  # (in, out)
  "dense_general": MatrixAxes(),  # (in, heads, head_dim) -> (in, heads * head_dim)
  "stacked": MatrixAxes(batch_dims=1),  # (layers, in, out)
  "attention_out": MatrixAxes(input_dims=2),  # (heads, head_dim, out)
}
SHAPES = {"dense": (5, 7), "dense_general": (3, 4, 2), "stacked": (2, 3, 5), "attention_out": (2, 3, 4)}


def axes_by_name(path, param):
  del param
  return AXES_BY_NAME[path[0].key]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vanilla_direction_is_the_signed_argmax_per_input_feature(dtype, seed):
  rng = np.random.default_rng(seed)
  # Small integers: many ties, which must go to the lower output index.
  grads = {name: rng.integers(-3, 4, shape).astype(np.float32) for name, shape in SHAPES.items()}
  tx = optax_memopt.scale_by_taco(k=0, matrix_axes=axes_by_name)
  jax_grads = jax.tree.map(lambda g: jnp.asarray(g, dtype), grads)
  updates, state = jax.jit(tx.update)(jax_grads, tx.init(jax_grads))
  for name, g in grads.items():
    axes = AXES_BY_NAME[name]
    want = numpy_direction(g, axes.batch_dims, axes.input_dims).astype(dtype)
    assert updates[name].dtype == dtype
    np.testing.assert_array_equal(updates[name], want, err_msg=f"{name}, seed={seed}")
  assert optax_memopt.state_nbytes(state) == 4  # stateless: the step count only
  # The alias steps against the direction, scaled by the learning rate.
  alias = optax_memopt.taco(0.5, k=0, labels=jax.tree.map(lambda _: "taco", grads), matrix_axes=axes_by_name)
  alias_updates, _ = alias.update(jax_grads, alias.init(jax_grads), jax_grads)
  chex.assert_trees_all_close(alias_updates, jax.tree.map(lambda u: -0.5 * u, updates), custom_message=f"seed={seed}")


@pytest.mark.parametrize("segments", [1, None])  # the row's top k; k parts of one (the default)
def test_heavy_hitter_state_stays_valid(segments, seed):
  rng = np.random.default_rng(seed)
  shapes = {"wide": (24, 40), "narrow": (8, 3), "stacked": (2, 16, 50)}
  k = 5
  tx = optax_memopt.scale_by_taco(
    k=k,
    beta=0.9,
    segments=segments,
    matrix_axes=lambda path, p: MatrixAxes(batch_dims=int(path[0].key == "stacked")),
  )
  params = {name: jnp.zeros(shape) for name, shape in shapes.items()}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(6):
    grads = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in shapes.items()}
    updates, state = update(grads, state)
  for name, shape in shapes.items():
    n_out = shape[-1]
    # At most k entries per torch column: one part of min(k, n_out), or
    # parts of ceil(n_out / k) columns with one each (fewer than k when
    # n_out < k).
    if segments == 1:
      parts, per_part = 1, min(k, n_out)
    else:
      parts, per_part = -(-n_out // -(-n_out // k)), 1
    slots = parts * per_part
    index, codes, scale = state.indices[name], state.mu[name], state.scales[name]
    message = f"{name}, seed={seed}"
    assert index.shape == (*shape[:-1], parts, per_part) and index.dtype == jnp.int16, message
    assert codes.shape == index.shape and codes.dtype == jnp.float8_e4m3fn, message
    assert scale.shape == (*shape[:-1], 1) and scale.dtype == jnp.bfloat16, message
    index = np.asarray(index).reshape(-1, slots)
    assert index.min() >= 0 and index.max() < n_out, message
    assert all(len(set(row)) == slots for row in index), message  # distinct per row
    momentum = dequantized(codes, scale[..., None]).reshape(-1, slots)
    scale = np.asarray(scale, np.float32)
    assert np.all(np.isfinite(momentum)) and np.all(np.isfinite(scale)) and np.all(scale > 0), message
    assert np.all(np.log2(scale) == np.round(np.log2(scale))), message  # powers of two
    # The step lands on a tracked entry of the largest momentum, signed like it.
    direction = np.asarray(updates[name]).reshape(-1, n_out)
    n_in = shape[-2]
    assert np.all(np.count_nonzero(direction, axis=1) == 1), message
    step_column = np.argmax(np.abs(direction), axis=1)
    step_slot = np.argmax(index == step_column[:, None], axis=1)
    assert np.all(index[np.arange(len(index)), step_slot] == step_column), message
    stepped = momentum[np.arange(len(index)), step_slot]
    np.testing.assert_array_equal(np.abs(stepped), np.abs(momentum).max(axis=1), message)
    np.testing.assert_array_equal(
      direction[np.arange(len(index)), step_column], np.float32(n_out / n_in) * np.sign(stepped), message
    )


@pytest.mark.parametrize("segments", [1, None])
@pytest.mark.parametrize("shape", [(6, 5), (4, 8)])
def test_tracking_every_output_is_momentum_then_vanilla_selection(shape, segments, seed):
  beta, steps = 0.5, 4
  grads = ternary_grads(seed, steps, shape)
  # k >= n_out: every entry tracked, in one part or in parts of one column.
  tx = optax_memopt.scale_by_taco(k=8, beta=beta, segments=segments)
  state = tx.init({"w": jnp.zeros(shape)})
  momentum = np.zeros(shape)
  for g in grads:
    momentum = beta * momentum + (1 - beta) * g
    assert_exact_in_float8(momentum, seed)
    updates, state = tx.update({"w": jnp.asarray(g)}, state)
    np.testing.assert_array_equal(updates["w"], numpy_direction(momentum), err_msg=f"seed={seed}")
  stored = np.zeros(shape)
  np.put_along_axis(
    stored,
    np.asarray(state.indices["w"], np.int64).reshape(shape[0], -1),
    dequantized(state.mu["w"], state.scales["w"][..., None]).reshape(shape[0], -1),
    axis=1,
  )
  np.testing.assert_array_equal(stored, momentum, err_msg=f"seed={seed}")


def assert_steps_follow_the_merge_rule(seed, shape, k, segments, dtype=jnp.float32):
  """Four steps of ternary gradients with beta = 1/2 (exact in e4m3) against ``numpy_heavy_hitters``."""
  beta, steps = 0.5, 4
  grads = ternary_grads(seed, steps, shape)
  want_directions, want_columns, want_momenta = numpy_heavy_hitters(grads, k, beta, segments)
  assert_exact_in_float8(want_momenta, seed)
  tx = optax_memopt.scale_by_taco(k=k, beta=beta, segments=segments)
  state = tx.init({"w": jnp.zeros(shape, dtype)})
  update = jax.jit(tx.update)
  for step, (g, want) in enumerate(zip(grads, want_directions)):
    updates, state = update({"w": jnp.asarray(g, dtype)}, state)
    np.testing.assert_array_equal(updates["w"], want, err_msg=f"step {step}, seed={seed}")
  rows = shape[0]
  np.testing.assert_array_equal(state.indices["w"].reshape(rows, -1), want_columns, err_msg=f"seed={seed}")
  np.testing.assert_array_equal(
    dequantized(state.mu["w"], state.scales["w"][..., None]).reshape(rows, -1),
    want_momenta,
    err_msg=f"seed={seed}",
  )


@pytest.mark.parametrize(
  "k, segments",
  [
    (3, 1),  # the row's top 3
    (4, 2),  # two segments of 5 columns, 2 entries each
    (3, 3),  # segments of 4, 4 and 2 columns, 1 entry each
    (8, 4),  # segments of 3, 3, 3 and 1 columns: the last one caps them at 1 entry
  ],
)
def test_partial_tracking_follows_the_merge_rule(k, segments, seed):
  assert_steps_follow_the_merge_rule(seed, (6, 10), k, segments)


def test_stacked_layers_are_independent_matrices(seed):
  rng = np.random.default_rng(seed)
  stacked = optax_memopt.scale_by_taco(k=3, matrix_axes=MatrixAxes(batch_dims=1))
  single = optax_memopt.scale_by_taco(k=3)
  layers = 3
  stacked_state = stacked.init({"w": jnp.zeros((layers, 6, 10))})
  single_states = [single.init({"w": jnp.zeros((6, 10))}) for _ in range(layers)]
  for _ in range(3):
    g = jnp.asarray(rng.standard_normal((layers, 6, 10)), jnp.float32)
    stacked_updates, stacked_state = stacked.update({"w": g}, stacked_state)
    for layer in range(layers):
      updates, single_states[layer] = single.update({"w": g[layer]}, single_states[layer])
      np.testing.assert_array_equal(stacked_updates["w"][layer], updates["w"], err_msg=f"seed={seed}")


@pytest.mark.parametrize("k, segments", [(4, 1), (4, 2), (3, 3)])
def test_bfloat16_rows_step_like_the_numpy_reference(k, segments, seed):
  # Parts of 300, 150 or 100 columns.
  assert_steps_follow_the_merge_rule(seed, (5, 300), k, segments, jnp.bfloat16)


@pytest.mark.parametrize(
  "kwargs, static_args, traced",
  [
    (dict(k=4), (), "k"),
    (dict(k=4, segments=2), ("k",), "segments"),
  ],
)
def test_traced_shape_fixing_hyperparameter_is_named_with_static_args(kwargs, static_args, traced):
  params = {"w": jnp.zeros((6, 8))}
  injected = optax.inject_hyperparams(optax_memopt.taco, static_args=static_args)
  with pytest.raises(ValueError, match=rf"{traced}.*static_args=\('{traced}',\)"):
    injected(learning_rate=1e-2, **kwargs).init(params)
  static = optax.inject_hyperparams(optax_memopt.taco, static_args=tuple(kwargs))
  state = static(learning_rate=1e-2, **kwargs).init(params)
  plain = optax_memopt.taco(1e-2, **kwargs).init(params)
  assert jax.tree.map(jnp.shape, state.inner_state) == jax.tree.map(jnp.shape, plain)


def test_no_parameter_routed_to_taco_leaves_its_state_empty():
  params = {"bias": jnp.ones(4), "norm": jnp.ones(4)}
  tx = optax_memopt.taco(1e-2, k=2)
  state = tx.init(params)
  updates, _ = tx.update(params, state, params)
  chex.assert_trees_all_close(updates, optax.adam(1e-2).update(params, optax.adam(1e-2).init(params))[0])


def test_state_is_a_few_hundredths_of_a_byte_per_parameter():
  k = 16  # the default
  shapes = {"attention": (1024, 1024), "up": (1024, 4096), "down": (4096, 1024)}
  params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
  state = jax.eval_shape(optax_memopt.scale_by_taco().init, params)
  n_params = sum(np.prod(s) for s in shapes.values())
  # Per input feature: k int16 indices, k float8 momenta, one bfloat16 scale.
  per_row = k * (2 + 1) + 2
  assert optax_memopt.state_nbytes(state) == sum(s[0] for s in shapes.values()) * per_row + 4
  for shape in shapes.values():
    single = jax.eval_shape(optax_memopt.scale_by_taco().init, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
    assert optax_memopt.state_nbytes(single) / np.prod(shape) < 0.05
  assert optax_memopt.state_nbytes(state) / n_params < 0.05


def make_tree():
  return {
    "embed": {"embedding": jnp.ones((50, 8))},
    "wte": jnp.ones((50, 8)),  # GPT-2's token table
    "dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.ones((4,))},
    "attention": {"query": {"kernel": jnp.ones((8, 2, 4))}},
    "norm": {"scale": jnp.ones((8,))},
    "temperature": jnp.ones(()),
  }


def test_labels_route_vectors_scalars_and_embeddings_to_the_fallback():
  labels = optax_memopt.taco_labels(make_tree())
  assert labels == {
    "embed": {"embedding": "fallback"},
    "wte": "fallback",
    "dense": {"kernel": "taco", "bias": "fallback"},
    "attention": {"query": {"kernel": "taco"}},
    "norm": {"scale": "fallback"},
    "temperature": "fallback",
  }
  with_embeddings = optax_memopt.taco_labels(make_tree(), embedding_names=())
  assert with_embeddings["embed"]["embedding"] == "taco" and with_embeddings["wte"] == "taco"
  # A stacked bias (layers, out) has no output axis left after the batch axis.
  stacked = optax_memopt.taco_labels(
    {"bias": jnp.ones((2, 4)), "kernel": jnp.ones((2, 8, 4))}, matrix_axes=MatrixAxes(batch_dims=1)
  )
  assert stacked == {"bias": "fallback", "kernel": "taco"}


def run_steps(tx, params, steps=3, seed=0):
  rng = np.random.default_rng(seed)
  state = tx.init(params)
  all_updates = []
  for _ in range(steps):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    all_updates.append(updates)
  return all_updates


def test_fallback_trains_like_adamw_and_labels_can_be_overridden(seed):
  params = make_tree()
  lr, weight_decay = 1e-2, 0.1
  adamw = run_steps(optax.adamw(lr, weight_decay=weight_decay), params, seed=seed)

  labels = optax_memopt.taco_labels(params)
  labels["dense"]["kernel"] = "fallback"  # a user override
  labels["embed"]["embedding"] = "taco"
  for tx in (
    optax_memopt.taco(lr, weight_decay=weight_decay, labels=labels),
    optax_memopt.taco(lr, weight_decay=weight_decay, labels=lambda p: labels),
  ):
    taco = run_steps(tx, params, seed=seed)
    for step_taco, step_adamw in zip(taco, adamw):
      for path in (("dense", "kernel"), ("dense", "bias"), ("norm", "scale"), ("wte",)):
        got, want = step_taco, step_adamw
        for key in path:
          got, want = got[key], want[key]
        chex.assert_trees_all_close(got, want, rtol=1e-6, custom_message=f"{path}, seed={seed}")
    # The embedding now takes TACO's step: beyond the weight decay, one entry
    # per row moves.
    decay_only = -lr * weight_decay * np.asarray(params["embed"]["embedding"])
    moved = ~np.isclose(taco[0]["embed"]["embedding"], decay_only, rtol=1e-5, atol=0)
    assert np.all(moved.sum(axis=1) == 1), f"seed={seed}"


def leaf_pairs(labels, *trees):
  """(path, label, leaf of each tree) for every labelled parameter."""
  flat = [jax.tree_util.tree_leaves_with_path(tree) for tree in trees]
  return [
    (jax.tree_util.keystr(path), label, *(leaves[i][1] for leaves in flat))
    for i, (path, label) in enumerate(jax.tree_util.tree_leaves_with_path(labels))
  ]


@pytest.mark.parametrize(
  "fallback_learning_rate", [1e-3, optax.linear_schedule(2e-3, 5e-4, 3)], ids=["scalar", "schedule"]
)
def test_the_fallback_group_trains_like_adamw_at_its_own_rate(fallback_learning_rate, seed):
  params = make_tree()
  lr, weight_decay = 1e-2, 0.1
  adamw = run_steps(optax.adamw(fallback_learning_rate, weight_decay=weight_decay), params, seed=seed)
  taco_rate_everywhere = run_steps(optax_memopt.taco(lr, weight_decay=weight_decay), params, seed=seed)
  taco = run_steps(
    optax_memopt.taco(lr, weight_decay=weight_decay, fallback_learning_rate=fallback_learning_rate), params, seed=seed
  )
  labels = optax_memopt.taco_labels(params)
  assert {label for _, label, *_ in leaf_pairs(labels)} == {"taco", "fallback"}
  for step, (got, want_fallback, want_taco) in enumerate(zip(taco, adamw, taco_rate_everywhere)):
    for path, label, g, f, t in leaf_pairs(labels, got, want_fallback, want_taco):
      want = f if label == "fallback" else t
      np.testing.assert_allclose(g, want, rtol=1e-6, err_msg=f"{path} ({label}), step {step}, seed={seed}")


def test_the_fallback_rate_is_a_hyperparameter_under_inject_hyperparams(seed):
  params = make_tree()
  grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(seed).standard_normal(p.shape), p.dtype), params)
  tx = optax.inject_hyperparams(optax_memopt.taco, static_args=("k",))(learning_rate=1e-2, fallback_learning_rate=1e-3)
  state = tx.init(params)
  state.hyperparams["fallback_learning_rate"] = jnp.asarray(2e-3)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  adamw = optax.adamw(2e-3, weight_decay=0.0)
  want, _ = adamw.update(grads, adamw.init(params), params)
  fallback = [
    (path, u, w)
    for path, label, u, w in leaf_pairs(optax_memopt.taco_labels(params), updates, want)
    if label == "fallback"
  ]
  assert fallback
  for path, u, w in fallback:
    np.testing.assert_allclose(u, w, rtol=1e-6, err_msg=f"{path}, seed={seed}")


@pytest.mark.parametrize(
  "build, match",
  [
    (lambda: optax_memopt.scale_by_taco(k=-1), "k must be an int >= 0"),
    (lambda: optax_memopt.taco(1e-2, fallback_learning_rate=-1e-3), "fallback_learning_rate must be"),
    (lambda: optax_memopt.taco(1e-2, k=1.5), "k must be an int >= 0"),
    (lambda: optax_memopt.taco(1e-2, k=True), "k must be an int >= 0"),
    (lambda: optax_memopt.scale_by_taco(segments=0), "segments must be an int >= 1"),
    (lambda: optax_memopt.taco(1e-2, k=16, segments=3), "segments must divide k=16; got 3"),
    (lambda: optax_memopt.scale_by_taco(beta=1.0), r"beta must be in \[0, 1\)"),
    (lambda: optax_memopt.taco(1e-2, beta=-0.1), r"beta must be in \[0, 1\)"),
    (lambda: optax_memopt.taco(1e-2, implementation="cuda"), "implementation must be one of"),
    # The selection has no kernel: a named one is refused, not replaced by XLA.
    (lambda: optax_memopt.taco(1e-2, implementation="pallas"), r"implementation must be one of None or 'xla'"),
    (lambda: optax_memopt.scale_by_taco(implementation="interpret"), r"XLA only.*got 'interpret'"),
    (lambda: optax_memopt.taco(1e-2, fallback="adam"), "fallback must be an optax.GradientTransformation"),
    (
      lambda: optax_memopt.taco(1e-2, labels={"w": "taco", "b": "adam"}),
      r"labels must be 'taco' or 'fallback'.*'adam' for \['b'\]",
    ),
    (lambda: MatrixAxes(batch_dims=-1), r"MatrixAxes.batch_dims must be an int >= 0"),
    (lambda: MatrixAxes(input_dims=0), r"MatrixAxes.input_dims must be an int >= 1"),
  ],
)
def test_bad_hyperparameters_raise_when_built(build, match):
  with pytest.raises(ValueError, match=match):
    build()


@pytest.mark.parametrize(
  "tx, match",
  [
    (optax_memopt.taco(1e-2, labels=lambda p: {"w": "taco", "b": "sgd"}), r"'sgd' for \['b'\]"),
    # A vector labelled "taco" by the user has no output axis.
    (optax_memopt.taco(1e-2, labels={"w": "taco", "b": "taco"}), r"parameter \['b'\] has shape \(4,\)"),
    (optax_memopt.scale_by_taco(), r"parameter \['b'\] has shape \(4,\)"),
    (optax_memopt.scale_by_taco(matrix_axes=lambda path, p: (0, 1)), r"matrix_axes must be a MatrixAxes.*\['b'\]"),
  ],
)
def test_bad_labels_and_parameters_raise_at_init_naming_the_parameter(tx, match):
  with pytest.raises(ValueError, match=match):
    tx.init({"w": jnp.ones((8, 4)), "b": jnp.ones((4,))})


def test_trains_a_small_transformer():
  config = model.TransformerConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
  result = loop.train(config, optax_memopt.taco(3e-2), steps=60, batch_size=8, seq_len=32)
  # Uniform guessing over bytes costs ln(256) = 5.55 nats. Measured after 60
  # steps (mean of the last 10 training losses): AdamW(3e-3) 3.06, TACO 3.46,
  # and 4.64 with TACO's matrices frozen (the Adam fallback alone training
  # the embedding and norms), so the bound needs TACO's steps.
  assert np.mean(result.train_losses[-10:]) < 3.8
  assert result.validation_loss < 3.9


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.int32])
def test_complex_or_integer_matrix_is_refused_at_init_naming_it(dtype):
  params = {"dense": {"kernel": jnp.ones((8, 4), dtype)}, "bias": jnp.ones(4)}
  name = jnp.dtype(dtype).name
  with pytest.raises(ValueError, match=rf"taco supports real floating-point .* 'dense/kernel' is {name}"):
    optax_memopt.taco(1e-2).init(params)


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_the_cuda_program_selects_with_xla_on_hopper(monkeypatch, implementation):
  from pallas_kernels import _backend, dispatch

  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: True)
  tx = optax_memopt.scale_by_taco(k=4, implementation=implementation)
  grads = {"w": jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)}
  text = _backend.lower_for_cuda(tx.update, grads, jax.eval_shape(tx.init, grads))
  assert _backend.TRITON_CALL not in text


@needs_plugin
@pytest.mark.parametrize("dtype, bound", [(jnp.bfloat16, 8.25), (jnp.float32, 16.25)])
def test_on_an_h100_the_selection_reads_the_gradient_in_one_pass(dtype, bound):
  """Compiled for an H100, per parameter of covered matrices: the selection's one reduction reads ``g``;
  the value at the selected column is read by a gather, which the byte counter counts as a read of the
  whole ``g``; the parameters' update reads and writes ``p``; the heavy hitters, their copies and the
  rows' reductions, 0.17. A reduction of the magnitude keys, then one of the columns holding the largest,
  wrote an int32 per element between them (16.17 and 24.17 bytes)."""
  params = {f"w{i}": jax.ShapeDtypeStruct((1024, 4096), dtype) for i in range(2)}
  program = gpu_compile.compile_step(optax_memopt.taco(1e-3), params)
  assert program.moved_bytes / program.n_params < bound
  assert program.temporaries_bytes / program.n_params < 0.05
