"""Shared test settings and the ``seed`` fixture.

float64 is off as in user code; hypothesis stays quick on 2 cores (and
prints the example that failed). Randomized tests run the same inputs on every
run, so that a red CI means a change broke something: the ``seed`` fixture
gives each test a fixed seed of its own (from its id), and hypothesis runs
derandomized. A failing test's report names its seed and the environment
variable that replays it. To explore, draw fresh seeds and hypothesis
examples (a failure found so is a bug to fix, and its seed a case to keep):

    OPTAX_MEMOPT_TEST_SEED=fresh python -m pytest -n 2 tests/test_lowbit_adamw.py
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

SEED_VARIABLE = "OPTAX_MEMOPT_TEST_SEED"
FRESH = "fresh"

settings.register_profile(
  "ci",
  max_examples=25,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow],
  derandomize=True,
)
settings.register_profile(FRESH, settings.get_profile("ci"), derandomize=False)
settings.load_profile(FRESH if os.environ.get(SEED_VARIABLE) == FRESH else "ci")

# A script run in its own process with 8 virtual devices (tests/test_sharding.py);
# importing it here would set the device-count flag in the test process.
collect_ignore = ["sharding_check.py"]


@pytest.fixture
def seed(request) -> int:
  """The test's fixed seed in [0, 2**31); ``$OPTAX_MEMOPT_TEST_SEED``: ``fresh`` for a new one, or one to replay."""
  chosen = os.environ.get(SEED_VARIABLE)
  if chosen == FRESH:
    value = int(np.random.SeedSequence().entropy % 2**31)
  elif chosen:
    value = int(chosen)
  else:
    value = zlib.crc32(request.node.nodeid.encode()) % 2**31
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
