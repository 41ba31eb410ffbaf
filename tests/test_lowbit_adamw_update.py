"""The fused low-bit AdamW step for one tensor: its argument checks.

Its arithmetic is checked through the optimizer against the reference's
golden data and a numpy emulation (``test_lowbit_adamw.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels import lowbit_adamw_update


def test_moments_of_another_layout_are_refused_naming_the_field():
  grad = jnp.ones((4, 256))
  moments = lowbit_adamw_update.zero_moments((4, 128), state_format="fp8", block_size=128)
  with pytest.raises(ValueError, match=r"^moments.mu_or_paired must be float8_e4m3fn\[4, 256\]"):
    lowbit_adamw_update.lowbit_adamw_update(
      grad,
      moments,
      count=1,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      state_format="fp8",
      block_size=128,
    )
