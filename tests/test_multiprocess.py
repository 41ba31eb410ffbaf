"""Every registered optimizer across two processes of JAX's multi-process runtime.

Two processes on this machine (``jax.distributed.initialize`` on 127.0.0.1,
CPU collectives through gloo, four CPU devices each) run
``tests/multiprocess_worker.py``: one global ``(fsdp, tp) = (4, 2)`` mesh over
the eight devices, parameters and optimizer state sharded across both
processes, a few jitted steps, an orbax checkpoint written by both midway
and restored. The tests here assert on the two processes' reports.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from tests import host_devices
from tests.optimizer_cases import CASES

NAMES = sorted(CASES)
N_PROCESSES = 2
DEVICES_PER_PROCESS = 4
TIMEOUT_SECONDS = 900
# Every matrix is cut over fsdp across the processes; what a process holds
# beyond half of the state is the replicated vectors' state and counts, and
# ternary Adam's column statistics, whole on every device that splits a
# matrix's rows (docs/sharding.md): 0.61 of its state on this small model.
# A matrix's state held whole would take a process to about all of it.
LOCAL_STATE_FRACTION = 0.65


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def run_workers(workdir: pathlib.Path) -> list[tuple[int, str, str]]:
  """(exit code, stdout, stderr) of each worker; a worker that fails or hangs stops the rest."""
  command = [
      sys.executable, "-m", "tests.multiprocess_worker",
      "--coordinator", f"127.0.0.1:{free_port()}",
      "--num-processes", str(N_PROCESSES),
      "--checkpoints", str(workdir / "checkpoints"),
  ]  # fmt: skip
  workers = []
  for process_id in range(N_PROCESSES):
    stdout = open(workdir / f"stdout_{process_id}", "w")
    stderr = open(workdir / f"stderr_{process_id}", "w")
    workers.append(
      subprocess.Popen(
        [*command, "--process-id", str(process_id), *NAMES],
        cwd=host_devices.REPOSITORY,
        env=host_devices.environment(DEVICES_PER_PROCESS),
        stdout=stdout,
        stderr=stderr,
      )
    )
    stdout.close()
    stderr.close()
  deadline = time.monotonic() + TIMEOUT_SECONDS
  # The others wait for a failed worker at the next collective: stop them.
  while any(w.poll() is None for w in workers):
    if time.monotonic() > deadline or any(w.poll() for w in workers):
      time.sleep(5)
      for worker in workers:
        if worker.poll() is None:
          worker.kill()
      break
    time.sleep(0.5)
  for worker in workers:
    worker.wait()
  return [
    (
      worker.returncode,
      (workdir / f"stdout_{i}").read_text(),
      (workdir / f"stderr_{i}").read_text(),
    )
    for i, worker in enumerate(workers)
  ]


def run_and_read_workers(workdir: pathlib.Path) -> list[dict]:
  outcomes = run_workers(workdir)
  if any(code for code, _, _ in outcomes):
    pytest.fail(
      "\n\n".join(
        f"process {i} exited with {code} (killed after {TIMEOUT_SECONDS} s if -9):\n{stderr[-4000:]}"
        for i, (code, _, stderr) in enumerate(outcomes)
      )
    )
  return [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in outcomes]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
  return host_devices.once_per_test_run(
    tmp_path_factory, "multiprocess", lambda: run_and_read_workers(tmp_path_factory.mktemp("multiprocess"))
  )


def results(reports: list[dict], name: str) -> list[dict]:
  per_process = [report["results"][name] for report in reports]
  for report, result in zip(reports, per_process):
    if "error" in result:
      pytest.fail(f"{name} raised in process {report['process_id']}:\n{result['error']}")
  return per_process


def test_each_process_reports_for_every_optimizer(reports):
  assert sorted(report["process_id"] for report in reports) == list(range(N_PROCESSES))
  for report in reports:
    assert sorted(report["results"]) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_trains_with_parameters_and_state_across_processes(reports, name):
  per_process = results(reports, name)
  losses = per_process[0]["losses"]
  assert all(result["losses"] == losses for result in per_process), per_process
  assert losses[-1] < losses[0], losses
  for result in per_process:
    assert result["processes_holding_each_matrix"] == [N_PROCESSES]
    assert result["local_state_bytes"] <= LOCAL_STATE_FRACTION * result["global_state_bytes"], result


@pytest.mark.parametrize("name", NAMES)
def test_sharded_steps_equal_single_device_steps(reports, name):
  for result in results(reports, name):
    assert result["mismatches_to_single_device"] == []


@pytest.mark.parametrize("name", NAMES)
def test_resumed_from_orbax_checkpoint_equals_uninterrupted_run(reports, name):
  for result in results(reports, name):
    assert result["resumed_equals_uninterrupted"]
