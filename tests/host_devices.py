"""Running a check in a fresh process with several CPU devices.

JAX fixes the number of host-platform devices when it starts, so the tests
that need a mesh run their check in a subprocess started with this
environment.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
from typing import Any, Callable

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


def environment(n_devices: int) -> dict[str, str]:
  """``os.environ`` with ``n_devices`` CPU devices and this repository importable."""
  return dict(
    os.environ,
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n_devices}",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
  )


def once_per_test_run(tmp_path_factory, name: str, run: Callable[[], Any]) -> Any:
  """``run()``'s JSON-serializable result, computed by one pytest-xdist worker and read by the others.

  A module-scoped fixture runs once per worker that gets one of the module's
  tests; these fixtures are subprocesses over every optimizer (minutes), so
  the first worker to ask runs it under a file lock in the directory the
  workers share and leaves the result (or its failure) there. Without xdist
  the directory is the session's own and this is just ``run()``.
  """
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent
  result_file = shared / f"{name}.json"
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not result_file.exists():
      try:
        outcome = {"result": run()}
      except pytest.fail.Exception as failure:
        outcome = {"failure": str(failure)}
      result_file.write_text(json.dumps(outcome))
  outcome = json.loads(result_file.read_text())
  if "failure" in outcome:
    pytest.fail(outcome["failure"], pytrace=False)
  return outcome["result"]
