"""``python -m optax_memopt``: the main job, :mod:`memopt_tools.main_job`.

Imported, this old path forwards to :mod:`memopt_tools.main_job` with a DeprecationWarning.
"""

from optax_memopt import _moved

if __name__ == "__main__":
  import sys

  from memopt_tools import main_job

  sys.exit(main_job.main())
else:
  __getattr__ = _moved.forward(__name__, "memopt_tools.main_job")
