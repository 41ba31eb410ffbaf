"""An optimizer step compiled for an NVIDIA H100 on any machine, and what it costs there.

XLA compiles a program for a GPU that is not present from a description of
it (``gpu_targets/h100.pbtxt``: 132 SMs, 3.35 TB/s, 80 GB; beside it the
H200's and the Blackwell B200's, :data:`TARGETS`). Nothing runs;
the result is XLA:GPU's own optimized program (fusions, schedule, buffer
assignment, Pallas kernels compiled through ptxas). An optimizer step is
memory-bound, so two figures of that program say what a user gets:

* **bytes moved**: every top-level fusion, custom call and other operation
  of the optimized entry computation reads its operands and writes its
  results once (parameters, constants, tuples, get-tuple-element, bitcasts,
  uninitialized buffers (``AllocateBuffer``) and the second half of an
  asynchronous pair move nothing; a while loop's body counts once per
  trip). Where a fusion touches part of an operand, it counts that part: a
  slice reads the slice, and an in-place
  dynamic-update-slice or scatter writes its update's size. An upper bound
  for other operations that read part of an operand (a gather), a lower
  bound for a custom call that reads its input twice. ``optax.adamw`` on
  float32 parameters moves 28 bytes per parameter this way (reads p, g, m,
  v; writes p, m, v).
* **peak**: arguments + outputs - aliased + temporaries of the donated step
  (``Compiled.memory_analysis``); beyond parameters, gradients and state,
  what is left is the step's temporaries.
* **collectives**, for a step sharded over several devices or hosts: the
  bytes each kind of collective carries on one device
  (:func:`collective_bytes`).

Needs JAX's CUDA plugin at the project's JAX version
(``pip install "optax-memopt[gpu-compile]"``); a driver or GPU is not
needed. The plugin's start-up check must be skipped
(``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``), which importing this module sets
when JAX's backends are not yet started.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
from importlib import resources
from typing import Any, Callable, Iterator, Sequence

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402  (after the environment variable the CUDA plugin reads)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

from memopt_tools import gpu_targets  # noqa: E402
from optax_memopt.sharding import split_spec, state_shardings  # noqa: E402

# Descriptions in ``gpu_targets/``: Hopper H100 and H200 (sm_90a), Blackwell B200 (sm_100a).
TARGETS = gpu_targets.NAMES

INSTALL_HINT = (
  'pip install "optax-memopt[gpu-compile]" (JAX\'s CUDA plugin at the installed JAX version,'
  " about 5.5 GB; no GPU or driver needed)"
)


class GpuCompilerMissing(RuntimeError):
  """JAX's CUDA plugin is not installed or not registered in this process."""


@functools.cache
def target_devices(target: str = "h100", devices: int = 1, hosts: int = 1) -> tuple[Any, ...]:
  """``devices`` compile-only devices of the GPU ``target`` on each of ``hosts`` hosts, host by host.

  Raises:
    ValueError: for an unknown ``target`` or ``devices`` or ``hosts`` below 1.
    GpuCompilerMissing: where JAX's CUDA plugin is missing.
  """
  if target not in TARGETS:
    raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {target!r}.")
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ValueError(f"devices must be an integer >= 1; got {devices!r}.")
  if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
    raise ValueError(f"hosts must be an integer >= 1; got {hosts!r}.")
  from jax.experimental.topologies import get_topology_desc

  description = resources.files("memopt_tools.gpu_targets").joinpath(f"{target}.pbtxt").read_text()
  try:
    topology = get_topology_desc(target, "cuda", target_config=description, topology=f"1x{hosts}x{devices}")
  except (NotImplementedError, RuntimeError) as error:
    raise GpuCompilerMissing(
      f"Compiling for {target.upper()} needs JAX's CUDA plugin ({error}). Install it with {INSTALL_HINT},"
      " and run with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 if JAX started before this module set it."
    ) from error
  return tuple(topology.devices)


# -- counting the bytes of an optimized HLO module ------------------------------

