"""8-bit, 4-bit and fp8 AdamW: the reference's golden data replayed through the
public API, an independent numpy float32 emulation for tails, thresholds and
bfloat16, the state layout, errors, and Flax NNX."""

from __future__ import annotations

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_memopt
from optax_memopt import state_nbytes
from tests.test_gpu_compile import gpu_compile, needs_plugin

GOLDEN = pathlib.Path(__file__).parent / "data" / "lowbit_adamw" / "torchao_adamw_lowbit_f32.npz"
ALIASES = {
  "adamw_8bit": optax_memopt.adamw_8bit,
  "adamw_4bit": optax_memopt.adamw_4bit,
  "adamw_fp8": optax_memopt.adamw_fp8,
}
# The parameters' error per step, relative to a tensor's largest entry, is
# what float32 rounding explains. The chain computes p - lr (u + wd p), the
# reference p (1 - lr wd) - lr u: per step they differ by four roundings of
# numbers no larger than the largest entry (the chain's sum; the reference's
# 1 - lr wd, product and difference), half an ulp (2**-24 of the entry) each,
# and by three roundings of lr-sized terms, a hundredth of that here: 2.5
# ulps of the largest entry. The gradients come from the golden data, so the
# differences only add up over the steps (measured: at most 4 ulps after 6).
PARAM_TOLERANCE_PER_STEP = 2.5 * 2.0**-23
# Learning rate and weight decay of the emulation tests: a power of two, which
# float32 and bfloat16 hold exactly and multiply by without rounding.
POWER_OF_TWO_RATE = 2.0**-7
# Largest rounding error relative to the value rounded: half the spacing of
# 24 and 8 significant bits.
UNIT_ROUNDOFF = {jnp.float32: 2.0**-24, jnp.bfloat16: 2.0**-8}
# How far the optimizer's float32 direction may be from the emulation's,
# relative to it: each rounds about six times (division, square roots,
# the sum with eps, the bias corrections), 2**-24 each.
DIRECTION_ERROR = 2.0**-20


# -- an independent numpy float32 emulation of the reference -------------------


def golden_tables() -> dict[str, np.ndarray]:
  assert GOLDEN.exists(), f"golden data missing: {GOLDEN}"
  with np.load(GOLDEN) as data:
    return {name: data[f"qmap/{name}"] for name in ("8bit_signed", "8bit_unsigned", "4bit_signed", "4bit_unsigned")}


