"""Running a check in a fresh process with several CPU devices.

JAX fixes the number of host-platform devices when it starts, so the tests
that need a mesh run their check in a subprocess started with this
environment.
"""

from __future__ import annotations

import os
import pathlib

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


def environment(n_devices: int) -> dict[str, str]:
  """``os.environ`` with ``n_devices`` CPU devices and this repository importable."""
  return dict(
    os.environ,
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n_devices}",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
  )