_BYTES_PER_ELEMENT = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+|c\d+|f8e\w+?)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Operations that move no memory: names, views, bookkeeping, and the second
# half of an asynchronous pair (its first half is counted).
_FREE = {
  "parameter",
  "constant",
  "tuple",
  "get-tuple-element",
  "bitcast",
  "after-all",
  "partition-id",
  "replica-id",
  "opt-barrier",
}
# An uninitialized buffer (``jax.lax.empty`` on a GPU): allocated, nothing written.
_UNINITIALIZED = 'custom_call_target="AllocateBuffer"'
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"\b(?:body|calls|to_apply|condition)=%?([\w.\-]+)")


def shape_bytes(text: str) -> float:
  """Bytes of the arrays in an HLO shape such as ``(f32[4,8]{1,0}, u8[16])``."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(text):
    size = _BYTES_PER_ELEMENT.get(dtype, 1 if dtype.startswith("f8") else None)
    if size is None:
      raise ValueError(f"unknown HLO element type {dtype!r} in {text!r}")
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _operands(arguments: str) -> list[str]:
  """The operand names of an instruction's argument list (up to its closing parenthesis)."""
  depth, end = 1, len(arguments)
  for i, char in enumerate(arguments):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", arguments[:end])


def _computations(hlo: str) -> tuple[str, dict[str, list[str]]]:
  """The entry computation's name and each computation's instruction lines."""
  bodies: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    if current is None:
      match = _COMPUTATION.match(line)
      if match and "=" not in line.split("(")[0]:
        current = match.group(2)
        bodies[current] = []
        if match.group(1):
          entry = current
    elif line.strip() == "}":
      current = None
    else:
      bodies[current].append(line)
  if entry is None:
    raise ValueError("the HLO text has no ENTRY computation")
  return entry, bodies


_SLICES = {"slice", "dynamic-slice"}


def _fusion_traffic(body: list[str], read: list[float], written: float) -> tuple[list[float], float]:
  """A fusion's bytes read per operand and written, where it touches only part of an operand or its result.

  A fused parameter that is only sliced is read for the slices' sizes.
  XLA:GPU updates the target of a root dynamic-update-slice or scatter in
  place (as a loop writing its output chunk by chunk does): the result is
  written for the update's size, and the target is not read
  (dynamic-update-slice) or read for the update's size (scatter, which
  combines). Other operands and results count whole.
  """
  instructions, users = {}, {}
  for line in body:
    match = _INSTRUCTION.match(line)
    if match:
      name, shape, opcode, arguments = match.groups()
      operands = _operands(arguments)
      instructions[name] = (shape, opcode, operands, arguments, line.lstrip().startswith("ROOT"))
      for position, operand in enumerate(operands):
        users.setdefault(operand, []).append((name, position))
  root = next((name for name, (*_, is_root) in instructions.items() if is_root), None)
  if root is None:
    return read, written

  def looked_through(name):
    while instructions[name][1] == "bitcast":
      name = instructions[name][2][0]
    return name

  outputs = instructions[root][2] if instructions[root][1] == "tuple" else [root]
  # Each in-place update among the outputs: the bytes it writes, and reads of its target.
  in_place = {}
  for output in map(looked_through, outputs):
    _, opcode, operands, *_ = instructions[output]
    if opcode == "dynamic-update-slice":
      in_place[output] = (shape_bytes(instructions[operands[1]][0]), 0.0)
    elif opcode == "scatter" and len(operands) == 3:
      update = shape_bytes(instructions[operands[2]][0])
      in_place[output] = (update, update)
  if in_place:
    written = sum(
      in_place[looked_through(o)][0] if looked_through(o) in in_place else shape_bytes(instructions[o][0])
      for o in outputs
    )

  def bytes_read(name):
    """What reading ``name`` costs through its users; ``None`` where one of them reads it whole."""
    total = 0.0
    for user, position in users.get(name, []):
      opcode = instructions[user][1]
      if opcode == "bitcast":
        through = bytes_read(user)
        if through is None:
          return None
        total += through
      elif opcode in _SLICES and position == 0:
        total += shape_bytes(instructions[user][0])
      elif position == 0 and user in in_place:
        total += in_place[user][1]
      else:
        return None
    return total

  read = list(read)
  for name, (_, opcode, _, arguments, _) in instructions.items():
    if opcode == "parameter":
      index = int(arguments.split(")")[0])
      partial = bytes_read(name)
      if partial is not None and index < len(read):
        read[index] = min(read[index], partial)
  return read, written


