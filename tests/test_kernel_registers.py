"""Every Pallas kernel compiles through ptxas for Blackwell (sm_100a), with the registers and spills recorded.

Each kernel's lowering example is compiled for a B200 description on this
machine (``benchmarks.kernel_registers``), as XLA compiles it for the GPU, and
ptxas' registers and spill bytes per thread must equal those of
``benchmarks/data/kernel_registers.json`` (rendered in ``docs/kernels.md``); a
change of kernel, JAX or CUDA that moves them rewrites the file in the same
commit. Needs JAX's CUDA plugin (the gpu-compile lane).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from benchmarks import kernel_registers
from pallas_kernels import check_lowering
from tests.test_gpu_compile import needs_plugin

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "data" / "kernel_registers.json"

PTXAS_REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'quantize_kernel' for 'sm_100a'
ptxas info    : Function properties for quantize_kernel
    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 16 bytes smem
ptxas info    : Compiling entry function '_kernel' for 'sm_100a'
ptxas info    : Function properties for _kernel
    128 bytes stack frame, 120 bytes spill stores, 120 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers
"""


def test_ptxas_reports_are_read_per_entry_function():
  assert kernel_registers.parse_ptxas(PTXAS_REPORT) == {
    "quantize_kernel": {"arch": "sm_100a", "registers": 40, "spill_stores": 8, "spill_loads": 12},
    "_kernel": {"arch": "sm_100a", "registers": 64, "spill_stores": 120, "spill_loads": 120},
  }


def test_a_kernel_whose_registers_or_spills_moved_is_reported():
  figures = {"registers": 64, "spill_stores": 120, "spill_loads": 120}
  committed = {"kernels": {"k": {"backend": "Triton", "sm_90a": figures, "sm_100a": figures}}}
  moved = {"kernels": {"k": {"backend": "Triton", "sm_100a": dict(figures, spill_stores=108)}}}
  assert kernel_registers.differences({"kernels": {"k": {"sm_100a": figures}}}, committed) == []
  assert kernel_registers.differences(moved, committed) == [
    f"k sm_100a: {figures} -> {dict(figures, spill_stores=108)}"
  ]
  assert kernel_registers.differences({"kernels": {"new": {"sm_100a": figures}}}, committed) == [
    f"new sm_100a: None -> {figures}"
  ]


def test_the_results_cover_every_kernel_for_both_architectures():
  committed = json.loads(RESULTS.read_text())["kernels"]
  for example in check_lowering.kernel_examples():
    assert set(kernel_registers.ARCHITECTURES) <= set(committed[example.name]), example.name


@needs_plugin
def test_every_kernel_compiles_for_sm_100a_as_recorded():
  # A process of its own, as benchmarks.kernel_registers compiles each architecture.
  command = [sys.executable, "-m", "benchmarks.kernel_registers", "--architectures", "sm_100a", "--check", str(RESULTS)]
  run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
