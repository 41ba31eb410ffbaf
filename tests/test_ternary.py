"""The block-major byte layout of ternary codes, against its documented definition.

Byte ``j`` of a block of ``w`` bytes holds ``sum_p base**p (t[j + p w] + 1)``,
code 1 past the block's end; the decoder's digits are exact for every byte.
Expected bytes are written here in numpy; inputs are drawn fresh and the seed
is in every failure message. The stochastic rounding is tested through the
step (``test_ternary_adam_update.py``, ``test_ternary_adam.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ternary
from tests import oracles

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("packing", ["base3", "2bit"])
# Blocks smaller than a 128-slice, of one slice, over several packed rows.
@pytest.mark.parametrize("block_size", [32, 128, 640])
@pytest.mark.parametrize("tiles_rows", [True, False])
def test_block_bytes_follow_the_documented_layout(packing, block_size, tiles_rows, seed):
  """Packing, unpacking, shapes and zeros."""
  layout = ternary.packing_layout(packing)
  shape = (3, 2 * block_size) if tiles_rows else (3, block_size + 37)
  size = math.prod(shape)
  blocks = oracles.blocks(shape, block_size)
  trits = np.random.default_rng(seed).integers(-1, 2, size)
  expected = oracles.block_major_bytes(trits, shape, block_size, packing)
  codes = np.ones(math.prod(blocks) * block_size, np.uint32)
  codes[:size] = trits + 1
  codes = jnp.asarray(codes.reshape(*blocks, block_size))
  packed = jax.jit(lambda c: ternary.pack_blocks(c, layout))(codes)
  np.testing.assert_array_equal(packed, expected, err_msg=f"seed={seed}")
  unpacked = jax.jit(lambda p: ternary.unpack_blocks(p, block_size, layout))(packed)
  np.testing.assert_array_equal(unpacked, codes, err_msg=f"seed={seed}")
  assert [a.shape for a in ternary.shapes(shape, block_size=block_size, packing=packing)] == [
    expected.shape,
    (*blocks, 1),
  ]

  zeros = ternary.zeros(shape, block_size=block_size, packing=packing)
  np.testing.assert_array_equal(zeros.packed, oracles.block_major_bytes(np.zeros(size), shape, block_size, packing))
  np.testing.assert_array_equal(zeros.scales, np.zeros((*blocks, 1), np.float32))


@pytest.mark.parametrize("base, planes", [(3, 5), (4, 4)])
def test_digits_are_exact_for_every_byte_and_place(base, planes):
  # The decoder's multiply-shift division, for every uint8 byte (not only
  # those a packer writes) and every place, at once and one place at a time.
  byte = np.arange(256, dtype=np.uint8)
  place = base ** np.arange(planes)
  expected = (byte[:, None].astype(np.int64) // place) % base
  digits = jax.jit(lambda b: ternary.digits(b[:, None], place, base))(byte)
  assert digits.dtype == jnp.float32
  np.testing.assert_array_equal(digits, expected)
  for p in range(planes):
    one_place = jax.jit(lambda b: ternary.digits(b, base**p, base))(byte)
    np.testing.assert_array_equal(one_place, expected[:, p])
