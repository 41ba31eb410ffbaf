"""Ternary codes: kernel/XLA parity, exact packing, rounding error and unbiasedness.

Expected values come from numpy re-derivations of the definitions (absmax
scales, round-to-nearest trits, the documented planar byte layout) and, for
stochastic rounding, from the Bernoulli variance.
Inputs are drawn fresh each run; the seed is in every failure message.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pallas_kernels import _ternary_chunks as chunks
from pallas_kernels import _backend, dispatch
from pallas_kernels import ternary

pytestmark = pytest.mark.kernels

_LAYOUTS = {"base3": (3, 5), "2bit": (4, 4)}


def _heavy_tailed(seed: int, shape, dtype=np.float32) -> np.ndarray:
  """Gaussian values with a few large outliers and a zero block, as in optimizer states."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape))
  flat = x.reshape(-1)
  flat[: min(flat.size, 64)] = 0.0
  return x.astype(dtype)


def _numpy_round(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Absmax scales and round(x / scale) trits, straight from the definition, in float64."""
  flat = np.asarray(x, np.float64).reshape(-1)
  n_blocks = -(-flat.size // block_size)
  padded = np.zeros(n_blocks * block_size)
  padded[: flat.size] = np.abs(flat)
  scales = padded.reshape(n_blocks, block_size).max(axis=1)
  per_element = np.repeat(scales, block_size)[: flat.size]
  ratio = np.divide(flat, per_element, out=np.zeros_like(flat), where=per_element > 0)
  return np.round(ratio).astype(np.int8), scales.astype(np.float32)


def _planar_bytes(codes: np.ndarray, base: int, planes: int) -> np.ndarray:
  """The documented planar layout: rows of ``planes * 128`` codes, byte ``j`` of a row
  ``sum_p base**p code[p * 128 + j]``; a last row of ``r`` codes has planes of
  ``ceil(r / planes)`` codes, zero padded."""
  codes = np.asarray(codes, np.int64).reshape(-1)
  row, out = planes * 128, []
  for start in range(0, codes.size, row):
    part = codes[start : start + row]
    width = -(-part.size // planes)
    padded = np.zeros(planes * width, np.int64)
    padded[: part.size] = part
    out.append(padded.reshape(planes, width).T @ base ** np.arange(planes))
  return np.concatenate(out).astype(np.uint8) if out else np.zeros(0, np.uint8)


# Interpret-mode kernels equal XLA bit for bit. Cases cover both packings,
# every kind of block (masked sub-slice blocks, one block per slice, blocks
# spanning rows), deterministic and stochastic rounding, tails, 2-D inputs,
# bfloat16. Every case holds at least one whole kernel chunk.
_PARITY_CASES = [
    # packing, block_size, shape, dtype, stochastic
    ("base3", 64, (3, 700), np.float32, False),
    ("base3", 256, (2661,), np.float32, True),
    ("2bit", 32, (1300,), jnp.bfloat16, True),
    ("2bit", 384, (1600,), np.float32, False),
]


@pytest.mark.parametrize("packing_name,block_size,shape,dtype,stochastic", _PARITY_CASES)
def test_interpret_kernels_equal_xla(packing_name, block_size, shape, dtype, stochastic, seed):
  x = jnp.asarray(_heavy_tailed(seed, shape), dtype)
  geometry = chunks.ChunkGeometry(block_size, _LAYOUTS[packing_name][1])
  assert chunks.grid_extent(x.size, geometry, None)[0] > 0, "the case must run the kernel"
  key = jax.random.key(seed) if stochastic else None
  encode = functools.partial(
      ternary.ternary_encode, x, block_size=block_size, key=key, packing=packing_name
  )
  expected = encode(implementation="xla")
  actual = encode(implementation="interpret")
  chex.assert_trees_all_equal(actual, expected, custom_message=f"seed={seed}")
  chex.assert_shape(expected.packed, (-(-x.size // _LAYOUTS[packing_name][1]),))
  chex.assert_shape(expected.scales, (-(-x.size // block_size),))

  decode = functools.partial(
      ternary.ternary_decode,
      expected,
      size=x.size,
      block_size=block_size,
      packing=packing_name,
      dtype=dtype,
  )
  chex.assert_trees_all_equal(
      decode(implementation="interpret"),
      decode(implementation="xla"),
      custom_message=f"seed={seed}",
  )


def test_interpret_round_and_packing_equal_xla(seed):
  x = jnp.asarray(_heavy_tailed(seed, (1111,)))
  key = jax.random.key(seed)
  round_ = functools.partial(ternary.ternary_round, x, block_size=32, key=key)
  trits, _ = round_(implementation="xla")
  chex.assert_trees_all_equal(
      round_(implementation="interpret"), (trits, _), custom_message=f"seed={seed}"
  )
  for packing_name in ternary.PACKINGS:
    packed = ternary.pack_trits(trits, packing=packing_name, implementation="interpret")
    chex.assert_trees_all_equal(
        packed,
        ternary.pack_trits(trits, packing=packing_name, implementation="xla"),
        custom_message=f"seed={seed}",
    )
    chex.assert_trees_all_equal(
        ternary.unpack_trits(
            packed, size=x.size, packing=packing_name, implementation="interpret"
        ),
        trits,
        custom_message=f"seed={seed}",
    )


def test_interpret_kernels_with_several_chunks_per_grid_step_equal_xla(seed):
  # Large inputs give each grid step several chunks and leave the chunks that
  # do not fill a step to XLA; chunks_per_step=2 does both at a small size.
  size = 5 * 1280 + 300  # 256-element blocks, base 3: 5 chunks, 2 steps of 2.
  x = jnp.asarray(_heavy_tailed(seed, (size,)))
  settings = dict(block_size=256, layout=ternary._PACKED_LAYOUTS["base3"])
  seed_bits = jnp.uint32(seed)
  encode = jax.jit(
      functools.partial(
          ternary._encode_pallas, seed=seed_bits, interpret=True, chunks_per_step=2, **settings
      )
  )
  stored, scales = encode(x)
  expected_stored, expected_scales = ternary.encode_reference(x, seed=seed_bits, **settings)
  chex.assert_trees_all_equal(
      (stored, scales), (expected_stored, expected_scales), custom_message=f"seed={seed}"
  )
  decode = jax.jit(
      functools.partial(
          ternary._decode_pallas,
          size=size,
          dtype=jnp.float32,
          interpret=True,
          chunks_per_step=2,
          **settings,
      )
  )
  chex.assert_trees_all_equal(
      decode(stored, scales),
      ternary.decode_reference(stored, scales, size=size, dtype=jnp.float32, **settings),
      custom_message=f"seed={seed}",
  )


@pytest.mark.parametrize("packing_name", ternary.PACKINGS)
@pytest.mark.parametrize("block_size", [32, 64, 128, 640])
def test_nearest_rounding_matches_numpy_and_packs_in_planar_order(packing_name, block_size, seed):
  x = _heavy_tailed(seed, (7, 301))
  # An exact tie |x| = scale / 2, which rounds to 0 (half to even); elements
  # 64 and 65 share a block at every block size here.
  flat = x.reshape(-1)
  flat[64] = 8 * np.abs(flat).max()
  flat[65] = -flat[64] / 2
  trits, scales = _numpy_round(x, block_size)
  t = ternary.ternary_encode(x, block_size=block_size, packing=packing_name, implementation="xla")
  base, planes = _LAYOUTS[packing_name]
  expected_packed = _planar_bytes(trits + 1, base, planes)
  chex.assert_trees_all_equal(t.scales, scales, custom_message=f"seed={seed}")
  chex.assert_trees_all_equal(t.packed, expected_packed, custom_message=f"seed={seed}")

  decoded = ternary.ternary_decode(
      t, size=x.size, block_size=block_size, packing=packing_name, implementation="xla"
  )
  per_element = np.repeat(scales, block_size)[: x.size]
  error = np.abs(np.asarray(decoded, np.float64) - x.reshape(-1))
  assert np.all(error <= per_element / 2), f"seed={seed}"


def test_stochastic_rounding_is_unbiased(seed):
  """The mean of trit * scale over K keys is x, within 6 standard errors.

  Per element, trit * scale is s * sign(x) * Bernoulli(p) with p = |x| / s,
  so the mean of K draws has standard error s sqrt(p (1 - p) / K). With
  p in [0.05, 0.95] and K = 2048 the exact binomial probability of a 6-SE
  deviation is below 1.4e-8 per element (3.5e-6 for the 256 elements);
  elements with p in {0, 1} must be exact. Summed over all elements the
  deviation over its standard deviation is about N(0, 1) and must stay below
  5: a small bias shared by many elements (poor uniforms) shows up there.
  """
  rng = np.random.default_rng(seed)
  block_size, n_blocks, draws = 64, 4, 2048
  block_scales = 10.0 ** rng.uniform(-3, 3, (n_blocks, 1))
  ratios = rng.uniform(0.05, 0.95, (n_blocks, block_size))
  ratios[:, 0] = 1.0  # the absmax element of each block
  ratios[:, 1] = 0.0
  signs = rng.choice([-1.0, 1.0], (n_blocks, block_size))
  x = (signs * ratios * block_scales).astype(np.float32).reshape(-1)
  keys = jax.random.split(jax.random.key(seed), draws)
  round_ = jax.vmap(
      lambda key: ternary.ternary_round(x, block_size=block_size, key=key, implementation="xla")
  )
  trits, scales = round_(keys)
  chex.assert_trees_all_equal(scales, jnp.broadcast_to(scales[0], scales.shape))
  scale = np.repeat(np.asarray(scales[0], np.float64), block_size)
  x64 = x.astype(np.float64)
  assert np.all(np.asarray(trits) * np.sign(x64) >= 0), f"seed={seed}: a trit against the sign"
  mean = np.asarray(trits, np.float64).mean(axis=0) * scale
  p = np.abs(x64) / scale
  standard_error = scale * np.sqrt(p * (1 - p) / draws)
  deviation = mean - x64
  # 1e-6 * scale: the threshold u * s < |x| is evaluated in float32.
  worst = np.max(np.abs(deviation) - 6 * standard_error - 1e-6 * scale)
  assert worst <= 0, f"seed={seed}: an element's mean is beyond 6 standard errors"
  z_total = deviation.sum() / np.sqrt(np.sum(standard_error**2))
  assert abs(z_total) < 5, f"seed={seed}: summed z={z_total:.2f}"


def test_stochastic_rounding_replays_per_key_and_agrees_across_entry_points(seed):
  x = _heavy_tailed(seed, (900,))
  key, other = jax.random.split(jax.random.key(seed))
  trits, scales = ternary.ternary_round(x, block_size=128, key=key, implementation="xla")
  again, _ = ternary.ternary_round(x, block_size=128, key=key, implementation="xla")
  changed, _ = ternary.ternary_round(x, block_size=128, key=other, implementation="xla")
  chex.assert_trees_all_equal(again, trits)
  assert np.any(np.asarray(changed) != np.asarray(trits)), f"seed={seed}"
  t = jax.jit(
      functools.partial(ternary.ternary_encode, block_size=128, packing="2bit", implementation="xla")
  )(x, key=key)
  chex.assert_trees_all_equal(t.scales, scales)
  chex.assert_trees_all_equal(
      ternary.unpack_trits(t.packed, size=x.size, packing="2bit", implementation="xla"), trits
  )


@pytest.mark.parametrize("packing_name", ternary.PACKINGS)
def test_every_byte_round_trips(packing_name):
  base, planes = _LAYOUTS[packing_name]
  # Every byte whose base-`base` digits are all trit codes (0, 1, 2): all 243
  # base-3 bytes, the 81 2-bit ones. A full row of 128 and a short row of 37.
  digits = np.arange(256)[:, None] // base ** np.arange(planes) % base
  codes = np.flatnonzero(np.all(digits < 3, axis=1) & (np.arange(256) < base**planes))
  packed = np.concatenate([np.resize(codes, 128), codes[-37:]]).astype(np.uint8)
  size = (128 + 37) * planes
  trits = ternary.unpack_trits(packed, size=size, packing=packing_name, implementation="xla")
  assert set(np.unique(np.asarray(trits)).tolist()) == {-1, 0, 1}
  chex.assert_trees_all_equal(
      ternary.pack_trits(trits, packing=packing_name, implementation="xla"), packed
  )


@given(
    trits=st.sampled_from([3, 1283]).flatmap(
        lambda size: hnp.arrays(np.int8, (size,), elements=st.sampled_from([-1, 0, 1]))
    ),
    packing_name=st.sampled_from(ternary.PACKINGS),
)
def test_pack_unpack_round_trip(trits, packing_name):
  base, planes = _LAYOUTS[packing_name]
  packed = ternary.pack_trits(trits, packing=packing_name, implementation="xla")
  chex.assert_trees_all_equal(packed, _planar_bytes(trits + 1, base, planes))
  chex.assert_trees_all_equal(
      ternary.unpack_trits(packed, size=trits.size, packing=packing_name, implementation="xla"),
      jnp.asarray(trits),
  )


@pytest.mark.parametrize("shape, block_size", [((5,), 128), ((0, 3), 32)])
@pytest.mark.parametrize("packing_name", ternary.PACKINGS)
def test_inputs_shorter_than_a_kernel_chunk_are_coded_by_every_implementation(
    shape, block_size, packing_name,
    seed,
):
  """No kernel runs on them: every implementation gives the numpy rounding's bytes."""
  x = _heavy_tailed(seed, shape)
  trits, scales = _numpy_round(x, block_size)
  base, planes = _LAYOUTS[packing_name]
  for implementation in ("xla", "interpret"):
    t = ternary.ternary_encode(
        x, block_size=block_size, packing=packing_name, implementation=implementation
    )
    chex.assert_trees_all_equal(
        (t.packed, t.scales), (_planar_bytes(trits + 1, base, planes), scales),
        custom_message=f"seed={seed}, {implementation}",
    )
    decoded = ternary.ternary_decode(
        t, size=x.size, block_size=block_size, packing=packing_name,
        implementation=implementation,
    )
    expected = trits * np.repeat(scales, block_size)[: x.size]
    chex.assert_trees_all_equal(decoded, expected, custom_message=f"seed={seed}, {implementation}")


@pytest.mark.parametrize("on_hopper", [True, False])
def test_automatic_implementation_follows_the_platform(monkeypatch, on_hopper):
  """``implementation=None``: the kernels in a program lowered for a Hopper GPU (faked), XLA in others."""
  monkeypatch.setattr(dispatch, "cuda_target_runs_mosaic_gpu", lambda: on_hopper)
  monkeypatch.setitem(dispatch.FASTER_ON_HOPPER, "ternary", True)
  # Large enough for the kernels' whole chunks (a shorter tensor is all tail, done by XLA).
  size = 4096
  x = jax.ShapeDtypeStruct((size,), jnp.float32)
  trits = jax.ShapeDtypeStruct((size,), jnp.int8)
  encoded_by_xla = lambda x: ternary.ternary_encode(x, block_size=32, implementation="xla")
  calls = [
      (lambda x: ternary.ternary_encode(x, block_size=32), x),
      (lambda x: ternary.ternary_decode(encoded_by_xla(x), size=size, block_size=32), x),
      (lambda x: ternary.ternary_round(x, block_size=32), x),
      (lambda t: ternary.pack_trits(t), trits),
      (lambda t: ternary.unpack_trits(ternary.pack_trits(t, implementation="xla"), size=size), trits),
  ]
  # Fresh lambdas: jax.jit caches a function's trace, and the faked generation changes between cases.
  for fn, arg in calls:
    assert (_backend.MOSAIC_GPU_CALL in _backend.lower_for_cuda(fn, arg)) == on_hopper
    on_cpu = jax.jit(fn).trace(arg).lower(lowering_platforms=("cpu",)).as_text()
    assert _backend.MOSAIC_GPU_CALL not in on_cpu


def test_zero_blocks_get_zero_scales_and_trits():
  x = np.zeros(200, np.float32)
  x[130] = -3.0
  for key in (None, jax.random.key(0)):
    trits, scales = ternary.ternary_round(x, block_size=64, key=key, implementation="xla")
    chex.assert_trees_all_equal(scales, np.array([0.0, 0.0, 3.0, 0.0], np.float32))
    expected = np.zeros(200, np.int8)
    expected[130] = -1
    chex.assert_trees_all_equal(trits, expected)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ternary.ternary_encode(jnp.ones(8), block_size=48), "block_size"),
        (lambda: ternary.ternary_encode(jnp.ones(8), block_size=0), "block_size"),
        (lambda: ternary.ternary_encode(jnp.ones(8), block_size=True), "block_size"),
        (lambda: ternary.ternary_encode(jnp.ones(8), block_size=129), "block_size"),
        (lambda: ternary.ternary_encode(jnp.ones(8), block_size=64, packing="base4"), "packing"),
        (lambda: ternary.ternary_encode(jnp.ones(8, jnp.int32), block_size=64), "x"),
        (lambda: ternary.ternary_round(jnp.ones(8), block_size=64, key=3), "key"),
        (
            lambda: ternary.ternary_encode(jnp.ones(8), block_size=64, implementation="cuda"),
            "implementation",
        ),
        (
            lambda: ternary.ternary_decode(
                ternary.TernaryArray(jnp.zeros(3, jnp.uint8), jnp.zeros(1)), size=8, block_size=64
            ),
            "t.packed",
        ),
        (
            lambda: ternary.ternary_decode(
                ternary.TernaryArray(jnp.zeros(2, jnp.uint8), jnp.zeros(2)), size=8, block_size=64
            ),
            "t.scales",
        ),
        (
            lambda: ternary.ternary_decode(
                ternary.TernaryArray(jnp.zeros(2, jnp.uint8), jnp.zeros(1)),
                size=8,
                block_size=64,
                dtype=jnp.int8,
            ),
            "dtype",
        ),
        (lambda: ternary.unpack_trits(jnp.zeros(2, jnp.uint8), size=-1), "size"),
        (lambda: ternary.pack_trits(jnp.ones(3, bool)), "trits"),
    ],
)
def test_bad_arguments_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call()
