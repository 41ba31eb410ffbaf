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
  return parts_once_per_test_run(tmp_path_factory, name, {"all": run})["all"]


def parts_once_per_test_run(tmp_path_factory, name: str, runs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
  """``{part: run()}`` over ``runs``, each part computed once by whichever pytest-xdist worker takes it first.

  As ``once_per_test_run``, but a worker that asks while another computes a
  part computes the parts nobody has taken, rather than waiting for the other:
  two workers share one check in about half its time. Then it waits for the
  parts others took. A part's failure fails every worker that asks.
  """
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent
  files = {part: shared / f"{name}.{part}.json" for part in runs}

  def compute(part: str, blocking: bool) -> None:
    with open(shared / f"{name}.{part}.lock", "w") as lock:
      try:
        fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
      except BlockingIOError:  # Another worker computes it.
        return
      if not files[part].exists():
        try:
          outcome = {"result": runs[part]()}
        except pytest.fail.Exception as failure:
          outcome = {"failure": str(failure)}
        files[part].write_text(json.dumps(outcome))

  for part in runs:
    compute(part, blocking=False)
  results = {}
  for part in runs:
    compute(part, blocking=True)
    outcome = json.loads(files[part].read_text())
    if "failure" in outcome:
      pytest.fail(outcome["failure"], pytrace=False)
    results[part] = outcome["result"]
  return results
