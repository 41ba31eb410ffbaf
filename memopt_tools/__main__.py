"""``python -m memopt_tools``: the main job, as ``python -m optax_memopt`` runs it."""

import sys

from memopt_tools import main_job

if __name__ == "__main__":
  sys.exit(main_job.main())
