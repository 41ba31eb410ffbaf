"""Shared test settings: float64 is off as in user code; hypothesis stays quick on 2 cores."""

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