def _instructions(body: list[str], shapes: dict[str, str]) -> Iterator[tuple[str, str, str, str, list[str]]]:
  """Each instruction of a computation: (line, result, shape, opcode, operands), recording shapes as it goes.

  ``shapes`` gains each result's shape before its instruction is yielded;
  ``operands`` are the instruction's operands defined earlier in ``body``.
  """
  for line in body:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    result, shape, opcode, arguments = match.groups()
    shapes[result] = shape
    yield line, result, shape, opcode, [o for o in _operands(arguments) if o in shapes]


def _known_trips(line: str, result: str, counted: str) -> int:
  """A while loop's known trip count, or an error naming what cannot be counted without it."""
  trips = _TRIP_COUNT.search(line)
  if trips is None:
    raise ValueError(f"while loop {result} has no known trip count; its {counted} cannot be counted")
  return int(trips.group(1))


def bytes_moved(hlo: str, branch: Callable[[list[float]], float] = max) -> float:
  """Bytes an optimized HLO module's entry computation moves through device memory.

  Each top-level operation reads its operands and writes its results once
  (see the module docstring); a while loop counts its body once per known
  trip.

  Args:
    hlo: ``Compiled.as_text()`` of a compiled program.
    branch: which of a conditional's branches counts, given their bytes:
      ``max``, the costliest step (a step of GaLore that recomputes its
      projections); ``min``, the cheapest (its steps in between).

  Returns:
    The bytes, in total.
  """
  entry, bodies = _computations(hlo)

  def computation_bytes(name: str) -> float:
    shapes: dict[str, str] = {}
    total = 0.0
    for line, result, shape, opcode, operands in _instructions(bodies[name], shapes):
      if opcode in _FREE or opcode.endswith("-done") or _UNINITIALIZED in line:
        continue
      if opcode == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", line).group(1)
        total += _known_trips(line, result, "bytes") * computation_bytes(body)
        continue
      if opcode in ("call", "conditional"):
        called = _CALLED.findall(line) or re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[-1])
        total += branch([computation_bytes(c) for c in called if c in bodies] or [0.0])
        continue
      read, written = [shape_bytes(shapes[o]) for o in operands], shape_bytes(shape)
      fused = re.search(r"\bcalls=%?([\w.\-]+)", line) if opcode == "fusion" else None
      if fused and fused.group(1) in bodies:
        read, written = _fusion_traffic(bodies[fused.group(1)], read, written)
      total += written + sum(read)
    return total

  return computation_bytes(entry)


