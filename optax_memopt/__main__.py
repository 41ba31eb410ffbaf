"""``python -m optax_memopt``: the main job, :mod:`memopt_tools.main_job`.

Imported, this old path forwards to :mod:`memopt_tools.main_job` with a DeprecationWarning.
"""

from optax_memopt import _moved

if __name__ == "__main__":
  import runpy

  # Run as a command, the tools' main job takes over; imported, the library never imports the tools.
  runpy.run_module("memopt_tools", run_name="__main__", alter_sys=True)
else:
  __getattr__ = _moved.forward(__name__, "memopt_tools.main_job")
