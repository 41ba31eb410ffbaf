"""``python -m optax_memopt.fit``: the memory planner, :mod:`memopt_tools.fit`.

Imported, this old path forwards to :mod:`memopt_tools.fit` with a DeprecationWarning.
"""

from optax_memopt import _moved

if __name__ == "__main__":
  import runpy

  # Run as a command, the tools' planner takes over; imported, the library never imports the tools.
  runpy.run_module("memopt_tools.fit", run_name="__main__", alter_sys=True)
else:
  __getattr__ = _moved.forward(__name__, "memopt_tools.fit")