# The collectives of a sharded program, by the kind a row of the tables names.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collective_bytes(hlo: str) -> dict[str, float]:
  """Per collective kind, the bytes one device's part of an optimized HLO module carries through collectives.

  A collective carries the larger of its operands and its result (an
  all-gather's gathered result, a reduce-scatter's whole operand, an
  all-reduce's array); an asynchronous pair counts once, its operands at
  ``-start`` and its result at ``-done``. Computations the entry calls
  (asynchronous wrappers, conditionals, loops) are followed, a while loop's
  body once per known trip.

  Args:
    hlo: ``Compiled.as_text()`` of a compiled program (one device's part of
      an SPMD program).

  Returns:
    A dict from each kind of :data:`COLLECTIVES` to its bytes (0 for none).
  """
  entry, bodies = _computations(hlo)
  totals = dict.fromkeys(COLLECTIVES, 0.0)

  def walk(name: str, trips: int) -> None:
    shapes: dict[str, str] = {}
    started: dict[str, tuple[str, float]] = {}
    for line, result, shape, opcode, operands in _instructions(bodies[name], shapes):
      kind = opcode.removesuffix("-start").removesuffix("-done")
      if kind in totals:
        if opcode.endswith("-start"):
          started[result] = (kind, sum(shape_bytes(shapes[o]) for o in operands))
        elif opcode.endswith("-done"):
          kind, sent = started.pop(operands[0]) if operands and operands[0] in started else (kind, 0.0)
          totals[kind] += trips * max(sent, shape_bytes(shape))
        else:
          totals[kind] += trips * max(sum(shape_bytes(shapes[o]) for o in operands), shape_bytes(shape))
        continue
      loop_trips = _known_trips(line, result, "collectives") if opcode == "while" else 1
      # An asynchronous wrapper's computation is followed from its start only.
      if opcode in (
        "async-update",
        "async-done",
        "fusion",
        "reduce",
        "scatter",
        "sort",
        "map",
        "reduce-window",
        "select-and-scatter",
      ):
        continue
      for called in set(_CALLED.findall(line)) | set(re.findall(r"branch_computations=\{([^}]*)\}", line)):
        for callee in re.findall(r"[\w.\-]+", called):
          if callee in bodies and not re.search(rf"\bcondition=%?{re.escape(callee)}\b", line):
            walk(callee, trips * loop_trips)

  walk(entry, 1)
  return totals


# -- one optimizer step, compiled -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """A compiled program's memory on one device (``Compiled.memory_analysis``), in bytes."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int

  @classmethod
  def fields_of(cls, compiled: Any) -> dict[str, int]:
    """The fields of a compiled program's ``memory_analysis``, to build this class or one derived from it."""
    analysis = compiled.memory_analysis()
    return {
      "argument_bytes": analysis.argument_size_in_bytes,
      "output_bytes": analysis.output_size_in_bytes,
      "alias_bytes": analysis.alias_size_in_bytes,
      "temp_bytes": analysis.temp_size_in_bytes,
    }

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs - aliased + temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass(frozen=True)
class StepProgram(ProgramMemory):
  """What one donated step ``(params, state, grads) -> (params, state)`` costs on one device.

  Bytes are one device's; ``n_params`` counts the whole model.
  """

  n_params: int
  param_bytes: int
  gradient_bytes: int
  state_bytes: int
  moved_bytes: float
  hlo: str = dataclasses.field(repr=False)

  @property
  def temporaries_bytes(self) -> int:
    """The peak beyond parameters, gradients and state."""
    return self.peak_bytes - self.param_bytes - self.gradient_bytes - self.state_bytes

  @property
  def cheapest_moved_bytes(self) -> float:
    """``moved_bytes`` with each conditional's cheapest branch: less only where a step branches."""
    return bytes_moved(self.hlo, branch=min)

  @property
  def collectives(self) -> dict[str, float]:
    """The bytes one device's part of the step carries through each kind of collective (:func:`collective_bytes`)."""
    return collective_bytes(self.hlo)


