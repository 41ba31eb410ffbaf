"""ptxas' registers and spills of every Pallas kernel, compiled for Hopper (sm_90a) and Blackwell (sm_100a).

Each kernel's lowering example (``pallas_kernels.check_lowering``) is
compiled, on any machine, for an H100 and for a B200 description
(``memopt_tools.gpu_compile``): XLA compiles the program through ptxas for
the target's architecture, as on the GPU. A Triton kernel is compiled by XLA
into the module's PTX, read from XLA's dump (``xla_dump_to``) and passed to
the ptxas of ``jax[cuda12]`` with ``-v`` for the same architecture. Per kernel and
architecture: registers per thread, and bytes of spill stores and loads per
thread.

    pip install -e ".[gpu-compile]"
    python -m benchmarks.kernel_registers --json benchmarks/data/kernel_registers.json
    python -m benchmarks.kernel_registers --render benchmarks/data/kernel_registers.json

The rendered table is ``docs/kernels.md``'s "Registers and spills"
(``tests/test_benchmark_tables.py`` checks it against the file);
``tests/test_kernel_registers.py`` compiles every kernel for sm_100a and
compares with the file.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

import jax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from memopt_tools import gpu_compile  # First: it sets the CUDA plugin's environment.
from pallas_kernels import _backend, check_lowering  # noqa: E402

# The targets compiled for, by the architecture ptxas compiles for.
ARCHITECTURES = {"sm_90a": "h100", "sm_100a": "b200"}

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas(report: str) -> dict[str, dict[str, Any]]:
  """Per entry function of a ``ptxas -v`` report: its architecture, registers and spill bytes."""
  functions: dict[str, dict[str, Any]] = {}
  current = None
  for line in report.splitlines():
    if match := _ENTRY.search(line):
      current = functions.setdefault(match.group(1), {"arch": match.group(2)})
    elif current is not None and (match := _SPILLS.search(line)):
      current["spill_stores"], current["spill_loads"] = int(match.group(1)), int(match.group(2))
    elif current is not None and (match := _REGISTERS.search(line)):
      current["registers"] = int(match.group(1))
  return functions


def _ptxas() -> pathlib.Path:
  import nvidia.cuda_nvcc

  return pathlib.Path(list(nvidia.cuda_nvcc.__path__)[0]) / "bin" / "ptxas"


def kernel_registers(example: _backend.LoweringExample, architecture: str) -> dict[str, Any]:
  """ptxas' figures for ``example``'s kernel compiled for ``architecture`` (a key of :data:`ARCHITECTURES`).

  Raises:
    RuntimeError: where the kernel does not compile, or its report is not found.
  """
  (device,) = gpu_compile.target_devices(ARCHITECTURES[architecture])
  sharding = SingleDeviceSharding(device)
  args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), example.args)
  with tempfile.TemporaryDirectory(prefix="kernel_registers_") as directory:
    with _backend.cuda_lowering_context():
      lowered = jax.jit(example.fn).trace(*args).lower()
      lowered.compile({"xla_dump_to": directory})
    # The kernel's entry in the module's PTX, by the name its custom call gives it.
    names = set(re.findall(r'\bname = \\?"([\w.]+)', lowered.as_text()))
    sources = [
      p for p in sorted(pathlib.Path(directory).glob("*.ptx")) if any(f".entry {n}(" in p.read_text() for n in names)
    ]
    reports = "\n".join(
      subprocess.run(
        [str(_ptxas()), f"-arch={architecture}", "-v", str(p), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
      ).stderr
      for p in sources
    )
  functions = {name: f for name, f in parse_ptxas(reports).items() if f["arch"] == architecture and name in names}
  if len(functions) != 1:
    raise RuntimeError(f"{example.name}: expected one kernel compiled for {architecture}; found {sorted(functions)}")
  (figures,) = functions.values()
  return {key: figures[key] for key in ("registers", "spill_stores", "spill_loads")}


def measure(architectures: list[str]) -> dict:
  """Every kernel's figures for ``architectures``, each architecture in a process of its own.

  So that nothing a process keeps between compiles (JAX's and XLA's caches
  of compiled programs and kernels) stands in for a second ptxas run.
  """
  if len(architectures) > 1:
    results: dict[str, Any] = {"jax": jax.__version__, "kernels": {}}
    for architecture in architectures:
      with tempfile.NamedTemporaryFile(suffix=".json") as part:
        command = [sys.executable, "-m", "benchmarks.kernel_registers", "--architectures", architecture]
        subprocess.run(command + ["--json", part.name], check=True, stdout=subprocess.DEVNULL)
        for name, row in json.loads(pathlib.Path(part.name).read_text())["kernels"].items():
          results["kernels"].setdefault(name, {}).update(row)
    return results
  (architecture,) = architectures
  results = {"jax": jax.__version__, "kernels": {}}
  for example in check_lowering.kernel_examples():
    backend = {_backend.TRITON_CALL: "Triton"}[example.backend]
    figures = kernel_registers(example, architecture)
    results["kernels"][example.name] = {"backend": backend, architecture: figures}
    print(f"{example.name} {architecture}: {json.dumps(figures)}", file=sys.stderr, flush=True)
  return results


def differences(results: dict, committed: dict) -> list[str]:
  """Each kernel and architecture of ``results`` whose figures differ from ``committed``'s, or that it lacks."""
  found = []
  for name, row in results["kernels"].items():
    for architecture in ARCHITECTURES:
      if architecture in row and committed["kernels"].get(name, {}).get(architecture) != row[architecture]:
        old = committed["kernels"].get(name, {}).get(architecture)
        found.append(f"{name} {architecture}: {old} -> {row[architecture]}")
  return found


def render(results: dict) -> str:
  """A markdown table from the JSON results."""
  header = " | ".join(f"{a}: registers | {a}: spill stores / loads (bytes)" for a in ARCHITECTURES)
  out = [
    f"Compiled with JAX {results['jax']}, ptxas of jax[cuda12]; per thread.",
    "",
    f"| kernel (lowering example) | backend | {header} |",
    "|---|---|" + "---|---|" * len(ARCHITECTURES),
  ]
  for name, row in results["kernels"].items():
    cells = [name, row["backend"]]
    for architecture in ARCHITECTURES:
      figures = row[architecture]
      cells += [str(figures["registers"]), f"{figures['spill_stores']} / {figures['spill_loads']}"]
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--architectures", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
  parser.add_argument("--json", type=pathlib.Path, help="write the results here")
  parser.add_argument(
    "--check", type=pathlib.Path, help="committed results: exit 1 where a kernel's registers or spills differ"
  )
  parser.add_argument("--render", type=pathlib.Path, help="print the table of a results file and exit")
  args = parser.parse_args(argv)
  if args.render:
    print(render(json.loads(args.render.read_text())))
    return 0
  results = measure(args.architectures)
  if args.json:
    args.json.write_text(json.dumps(results, indent=1) + "\n")
  if args.check:
    found = differences(results, json.loads(args.check.read_text()))
    if found:
      print(f"Registers or spills differ from {args.check}:\n  " + "\n  ".join(found), file=sys.stderr)
      return 1
    print(f"Every kernel compiled for {', '.join(args.architectures)} as {args.check} records.")
  elif len(args.architectures) == len(ARCHITECTURES):
    print(render(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
