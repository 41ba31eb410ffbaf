"""Kahan-compensated updates of bfloat16 and float16 parameters.

Each step is checked against the compensated sum written out in numpy's
float32 with ``ml_dtypes``' round-to-nearest: ``x = p + (u + c)``, ``p' =
RN(x)``, ``c' = RN(x - p')``; and a run of updates far below the spacing
against their exact sum, which round-to-nearest loses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_memopt
from optax_memopt import kahan_summation, with_kahan_summation
from tests.test_checkpoint import bitwise
from tests.test_stochastic_rounding import assert_resumes_bitwise_from_orbax

DTYPES = [jnp.bfloat16, jnp.float16]


@jax.jit
def compensated_step(params, updates, state):
  """One update of ``kahan_summation`` and the parameters it lands on."""
  compensated, state = kahan_summation().update(updates, state, params)
  return optax.apply_updates(params, compensated), state


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_each_step_rounds_the_compensated_sum_to_nearest_and_keeps_the_rest(dtype, seed):
  rng = np.random.default_rng(seed)
  size = 4096
  magnitude = 2.0 ** rng.integers(-8, 6, size)
  params = {"w": jnp.asarray(rng.uniform(-1, 1, size) * magnitude, dtype)}
  state = kahan_summation().init(params)
  numpy_dtype = np.dtype(dtype)
  p = np.asarray(params["w"]).astype(numpy_dtype)
  c = np.zeros(size, numpy_dtype)
  for _ in range(5):
    # Updates from a hundredth of the parameter's spacing to several spacings.
    u = (rng.standard_normal(size) * magnitude * 2.0 ** rng.integers(-16, -6, size)).astype(np.float32)
    params, state = compensated_step(params, {"w": jnp.asarray(u)}, state)
    x = p.astype(np.float32) + (u + c.astype(np.float32))
    p = x.astype(numpy_dtype)
    c = (x - p.astype(np.float32)).astype(numpy_dtype)
    message = f"seed={seed}"
    np.testing.assert_array_equal(np.asarray(params["w"]).view(np.uint16), p.view(np.uint16), err_msg=message)
    np.testing.assert_array_equal(
      np.asarray(state.compensation["w"]).view(np.uint16), c.view(np.uint16), err_msg=message
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_updates_below_half_the_spacing_add_up_where_round_to_nearest_loses_them(dtype):
  # 1 plus 64 eighths of the spacing above 1 (2**-7 for bfloat16, 2**-10 for float16): every sum exact.
  spacing = float(jnp.finfo(dtype).eps)
  params = {"w": jnp.ones((8,), dtype)}
  step = jnp.full((8,), spacing / 8, jnp.float32)
  state = kahan_summation().init(params)
  nearest = params
  for _ in range(64):
    params, state = compensated_step(params, {"w": step}, state)
    nearest = optax.apply_updates(nearest, {"w": step})
  total = np.asarray(params["w"], np.float32) + np.asarray(state.compensation["w"], np.float32)
  np.testing.assert_array_equal(total, 1 + 8 * spacing)
  np.testing.assert_array_equal(np.asarray(params["w"], np.float32), 1 + 8 * spacing)
  # Round-to-nearest never leaves 1.
  np.testing.assert_array_equal(np.asarray(nearest["w"], np.float32), 1.0)


def test_other_dtypes_pass_through_with_no_buffer():
  params = {"w": jnp.linspace(-1, 1, 16, dtype=jnp.float32), "h": jnp.ones((4,), jnp.bfloat16)}
  updates = {"w": jnp.full((16,), 1e-9, jnp.float32), "h": jnp.full((4,), 2.0**-10, jnp.float32)}
  state = kahan_summation().init(params)
  assert isinstance(state.compensation["w"], optax.MaskedNode)
  assert optax_memopt.state_nbytes(state) == 4 * 2
  new_updates, new_state = jax.jit(kahan_summation().update)(updates, state, params)
  assert bitwise(new_updates["w"]) == bitwise(updates["w"])
  assert isinstance(new_state.compensation["w"], optax.MaskedNode)
  with pytest.raises(ValueError, match="needs params"):
    kahan_summation().update(updates, state)


def test_inside_a_chain_after_inject_hyperparams_whose_rate_the_state_sets():
  params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16)}
  grads = {"w": jnp.full((64,), 0.3, jnp.float32)}
  # Hyper-parameters in float32: by default inject_hyperparams takes the parameters' dtype, where b2 rounds to 1.
  tx = with_kahan_summation(optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(learning_rate=1e-2))
  state = tx.init(params)
  updates, moved = jax.jit(tx.update)(grads, state, params)
  assert not np.array_equal(np.asarray(optax.apply_updates(params, updates)["w"]), np.asarray(params["w"]))
  assert moved[1].compensation["w"].dtype == jnp.bfloat16
  state[0].hyperparams["learning_rate"] = jnp.zeros((), jnp.float32)
  updates, still = jax.jit(tx.update)(grads, state, params)
  assert bitwise(optax.apply_updates(params, updates)) == bitwise(params)
  assert bitwise(still[1]) == bitwise(state[1])


def test_nnx_optimizer_with_bfloat16_parameters_resumes_bitwise_from_orbax(tmp_path, seed):
  assert_resumes_bitwise_from_orbax(with_kahan_summation(optax_memopt.adam_mini(1e-2)), tmp_path, seed)