def numpy_encode(x: np.ndarray, table: np.ndarray | None, block_size: int):
  """Per block of the flat ``x`` (last one shorter): codes as decoded entries, and scales."""
  flat = x.reshape(-1)
  entries, scales = np.empty_like(flat), []
  for start in range(0, flat.size, block_size):
    block = flat[start : start + block_size]
    scale = np.maximum(np.abs(block).max(), np.float32(1e-12))
    if table is None:  # float8 e4m3fn
      scale = scale / np.float32(448)
      entry = (block / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
      ratio = block / scale
      # Last entry <= ratio (0 below the first), then up when at least half way.
      low = np.clip(np.searchsorted(table, ratio, side="right") - 1, 0, table.size - 1)
      high = np.minimum(low + 1, table.size - 1)
      up = ratio - table[low] >= (table[high] - table[low]) * np.float32(0.5)
      entry = table[np.where(up, high, low)]
    entries[start : start + block_size] = entry * scale
    scales.append(scale)
  return entries.reshape(x.shape), np.array(scales, np.float32)


def numpy_lerp(a, b, w):
  w = np.float32(w)
  return a + w * (b - a) if w < 0.5 else b - (b - a) * (np.float32(1) - w)


def numpy_adamw(kind, params, grads_per_step, *, lr, b1, b2, eps, weight_decay, block_size, min_size):
  """Parameters, stored (decoded) moments and directions after each step, as the spec's float32 formula."""
  tables = golden_tables()
  mu_table, nu_table = {
    "adamw_8bit": (tables["8bit_signed"], tables["8bit_unsigned"]),
    "adamw_4bit": (tables["4bit_signed"], tables["4bit_unsigned"]),
    "adamw_fp8": (None, None),
  }[kind]
  f = np.float32
  params = {k: np.asarray(v, np.float32) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in params.items()}
  nu = {k: np.zeros_like(v) for k, v in params.items()}
  history = []
  for t, grads in enumerate(grads_per_step, start=1):
    directions = {}
    for k, p in params.items():
      g = np.asarray(grads[k], np.float32)
      m = numpy_lerp(mu[k], g, f(1 - b1))
      v = numpy_lerp(nu[k], g * g, f(1 - b2))
      if p.size >= min_size:
        mu[k], _ = numpy_encode(m, mu_table, block_size)
        nu[k], _ = numpy_encode(v, nu_table, block_size)
      else:
        mu[k], nu[k] = m, v
      # From this step's unrounded moments; only the stored ones are rounded.
      directions[k] = (m / (f(1) - f(b1) ** f(t))) / (np.sqrt(v) / np.sqrt(f(1) - f(b2) ** f(t)) + f(eps))
      params[k] = p - f(lr) * (directions[k] + f(weight_decay) * p)
    history.append(({k: v.copy() for k, v in params.items()}, dict(mu), dict(nu), directions))
  return history


def decoded_moments(kind, state, name, block_size):
  """The stored moments of one parameter, decoded through the public map codes."""
  from pallas_kernels import lowbit_adamw_update, map_codes

  state_format = lowbit_adamw_update.STATE_FORMATS[kind.split("_")[1]]
  mu, nu = state.mu_or_paired[name], state.nu[name]
  if mu.dtype == jnp.float32:
    return np.asarray(mu), np.asarray(nu)
  if kind == "adamw_4bit":
    mu, nu = mu & 15, mu >> 4
  decoded = []
  for codes, scales, code in (
    (mu, state.mu_scales[name], state_format.mu_code),
    (nu, state.nu_scales[name], state_format.nu_code),
  ):
    q = map_codes.MapQuantized(codes.reshape(-1), scales.reshape(-1))
    decoded.append(
      np.asarray(map_codes.map_dequantize(q, size=codes.size, code=code, block_size=block_size)).reshape(codes.shape)
    )
  return decoded


# -- golden parity -------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(ALIASES))
def test_replays_the_reference_golden_data(kind):
  assert GOLDEN.exists(), f"golden data missing: {GOLDEN}"
  data = np.load(GOLDEN)
  meta = json.loads(str(data["meta"]))
  names = meta["names"]
  block_size = meta["kinds"][kind]["block_size"]
  optimizer = ALIASES[kind](meta["lr"], meta["b1"], meta["b2"], meta["eps"], meta["weight_decay"])
  params = {name: jnp.asarray(data[f"init/{name}"]) for name in names}
  state = optimizer.init(params)
  step = jax.jit(optimizer.update)
  for t in range(1, meta["steps"] + 1):
    grads = {name: jnp.asarray(data[f"grad/{t}/{name}"]) for name in names}
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
    for name in names:
      expected = data[f"{kind}/param/{t}/{name}"]
      error = np.abs(np.asarray(params[name]) - expected).max() / np.abs(expected).max()
      assert error <= t * PARAM_TOLERANCE_PER_STEP, f"{kind} step {t} {name}: {error:.2e}"
      mu, nu = decoded_moments(kind, state[0], name, block_size)
      # The stored moments are those of the reference bit for bit.
      np.testing.assert_array_equal(mu, data[f"{kind}/m/{t}/{name}"], err_msg=f"{kind} m step {t} {name}")
      np.testing.assert_array_equal(nu, data[f"{kind}/v/{t}/{name}"], err_msg=f"{kind} v step {t} {name}")


# -- tails, the size threshold, bfloat16: against the numpy emulation ------------


@pytest.mark.parametrize("kind", sorted(ALIASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tails_threshold_and_dtypes_match_the_numpy_emulation(kind, dtype, seed):
  rng = np.random.default_rng(seed)
  block_size, min_size = 64, 200
  shapes = {
    "tail": (5, 47),  # 235 elements: blocks of 64 across rows, last one of 43.
    "rows": (3, 128),  # blocks tile the rows: scales (3, 2, 1).
    "at_threshold": (200,),  # quantized: one block of 8 at the end.
    "below_threshold": (199,),  # float32 moments.
  }
  params = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
  grads = [
    {k: jnp.asarray(rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 1, s), dtype) for k, s in shapes.items()}
    for _ in range(3)
  ]
  lr = weight_decay = POWER_OF_TWO_RATE
  hyper = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
  optimizer = ALIASES[kind](lr, **hyper, block_size=block_size, min_quantized_size=min_size)
  state = optimizer.init(params)
  step = jax.jit(optimizer.update)
  expected = numpy_adamw(
    kind,
    {k: np.asarray(v.astype(jnp.float32)) for k, v in params.items()},
    [{k: np.asarray(v.astype(jnp.float32)) for k, v in g.items()} for g in grads],
    lr=lr,
    **hyper,
    block_size=block_size,
    min_size=min_size,
  )
  for t, g in enumerate(grads):
    updates, state = step(g, state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    _, expected_mu, expected_nu, expected_directions = expected[t]
    for name in shapes:
      mu, nu = decoded_moments(kind, state[0], name, block_size)
      message = f"{kind} {dtype.__name__} step {t + 1} {name} seed={seed}"
      # bfloat16 gradients are exact in float32: the emulation sees the same
      # numbers, so the stored moments are its own in both dtypes.
      np.testing.assert_array_equal(mu, expected_mu[name], err_msg=message)
      np.testing.assert_array_equal(nu, expected_nu[name], err_msg=message)
      # The update -lr (u + wd p) of the emulation's direction u and these
      # parameters. The chain rounds u to the parameters' dtype, then the
      # sum u + wd p (as does the float32 sum here); the products by wd and
      # lr (powers of two) are exact.
      direction = expected_directions[name]
      decayed = direction + np.float32(weight_decay) * np.asarray(params[name].astype(jnp.float32))
      rounding = UNIT_ROUNDOFF[dtype]
      bound = lr * (
        (rounding + DIRECTION_ERROR) * np.abs(direction) + (rounding + UNIT_ROUNDOFF[jnp.float32]) * np.abs(decayed)
      )
      error = np.abs(np.asarray(updates[name].astype(jnp.float32)) + np.float32(lr) * decayed)
      assert np.all(error <= bound), f"{message}: {np.max(error / bound):.3f} of the bound"
    # The directions do not depend on the parameters, which the expected
    # updates read from this run: bfloat16 runs go on past the first step.
    params = optax.apply_updates(params, updates)


@pytest.mark.parametrize("kind", sorted(ALIASES))
def test_scalars_and_tiny_tensors_quantize_when_no_threshold(kind, seed):
  """``min_quantized_size=0`` quantizes every tensor, a scalar's one-element block too."""
  rng = np.random.default_rng(seed)
  shapes = {"scalar": (), "one": (1,), "three": (3,)}
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()} for _ in range(3)]
  optimizer = ALIASES[kind](1e-2, block_size=64, min_quantized_size=0)
  state = optimizer.init(params)
  assert all(state[0].mu_or_paired[k].dtype != jnp.float32 for k in shapes)
  expected = numpy_adamw(
    kind,
    {k: np.asarray(v) for k, v in params.items()},
    [{k: np.asarray(v) for k, v in g.items()} for g in grads],
    lr=1e-2,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    weight_decay=0.0,
    block_size=64,
    min_size=0,
  )
  for t, g in enumerate(grads):
    updates, state = jax.jit(optimizer.update)(g, state, params)
    params = optax.apply_updates(params, updates)
    for name in shapes:
      mu, nu = decoded_moments(kind, state[0], name, 64)
      message = f"{kind} step {t + 1} {name} seed={seed}"
      np.testing.assert_array_equal(mu, expected[t][1][name], err_msg=message)
      np.testing.assert_array_equal(nu, expected[t][2][name], err_msg=message)
      np.testing.assert_allclose(params[name], expected[t][0][name], rtol=0, atol=1e-6, err_msg=message)


# -- state layout ----------------------------------------------------------------


@pytest.mark.parametrize(
  "kind,codes_dtype,scales_shape,bytes_per_param",
  [
    ("adamw_8bit", jnp.uint8, (1024, 16, 1), 2 + 8 / 256),
    ("adamw_4bit", jnp.uint8, (1024, 32, 1), 1 + 8 / 128),
    ("adamw_fp8", jnp.float8_e4m3fn, (1024, 16, 1), 2 + 8 / 256),
  ],
)
def test_state_layout_and_bytes(kind, codes_dtype, scales_shape, bytes_per_param):
  params = {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16), "b": jax.ShapeDtypeStruct((4096,), jnp.float32)}
  state = jax.eval_shape(ALIASES[kind](1e-3).init, params)[0]
  assert state.mu_or_paired["w"].shape == (1024, 4096) and state.mu_or_paired["w"].dtype == codes_dtype
  assert state.mu_scales["w"].shape == scales_shape == state.nu_scales["w"].shape
  if kind == "adamw_4bit":
    assert state.nu["w"] is None
  else:
    assert state.nu["w"].shape == (1024, 4096) and state.nu["w"].dtype == codes_dtype
  # 4096 elements: quantized (4096 is the threshold).
  assert state.mu_or_paired["b"].dtype == codes_dtype
  per_param = (state_nbytes(state) - 4) / (1024 * 4096 + 4096)
  assert per_param == pytest.approx(bytes_per_param, rel=1e-9)
  small = jax.eval_shape(ALIASES[kind](1e-3).init, {"b": jax.ShapeDtypeStruct((4095,), jnp.float32)})[0]
  assert small.mu_or_paired["b"].dtype == jnp.float32 and small.nu["b"].shape == (4095,)
  assert small.mu_scales["b"] is None and small.nu_scales["b"] is None


