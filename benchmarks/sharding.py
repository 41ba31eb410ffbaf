"""Per-device optimizer-state bytes with parameters sharded over 1, 2, 4 and 8 devices.

The parameters of the 10M model are laid out FSDP and tensor-parallel style on
a ``("fsdp", "tp")`` mesh (:func:`param_spec`); every optimizer's state is
initialised by ``jax.jit(init, out_shardings=state_shardings(...))``, where
each state leaf follows its parameter (:func:`state_shardings`); one jitted
update runs with its output shardings left to JAX's SPMD partitioner, and the
table gives the largest per-device bytes of the updated state. The ideal is
``total / devices``; the state of replicated parameters (vectors) is
replicated with them, and a leaf whose shape the mesh does not divide is split
more coarsely than its parameter ("under-split").

Each device count runs in its own process: the number of host-platform
devices is fixed when JAX starts (``--xla_force_host_platform_device_count``).
Prints a markdown table and writes the rows to ``--json``; benchmarks/README's
table is ``--render`` of the committed ``benchmarks/data/sharding.json``.

    python -m benchmarks.sharding --json benchmarks/data/sharding.json
    python -m benchmarks.sharding --render benchmarks/data/sharding.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
from typing import Any, Sequence

import jax
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from benchmarks import shapes
from memopt_tools.training import optimizers
from optax_memopt import state_nbytes
from optax_memopt.sharding import Layout, declared_layouts, owners, state_shardings

MESH_AXES = ("fsdp", "tp")
DEVICE_COUNTS = (1, 2, 4, 8)


def mesh_shape(n_devices: int) -> tuple[int, int]:
  """``(fsdp, tp)`` sizes: tensor parallelism of 2 from 4 devices on, FSDP over the rest."""
  if n_devices < 1:
    raise ValueError(f"n_devices must be >= 1; got {n_devices}.")
  tp = 2 if n_devices >= 4 and n_devices % 2 == 0 else 1
  return n_devices // tp, tp


def make_mesh(n_devices: int, axis_type: AxisType = AxisType.Auto) -> Mesh:
  """A ``("fsdp", "tp")`` mesh of the first ``n_devices`` devices.

  ``AxisType.Auto`` leaves the sharding of intermediates to the partitioner;
  ``AxisType.Explicit`` makes it part of every array's type.
  """
  if n_devices > jax.device_count():
    raise ValueError(f"n_devices must be <= jax.device_count() = {jax.device_count()}; got {n_devices}.")
  return jax.make_mesh(
    mesh_shape(n_devices),
    MESH_AXES,
    axis_types=(axis_type,) * len(MESH_AXES),
    devices=jax.devices()[:n_devices],
  )


def param_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """FSDP on the first axis and tensor parallelism on the last, where they divide.

  A matrix ``(in, out)`` is cut into ``fsdp`` row groups and ``tp`` column
  groups; vectors and scalars (biases, norm scales: a small fraction of a
  model) are replicated, as in tensor-parallel layouts.
  """
  if len(shape) < 2:
    return PartitionSpec()
  fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
  spec = [None] * len(shape)
  if shape[0] % fsdp == 0:
    spec[0] = "fsdp"
  if shape[-1] % tp == 0:
    spec[-1] = "tp"
  return PartitionSpec(*spec)


def param_shardings(params: Any, mesh: Mesh) -> Any:
  return jax.tree.map(lambda p: NamedSharding(mesh, param_spec(p.shape, mesh)), params)


def per_device_bytes(tree: Any) -> dict[int, int]:
  """Bytes that the array leaves of ``tree`` occupy on each device, by device id."""
  totals: dict[int, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      totals[shard.device.id] = totals.get(shard.device.id, 0) + state_nbytes(shard.data)
  return totals


def shard_fraction(shape: Sequence[int], sharding: NamedSharding) -> float:
  """The fraction of an array of ``shape`` that one device holds."""
  size = math.prod(shape)
  return math.prod(sharding.shard_shape(tuple(shape))) / size if size else 1.0


def _finest_fractions(state: Any, params: Any, shardings: Any) -> list[float]:
  """Per state leaf, the least fraction of it one device can hold: its parameter's, or 1 (no parameter).

  A statistic over the rows (``Layout.COLUMN_STATISTICS``, ternary Adam's
  column means) is read whole by every device holding part of a column: it
  splits only as the parameter's other axes do.
  """
  param_leaves = list(zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))
  fractions = []
  for leaf, index, layout in zip(
    jax.tree.leaves(state), jax.tree.leaves(owners(state, params)), declared_layouts(state)
  ):
    if index < 0:
      fractions.append(1.0)
      continue
    param, sharding = param_leaves[index]
    spec = tuple(sharding.spec) + (None,) * (param.ndim - len(sharding.spec))
    if layout is Layout.COLUMN_STATISTICS and param.ndim >= 2 and not sharding.is_fully_replicated:
      kept = NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1]))
      fractions.append(shard_fraction(leaf.shape, kept))
    else:
      fractions.append(shard_fraction(param.shape, sharding))
  return fractions


def split_like_params_bytes(state: Any, params: Any, shardings: Any) -> float:
  """Per-device state bytes if every leaf were split as finely as its parameter.

  The target of the sharding rule: ``total / n_devices`` when every
  parameter is split over the whole mesh, more for replicated parameters
  (whose state is rightly replicated too), for leaves of no parameter, and
  for statistics over a sharded axis that every device reads whole
  (:func:`_finest_fractions`).
  """
  return sum(
    state_nbytes(leaf) * fraction
    for leaf, fraction in zip(jax.tree.leaves(state), _finest_fractions(state, params, shardings))
  )


def under_split_leaves(state: Any, params: Any, shardings: Any, min_bytes: float) -> list[str]:
  """State leaves of at least ``min_bytes`` that a device holds more of than :func:`_finest_fractions` allows."""
  return [
    f"{jax.tree_util.keystr(path)} {leaf.shape} {leaf.dtype}: {leaf.sharding.spec}"
    for (path, leaf), fraction in zip(
      jax.tree_util.tree_flatten_with_path(state)[0], _finest_fractions(state, params, shardings)
    )
    if state_nbytes(leaf) >= min_bytes and shard_fraction(leaf.shape, leaf.sharding) > fraction
  ]


def measure(optimizer: optax.GradientTransformation, params: Any, n_devices: int) -> dict[str, Any]:
  """State bytes (total, per device) after one jitted update on sharded ``params``."""
  mesh = make_mesh(n_devices)
  shardings = param_shardings(params, mesh)
  params = jax.device_put(params, shardings)
  abstract_state = jax.eval_shape(optimizer.init, params)
  state = jax.jit(optimizer.init, out_shardings=state_shardings(abstract_state, params, shardings, mesh))(params)
  grads = jax.tree.map(lambda p: p * 1e-2, params)
  _, updated = jax.jit(optimizer.update)(grads, state, params)
  changed = [
    jax.tree_util.keystr(path)
    for (path, before), after in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(updated))
    if not after.sharding.is_equivalent_to(before.sharding, before.ndim)
  ]
  state = updated
  per_device = per_device_bytes(state)
  total = state_nbytes(state)
  return {
    "devices": n_devices,
    "mesh": dict(zip(MESH_AXES, mesh_shape(n_devices))),
    "total_bytes": total,
    "max_device_bytes": max(per_device.values()),
    "split_like_params_bytes": split_like_params_bytes(state, params, shardings),
    "under_split_leaves": under_split_leaves(state, params, shardings, 0.01 * total),
    "sharding_changed_by_update": changed,
  }


def _measure_all(model: str, names: Sequence[str], n_devices: int) -> list[dict[str, Any]]:
  params = shapes.params(model)
  rows = []
  for name in names:
    row = measure(optimizers.get(name).build(1e-3, shapes.MODELS[model]), params, n_devices)
    rows.append({"optimizer": name, "model": model, "n_params": shapes.count(params), **row})
  return rows


def _run_with_devices(model: str, names: Sequence[str], n_devices: int) -> list[dict[str, Any]]:
  env = dict(
    os.environ,
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n_devices}",
    JAX_PLATFORMS="cpu",
  )
  command = [
    sys.executable,
    "-m",
    "benchmarks.sharding",
    "--model",
    model,
    "--devices",
    str(n_devices),
    "--optimizers",
    *names,
    "--worker",
  ]
  done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"{n_devices} devices failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="10M")
  parser.add_argument("--optimizers", nargs="+", default=list(optimizers.OPTIMIZERS))
  parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICE_COUNTS))
  parser.add_argument(
    "--json",
    type=pathlib.Path,
    default=pathlib.Path("results/sharding.json"),
    help="where the results go (the committed ones: benchmarks/data/sharding.json)",
  )
  parser.add_argument("--render", type=pathlib.Path, help="print the table of a results file and exit")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.render:
    print(render(json.loads(args.render.read_text())))
    return

  if args.worker:
    (n_devices,) = args.devices
    print(json.dumps(_measure_all(args.model, args.optimizers, n_devices)))
    return

  rows = []
  for n_devices in args.devices:
    rows += _run_with_devices(args.model, args.optimizers, n_devices)
  results = {
    "model": args.model,
    "devices": args.devices,
    "optimizers": args.optimizers,
    "date": datetime.date.today().isoformat(),
    "jax": jax.__version__,
    "rows": rows,
  }
  print(render(results))
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(results, indent=1) + "\n")


def render(results: dict) -> str:
  """The markdown table of a results file: largest per-device state in MB per device count."""
  devices, rows = results["devices"], results["rows"]
  by_name = {(r["optimizer"], r["devices"]): r for r in rows}
  last = devices[-1]
  lines = [
    f"Largest per-device optimizer state in MB, {results['model']} model ({rows[0]['n_params']:,}"
    " parameters, fp32); (fsdp, tp) mesh "
    + ", ".join(f"{mesh_shape(n)}" for n in devices)
    + f"; vectors replicated ({results['date']}, JAX {results['jax']}).",
    "",
    "| optimizer | total MB | "
    + " | ".join(f"{n} device{'s' * (n > 1)}" for n in devices)
    + f" | {last} devices / (total / {last}) | {last} devices / split like params"
    + f" | under-split leaves at {last} | leaves resharded by an update |",
    "|---" * (len(devices) + 6) + "|",
  ]
  for name in results["optimizers"]:
    cells = [f"{by_name[name, n]['max_device_bytes'] / 1e6:.3f}" for n in devices]
    row = by_name[name, last]
    lines.append(
      f"| {name} | {row['total_bytes'] / 1e6:.3f} | "
      + " | ".join(cells)
      + f" | {row['max_device_bytes'] * last / row['total_bytes']:.3f}"
      + f" | {row['max_device_bytes'] / row['split_like_params_bytes']:.3f}"
      + f" | {len(row['under_split_leaves'])}"
      + f" | {sum(len(by_name[name, n]['sharding_changed_by_update']) for n in devices)} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
