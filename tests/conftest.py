"""Shared test settings and the ``seed`` fixture.

float64 is off as in user code; hypothesis stays quick on 2 cores (and
prints the example that failed). Tests that draw fresh random inputs take the
``seed`` fixture: a new seed per run, written into the report of a test that
fails, with the environment variable that replays it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")

# A script run in its own process with 8 virtual devices (tests/test_sharding.py);
# importing it here would set the device-count flag in the test process.
collect_ignore = ["sharding_check.py"]

SEED_VARIABLE = "OPTAX_MEMOPT_TEST_SEED"


@pytest.fixture
def seed(request) -> int:
  """A fresh seed in [0, 2**31), or ``$OPTAX_MEMOPT_TEST_SEED`` to replay a failure."""
  replay = os.environ.get(SEED_VARIABLE)
  value = int(replay) if replay else int(np.random.SeedSequence().entropy % 2**31)
  request.node.user_properties.append(("seed", value))
  return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if report.failed:
    for name, value in item.user_properties:
      if name == "seed":
        report.sections.append(
            ("random seed", f"seed {value}: replay with {SEED_VARIABLE}={value} pytest {item.nodeid}")
        )