def test_a_block_of_zero_gradients_gets_the_smallest_scale():
  params = {"w": jnp.zeros((4, 128))}
  grads = {"w": jnp.zeros((4, 128)).at[0].set(1.0)}
  for kind, optimizer in ALIASES.items():
    state = optimizer(1e-3, block_size=128, min_quantized_size=1).init(params)
    _, state = optimizer(1e-3, block_size=128, min_quantized_size=1).update(grads, state, params)
    scales = np.asarray(state[0].mu_scales["w"]).reshape(-1)
    divisor = 448 if kind == "adamw_fp8" else 1
    np.testing.assert_array_equal(scales[1:], np.float32(1e-12) / np.float32(divisor), err_msg=kind)
    mu, nu = decoded_moments(kind, state[0], "w", 128)
    assert np.all(np.abs(mu[1:]) <= 1e-12) and np.all(np.abs(nu[1:]) <= 1e-12), kind


# -- errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs,argument",
  [
    (dict(block_size=0), "block_size"),
    (dict(block_size=64.0), "block_size"),
    (dict(min_quantized_size=-1), "min_quantized_size"),
    (dict(b1=1.0), "b1"),
    (dict(eps=-1.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
  ],
)
def test_invalid_hyperparameters_raise_naming_them(kwargs, argument):
  with pytest.raises(ValueError, match=rf"^{argument} "):
    optax_memopt.adamw_8bit(1e-3, **kwargs)


def test_state_format_is_checked():
  with pytest.raises(ValueError, match=r"^state_format "):
    optax_memopt.scale_by_lowbit_adam(state_format="3bit")


def test_traced_block_size_says_to_list_it_in_static_args():
  optimizer = optax.inject_hyperparams(optax_memopt.adamw_4bit)(learning_rate=1e-3, block_size=64)
  with pytest.raises(ValueError, match=r"block_size.*static_args"):
    optimizer.init({"w": jnp.zeros((64, 128))})


def test_non_floating_params_are_refused_at_init_naming_them():
  params = {"layer": {"w": jnp.zeros((64, 128)), "steps": jnp.zeros((3,), jnp.int32)}}
  with pytest.raises(ValueError, match=r"adamw_fp8 .*'layer/steps' is int32"):
    optax_memopt.adamw_fp8(1e-3).init(params)


# -- Flax NNX ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(ALIASES))
def test_nnx_optimizer_under_nnx_jit(kind):
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(16, 32, rngs=rngs)
      self.b = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      return self.b(jax.nn.relu(self.a(x)))

  model = Model(nnx.Rngs(0))
  # Blocks of 64 and a threshold of 100: both kernels quantized, biases float32.
  optimizer = nnx.Optimizer(model, ALIASES[kind](1e-2, block_size=64, min_quantized_size=100), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  x = jax.random.normal(jax.random.key(0), (8, 16))
  y = jnp.ones((8, 4))
  losses = [float(step(model, optimizer, x, y)) for _ in range(5)]
  assert losses[-1] < losses[0], losses
  mu = optimizer.opt_state[0].mu_or_paired
  assert mu["a"]["kernel"][...].dtype != jnp.float32 and mu["a"]["bias"][...].dtype == jnp.float32


def test_state_can_be_donated():
  # Every state leaf is a buffer of its own (small tensors' mu and nu too).
  params = {"w": jnp.ones((64, 128)), "b": jnp.ones((64,))}
  for kind, alias in ALIASES.items():
    optimizer = alias(1e-3)
    state = optimizer.init(params)
    step = jax.jit(optimizer.update, donate_argnums=1)
    for _ in range(2):
      _, state = step(jax.tree.map(jnp.ones_like, params), state, params)
    assert int(state[0].count) == 2, kind


@needs_plugin
@pytest.mark.parametrize("kind", ["adamw_8bit", "adamw_4bit"])
def test_on_an_h100_the_new_codes_are_written_over_the_old(kind):
  """Compiled for an H100: two passes and no copy of the codes (a table read of the
  old codes in the pass that writes the new ones makes XLA:GPU copy them: 8-bit
  26.3 bytes per parameter, 4-bit 21.5)."""
  params = {f"w{i}": jax.ShapeDtypeStruct((512, 1024), jnp.float32) for i in range(4)}
  program = gpu_compile.compile_step(getattr(optax_memopt, kind)(1e-3), params)
  assert program.moved_bytes / program.n_params < {"adamw_8bit": 22.5, "adamw_4bit": 19.75}[kind]


@needs_plugin
@pytest.mark.parametrize("shape, count", [((512, 1024), 4), ((32000, 4096), 1)])
@pytest.mark.parametrize(
  "kind, codes, scales, scale_passes",
  [("adamw_8bit", 2, 2 * 4 / 256, 0), ("adamw_4bit", 1, 2 * 4 / 128, 0), ("adamw_fp8", 2, 2 * 4 / 256, 1)],
)
def test_on_an_h100_a_bfloat16_step_moves_two_passes_and_the_scales(kind, codes, scales, scale_passes, shape, count):
  """bfloat16 parameters, stochastic rounding; per parameter, ``codes`` bytes of both moments' codes and
  ``scales`` bytes of their scales. The pass that reduces each block's absmax reads g and the codes; the
  pass that writes the codes reads p, g and the codes and writes p and the codes; the old scales are read
  by both, the new ones written once and read once; XLA:GPU copies the old ones before the new ones take
  their donated buffer; fp8's division of the scales by 448 is a pass of its own over them (the 1e-12
  floor, applied to the reduction's result, was another: 0.0625 for 8-bit); the step's scalars and the
  rounding's seeds, a few kilobytes. The embedding-sized tensor: with the two absmaxes reduced apart,
  XLA:GPU fused ``v``'s into the pass that writes the parameters and ``m``'s codes, and wrote ``v``'s
  codes in a third pass (fp8: 16.25)."""
  params = {f"w{i}": jax.ShapeDtypeStruct(shape, jnp.bfloat16) for i in range(count)}
  tx = optax_memopt.with_stochastic_rounding(getattr(optax_memopt, kind)(1e-3))
  program = gpu_compile.compile_step(tx, params)
  passes = (2 + codes) + (2 + 2 + codes + 2 + codes)
  assert program.moved_bytes / program.n_params <= passes + (4 + 2 + 2 * scale_passes) * scales + 0.005
