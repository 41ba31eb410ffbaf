"""``python -m optax_memopt.fit``: the memory planner, :mod:`memopt_tools.fit`.

Imported, this old path forwards to :mod:`memopt_tools.fit` with a DeprecationWarning.
"""

from optax_memopt import _moved

if __name__ == "__main__":
  import sys

  from memopt_tools import fit

  fit.main(sys.argv[1:])
else:
  __getattr__ = _moved.forward(__name__, "memopt_tools.fit")