def _placed(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _per_device_bytes(tree: Any) -> int:
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * leaf.dtype.itemsize
  return total


def _fsdp_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """FSDP as users shard: the first axis the devices divide; else as far as the shape allows (``split_spec``)."""
  divided = [d for d, size in enumerate(shape) if size % mesh.size == 0]
  if not divided:
    return split_spec(shape, mesh)
  return PartitionSpec(*(mesh.axis_names[0] if d == divided[0] else None for d in range(len(shape))))


def _fsdp_tp_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """A matrix's first axis over ``fsdp`` and last over ``tp``, each where it divides; vectors replicated."""
  if len(shape) < 2:
    return PartitionSpec()
  spec = [None] * len(shape)
  for dim, axis in ((0, "fsdp"), (len(shape) - 1, "tp")):
    if shape[dim] % mesh.shape[axis] == 0:
      spec[dim] = axis
  return PartitionSpec(*spec)


def compile_step(
  tx: optax.GradientTransformation,
  params: Any,
  *,
  target: str = "h100",
  devices: int = 1,
  hosts: int = 1,
  tensor_parallel: int = 1,
) -> StepProgram:
  """Compiles ``tx``'s donated step (update, then ``optax.apply_updates``) for ``target``.

  Args:
    tx: the optimizer.
    params: the parameters as arrays or ``jax.ShapeDtypeStruct`` (nothing is
      allocated); gradients are taken in the same shapes and dtypes.
    target: the GPU, one of :data:`TARGETS`.
    devices: devices of one host that the step is sharded over, FSDP-style:
      each parameter along its first dimension the devices divide (where
      none does, as :func:`optax_memopt.sharding.split_spec` cuts it), the
      state by :func:`optax_memopt.state_shardings`.
    hosts: hosts of ``devices`` GPUs each; the step is sharded over all
      ``hosts * devices`` of them.
    tensor_parallel: devices of a host that split each matrix's last axis
      (where it divides it) as well, FSDP over the rest splitting its first
      axis, as in ``docs/sharding.md``; vectors are replicated then.

  Returns:
    The compiled program's :class:`StepProgram`.

  Raises:
    GpuCompilerMissing: where JAX's CUDA plugin is missing.
  """
  if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
    raise ValueError(f"tensor_parallel must be an integer >= 1; got {tensor_parallel!r}.")
  if devices % tensor_parallel:
    raise ValueError(f"tensor_parallel must divide devices={devices}; got {tensor_parallel}.")
  device_list = target_devices(target, devices, hosts)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  state = jax.eval_shape(tx.init, shapes)
  if tensor_parallel > 1:
    mesh = Mesh(np.array(device_list).reshape(-1, tensor_parallel), ("fsdp", "tp"))
    param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, _fsdp_tp_spec(p.shape, mesh)), shapes)
    state_sharding = state_shardings(state, shapes, param_shardings, mesh)
  elif len(device_list) == 1:
    single = SingleDeviceSharding(device_list[0])
    param_shardings = jax.tree.map(lambda _: single, shapes)
    state_sharding = jax.tree.map(lambda _: single, state)
  else:
    mesh = Mesh(np.array(device_list), ("fsdp",))
    param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, _fsdp_spec(p.shape, mesh)), shapes)
    state_sharding = state_shardings(state, shapes, param_shardings, mesh)
  placed_params = _placed(shapes, param_shardings)
  placed_state = _placed(state, state_sharding)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = (
    jax.jit(step, donate_argnums=(0, 1), out_shardings=(param_shardings, state_sharding))
    .lower(placed_params, placed_state, placed_params)
    .compile()
  )
  hlo = compiled.as_text()
  param_bytes = _per_device_bytes(placed_params)
  return StepProgram(
    n_params=sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)),
    param_bytes=param_bytes,
    gradient_bytes=param_bytes,
    state_bytes=_per_device_bytes(placed_state),
    moved_bytes=bytes_moved(hlo),
    hlo=hlo,
    **ProgramMemory.fields_of(compiled),
  )


def device_memory_bytes(target: str = "h100") -> int:
  """The memory of one ``target`` device, from its description."""
  description = resources.files("memopt_tools.gpu_targets").joinpath(f"{target}.pbtxt").read_text()
  return int(re.search(r"^\s*device_memory_size:\s*(\d+)", description, flags=re.M).group(1))


@dataclasses.dataclass(frozen=True)
class PeakRow:
  """One optimizer's step on one device of ``target``; ``error`` says why it was not compiled."""

  optimizer: str
  arithmetic_bytes: int  # Parameters + gradients + state on one device.
  peak_bytes: int  # XLA's peak of the compiled step on one device.
  error: str | None = None
  collective_bytes: float = 0.0  # What one device's part of a sharded step carries through collectives.

  @property
  def temporaries_bytes(self) -> int:
    return self.peak_bytes - self.arithmetic_bytes


