"""optax_memopt: optimizers for optax whose state is a fraction of Adam's."""

from optax_memopt.state_bytes import state_nbytes

__version__ = "0.1.0"
