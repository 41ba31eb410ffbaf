"""Pallas GPU kernels for the hot paths of optax_memopt, each beside its jnp/XLA reference."""