@dataclasses.dataclass(frozen=True)
class PeakReport:
  """XLA's peak of every optimizer's step beside the arithmetic; ``str()`` is a markdown table."""

  rows: tuple[PeakRow, ...]
  n_params: int
  target: str
  devices: int
  memory: int
  title: str

  def fits(self, optimizer: str) -> bool:
    (row,) = [r for r in self.rows if r.optimizer == optimizer]
    return row.error is None and row.peak_bytes <= self.memory

  def __str__(self) -> str:
    gb = decimal_bytes
    # A sharded step's collectives (the bytes one device sends or receives).
    sharded = (" collectives |", "---|") if self.devices > 1 else ("", "")
    lines = [
      f"{self.title}: {self.n_params:,} parameters, the step compiled by XLA for {self.devices} x"
      f" {self.target.upper()}; per device, {gb(self.memory)} each",
      "",
      "| optimizer | params + grads + state | XLA's peak | temporaries | fits |" + sharded[0],
      "|---|---|---|---|---|" + sharded[1],
    ]
    for row in self.rows:
      if row.error is not None:
        lines.append(f"| {row.optimizer} | {gb(row.arithmetic_bytes)} | not compiled: {row.error} | | |")
        continue
      fits = "yes" if row.peak_bytes <= self.memory else "no"
      cells = (row.optimizer, gb(row.arithmetic_bytes), gb(row.peak_bytes), gb(row.temporaries_bytes), fits)
      cells += (gb(row.collective_bytes),) if self.devices > 1 else ()
      lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def peak_report(
  params: Any,
  *,
  target: str = "h100",
  devices: int = 1,
  optimizer_names: Sequence[str] | None = None,
  n_heads: int | None = None,
  n_kv_heads: int | None = None,
  memory: int | None = None,
  title: str = "model",
) -> PeakReport:
  """Every optimizer's step compiled for ``devices`` GPUs of ``target``: XLA's peak per device.

  The planner's arithmetic (:func:`memopt_tools.fit.report`) counts
  parameters, gradients and state; the compiled program adds the step's
  temporaries, as XLA:GPU schedules and assigns them for a device of the
  target's memory.

  Args:
    params: the parameters as arrays or ``jax.ShapeDtypeStruct`` (a
      ``jax.eval_shape`` of the model's initialisation).
    target: the GPU, one of :data:`TARGETS`.
    devices: GPUs of one host the step is sharded over, FSDP-style.
    optimizer_names: entries of ``memopt_tools.training.optimizers.OPTIMIZERS``
      (default: all of them).
    n_heads, n_kv_heads: the heads Adam-mini cuts fused query and key
      kernels into.
    memory: one device's bytes for the "fits" column (default: the
      target's, 80 GB for the H100).
    title: the first line of the printed table.

  Returns:
    A :class:`PeakReport`.

  Raises:
    GpuCompilerMissing: where JAX's CUDA plugin is missing.
  """
  from memopt_tools.training import optimizers

  names = optimizers.checked_names(optimizer_names)
  target_devices(target, devices)
  config = types.SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv_heads)
  rows = []
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  for name in names:
    try:
      tx = optimizers.get(name).build(1e-3, config)
      jax.eval_shape(tx.init, params)
    except ValueError as error:
      rows.append(PeakRow(name, 0, 0, error=str(error)))
      continue
    program = compile_step(tx, params, target=target, devices=devices)
    arithmetic = program.param_bytes + program.gradient_bytes + program.state_bytes
    rows.append(PeakRow(name, arithmetic, program.peak_bytes, collective_bytes=sum(program.collectives.values())))
  memory = device_memory_bytes(target) if memory is None else memory
  return PeakReport(tuple(rows), n_params, target, devices, memory, title)


def decimal_bytes(nbytes: float) -> str:
  """``nbytes`` in GB, MB or KB (powers of 1000), the largest unit that keeps the number at least 1."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{nbytes:.0f} B"
