"""Every optimizer under JAX's SPMD partitioner on 8 CPU devices.

``tests/sharding_check.py`` runs in separate processes (the device count is
fixed when JAX starts), a part of the optimizers each, and reports, per optimizer of the registry: the
sharded run against the single-device run, the state's shardings before and
after the jitted steps, the per-device state bytes, the same steps on a mesh
of explicit axes, and a single-device checkpoint restored into the sharded
layout. The tests here assert on that
report, one test per property and optimizer.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
import pytest

from tests import host_devices
from tests.optimizer_cases import SHARDING_CASES

NAMES = sorted(SHARDING_CASES)
# Codes (integer, boolean, bfloat16 and float8 leaves, the stored values of
# every method) must be equal bitwise: both runs compute them elementwise from
# the same inputs with the same rounding. float32 leaves may differ where a
# reduction is split across devices (Adam-mini's block means, ternary Adam's
# factored statistics, norms): a float32 sum added in another order moves by
# a rounding of a partial sum or two, and the elementwise steps after it
# (division, square root, the parameter update) add at most half an ulp
# each. Four ulps of float32 epsilon times the leaf's largest magnitude
# bound that, and are far below what an off-by-one block, a wrong bias
# correction or a sign error changes.
FLOAT32_ULPS = 4.0
# Per-device state may exceed an even split like the parameters' by the tiny
# leaves a method keeps per tensor or per row (counts, statistics).
BYTES_TOLERANCE = 0.05


# The check runs in parts, each a process of its own, which two pytest-xdist
# workers share (``host_devices.parts_once_per_test_run``).
PARTS = 4


def run_sharding_check(names: list[str]) -> dict:
  done = subprocess.run(
    [sys.executable, "-m", "tests.sharding_check", *names],
    cwd=host_devices.REPOSITORY,
    env=host_devices.environment(8),
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  if done.returncode:
    pytest.fail(f"tests/sharding_check.py failed:\n{done.stderr[-6000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
  parts = {str(i): functools.partial(run_sharding_check, NAMES[i::PARTS]) for i in range(PARTS)}
  return {
    name: result
    for part in host_devices.parts_once_per_test_run(tmp_path_factory, "sharding_check", parts).values()
    for name, result in part.items()
  }


def result(report: dict, name: str) -> dict:
  if "error" in report[name]:
    pytest.fail(f"{name} raised on the 8-device mesh:\n{report[name]['error']}")
  return report[name]


def mismatches(differences: dict) -> list:
  """What ``tests.sharding_check.differences`` found beyond the tolerances above."""
  found = [f"structure: {differences['structure']}"] if differences["structure"] else []
  return found + [
    row
    for row in differences["rows"]
    if row.get("mismatched", 0) or row.get("non_finite_mismatch", False) or row.get("ulps", 0.0) > FLOAT32_ULPS
  ]


@pytest.mark.parametrize("name", NAMES)
def test_sharded_steps_equal_single_device_steps(report, name):
  run = result(report, name)
  assert not mismatches(run["param_differences"]), mismatches(run["param_differences"])
  assert not mismatches(run["state_differences"]), mismatches(run["state_differences"])


@pytest.mark.parametrize("name", NAMES)
def test_jitted_update_keeps_state_sharding(report, name):
  run = result(report, name)
  assert run["state_sharding_changes"] == []
  assert run["param_sharding_changes"] == []


@pytest.mark.parametrize("name", NAMES)
def test_state_is_split_over_devices_like_its_parameters(report, name):
  run = result(report, name)
  per_device = np.asarray(run["per_device_state_bytes"])
  # The matrices hold 99.7% of the parameters and are split 8 ways; vectors
  # are replicated and so is their state. No leaf may be split more coarsely
  # than its parameter (a replicated copy of a parameter-sized buffer).
  assert run["under_split_leaves"] == [], (
    f"leaves split more coarsely than their parameters: {run['under_split_leaves']}"
  )
  assert per_device.max() <= (1 + BYTES_TOLERANCE) * run["split_like_params_bytes"], (
    f"per-device state bytes {per_device.tolist()} against an even split like the"
    f" parameters' of {run['split_like_params_bytes']:.0f} (total"
    f" {run['total_state_bytes']})"
  )


@pytest.mark.parametrize("prefix", ["explicit", "explicit_unset"], ids=["set_mesh", "mesh_in_types"])
@pytest.mark.parametrize("name", NAMES)
def test_explicit_mesh_axes_give_the_same_steps(report, name, prefix):
  run = result(report, name)
  assert f"{prefix}_error" not in run, run.get(f"{prefix}_error")
  assert not mismatches(run[f"{prefix}_param_differences"]), mismatches(run[f"{prefix}_param_differences"])
  assert not mismatches(run[f"{prefix}_state_differences"]), mismatches(run[f"{prefix}_state_differences"])


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_restores_into_sharded_layout(report, name):
  run = result(report, name)
  assert run["restored_bitwise_equal"]
  assert run["restored_sharding_changes"] == []
  assert not mismatches(run["resumed_param_differences"]), mismatches(run["resumed_param_differences"])
  assert not mismatches(run["resumed_state_differences"]), mismatches(run["resumed_state_differences"])
