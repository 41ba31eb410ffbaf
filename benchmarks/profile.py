"""Where one optimizer's jitted step spends its time, by XLA operation.

Compiles the step of ``benchmarks.step_time`` (update + apply, state and
params donated) for one optimizer, traces ``--steps`` steps with
``jax.profiler`` and sums the durations of the executed XLA operations
(fusions, custom calls such as ``TopK``, copies, scatters), grouped by
operation kind (the instruction's name without its number) and output
shape, read from the compiled module. Prints the untraced step time, the
operations' time per step, how long the traced step ran two or more
operations at once, one or none, the step's temporary buffer and page
faults, and the groups that take most.

An operation's time runs from its start to its end. XLA:CPU splits a large
loop fusion into parts along its outer dimensions (``outer_dimension_partitions``
in the compiled module, up to one per core) that run on as many threads at
once; such an operation counts once, and the ``parts`` column says into
how many parts it was split. The operations' time can therefore exceed the
step time (operations overlapped) or fall short of the cores' busy time
(split operations). What an optimizer costs in work, whatever the threads,
shows in its step time on one core: ``taskset -c 0 python -m benchmarks.step_time``.
Made for the CPU, where XLA:CPU reports each operation as it executes.

    python -m benchmarks.profile --model 10M --optimizer microadam
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import pathlib
import re
import resource
import tempfile
import time
from typing import NamedTuple

import jax

from benchmarks import shapes, step_time
from memopt_tools.training import optimizers

# "%name = shape opcode(...)" in the text of a compiled module; a tuple shape has spaces.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$", re.MULTILINE)
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_PARTITIONS = re.compile(r'"outer_dimension_partitions":\[([^\]]*)\]')


class Instruction(NamedTuple):
  """What the profile reports of one instruction of the compiled module."""

  stage: str
  shape: str
  parts: int  # Parts XLA:CPU splits it into, each run on its own thread; 1: not split.


def describe_instructions(hlo_text: str) -> dict[str, Instruction]:
  """Instruction name -> its ``Instruction`` in a compiled module's text.

  The stage is the outermost jitted function inside the step that the
  instruction came from (``_block_topk``, ``_decode_xla``, ...),
  ``step`` for code outside one, and ``(added by XLA)`` for instructions
  without a source, such as copies; the shape drops layouts, and a custom
  call's names its target (``TopK``, for instance). ``parts`` is the
  product of the instruction's ``outer_dimension_partitions``.
  """
  described = {}
  for name, shape, opcode, rest in _INSTRUCTION.findall(hlo_text):
    shape = re.sub(r"\{[^}]*\}", "", shape)
    target = _CUSTOM_CALL_TARGET.search(rest) if opcode == "custom-call" else None
    op_name = _OP_NAME.search(rest)
    if op_name is None:
      stage = "(added by XLA)"
    else:
      # The first jit is the step itself.
      jitted = re.findall(r"jit\((\w+)\)", op_name.group(1))[1:]
      stage = jitted[0] if jitted else "step"
    partitions = _PARTITIONS.search(rest)
    parts = math.prod(int(n) for n in re.findall(r"\d+", partitions.group(1))) if partitions else 1
    described[name] = Instruction(stage, f"{target.group(1)} {shape}" if target else shape, parts)
  return described


def operation_times(trace_events, instructions: dict[str, Instruction]):
  """Microseconds per stage, [calls, microseconds] per (stage, kind, shape, parts), threads seen.

  Only events named after an instruction of the module count; the runtime's
  own events (dispatch, waits) are left out.
  """
  stages = collections.Counter()
  operations = collections.defaultdict(lambda: [0, 0.0])
  threads = set()
  for event in trace_events:
    name = event.get("name")
    if event.get("ph") != "X" or name not in instructions:
      continue
    stage, shape, parts = instructions[name]
    duration = event.get("dur", 0.0)
    stages[stage] += duration
    operation = operations[(stage, re.sub(r"\.\d+$", "", name), shape, parts)]
    operation[0] += 1
    operation[1] += duration
    threads.add((event.get("pid"), event.get("tid")))
  return stages, operations, threads


def concurrency(trace_events, instructions: dict[str, Instruction]) -> dict[int, float]:
  """Microseconds during which 0, 1 and 2 or more operations ran, keyed 0, 1 and 2.

  Over the span from the first operation's start to the last one's end;
  only lasting events named after an instruction of the module count. An
  operation split over threads counts once: one operation running may keep
  every core busy.
  """
  changes = []
  for event in trace_events:
    duration = event.get("dur", 0.0)
    if event.get("ph") != "X" or event.get("name") not in instructions or duration <= 0:
      continue
    changes += [(event["ts"], 1), (event["ts"] + duration, -1)]
  spans = {0: 0.0, 1: 0.0, 2: 0.0}
  running = 0
  # At equal times ends come first, so back-to-back operations never overlap.
  changes.sort()
  for (time_us, change), (next_time_us, _) in zip(changes, changes[1:]):
    running += change
    spans[min(running, 2)] += next_time_us - time_us
  return spans


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="10M", choices=sorted(shapes.MODELS))
  parser.add_argument("--optimizer", default="microadam", choices=list(optimizers.OPTIMIZERS))
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--top", type=int, default=15)
  args = parser.parse_args(argv)

  params = shapes.params(args.model)
  grads = shapes.gradients(params)
  optimizer = optimizers.get(args.optimizer).build(1e-3, shapes.MODELS[args.model])
  compiled, state = step_time.compile_step(optimizer, params, grads)
  for _ in range(3):
    params, state = compiled(params, state, grads)
  jax.block_until_ready((params, state))
  faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  start = time.perf_counter()
  for _ in range(args.steps):
    params, state = compiled(params, state, grads)
  jax.block_until_ready((params, state))
  wall_ms = 1e3 * (time.perf_counter() - start) / args.steps
  faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / args.steps
  temp_mb = step_time.temporary_bytes(compiled) / 2**20

  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      for _ in range(args.steps):
        params, state = compiled(params, state, grads)
      jax.block_until_ready((params, state))
    trace_file = next(pathlib.Path(log_dir).rglob("*.trace.json.gz"))
    trace = json.loads(gzip.decompress(trace_file.read_bytes()))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  instructions = describe_instructions(compiled.as_text())
  stages, operations, threads = operation_times(events, instructions)
  running = concurrency(events, instructions)
  total = sum(stages.values())
  split_total = sum(us for (*_, parts), (_, us) in operations.items() if parts > 1)
  per_step_ms = lambda us: us / 1e3 / args.steps

  print(
    f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {args.optimizer},"
    f" {args.model} ({shapes.count(params):,} parameters)"
  )
  print(
    f"step (untraced, {args.steps} steps in a row): {wall_ms:.1f} ms; operations' time per"
    f" step: {per_step_ms(total):.1f} ms on {len(threads)} threads, {split_total / total:.0%} of it"
    " in operations split over several"
  )
  print(
    f"traced step: {per_step_ms(sum(running.values())):.1f} ms, of which two or more operations"
    f" ran {per_step_ms(running[2]):.1f} ms, one {per_step_ms(running[1]):.1f} ms, none"
    f" {per_step_ms(running[0]):.1f} ms"
  )
  # glibc's malloc gives a temporary buffer above 32 MiB a fresh mapping at
  # every step, whose pages fault in during the operations that write them.
  print(f"temporary buffer: {temp_mb:.1f} MB; minor page faults per untraced step: {faults:,.0f}")
  print("\n| stage | ms/step | share |\n|---|---|---|")
  for stage, us in stages.most_common():
    if per_step_ms(us) < 0.005:
      break
    print(f"| {stage} | {per_step_ms(us):.2f} | {us / total:.0%} |")
  print("\n| stage | operation | output shape | parts | calls/step | ms/step | share |")
  print("|---|---|---|---|---|---|---|")
  for (stage, kind, shape, parts), (calls, us) in sorted(operations.items(), key=lambda item: -item[1][1])[: args.top]:
    print(
      f"| {stage} | {kind} | `{shape}` | {parts} | {calls / args.steps:.0f} |"
      f" {per_step_ms(us):.2f} | {us / total:.0%} |"
    )


if __name__ == "__main__":
  main()
