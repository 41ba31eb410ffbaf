"""Moved to :mod:`memopt_tools.training.optimizers`; this old path forwards to it with a DeprecationWarning."""

from optax_memopt import _moved

__getattr__ = _moved.forward(__name__, "memopt_tools.training.optimizers")
