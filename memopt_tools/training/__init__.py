"""A small, real training task: byte-level language modelling on text that ships with Python.

Used by ``python -m optax_memopt``, the convergence benchmarks, the notebook and
the tests that check an optimizer still learns.
"""
