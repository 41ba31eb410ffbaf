"""One of several processes training every registered optimizer on one global mesh.

Started by ``tests/test_multiprocess.py``, once per process, on one machine::

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python -m tests.multiprocess_worker --coordinator 127.0.0.1:PORT \\
        --num-processes 2 --process-id I --checkpoints DIR [names...]

Each process joins JAX's multi-process runtime (``jax.distributed.initialize``;
CPU collectives through gloo) with four CPU devices of its own; the
``("fsdp", "tp") = (4, 2)`` mesh of ``benchmarks.sharding`` spans all eight, so
FSDP cuts every matrix, and its state, across the processes. For each
optimizer of ``tests.optimizer_cases.CASES``: the parameters and the state
(laid out by ``optax_memopt.state_shardings``) train a few jitted steps on a
quadratic loss; a run saved with orbax midway (every process writing its
own shards), restored into the abstract state of a freshly built optimizer
and resumed is compared
with the uninterrupted one, and both with the same steps on one local
device. Those single-device runs are the same in every process: the
processes share them out before the sharded runs (each run by the first
process to take it) and all read them.

The shapes divide the mesh and the registry's block sizes divide the
shards: each matrix has 2048 to 8192 elements, so an eighth of one is a
whole number of MicroAdam's 256-element blocks and 64-element buckets and of
ternary Adam's 32-element blocks; TACO's four parts of a row fall two to a
tensor-parallel shard.

Prints one JSON line: ``{"process_id": i, "results": {name: result}}``,
where a result holds what the test asserts on, or ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
import traceback

# The device count is read once, when JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402  (the device count must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import optax_memopt  # noqa: E402
from benchmarks import sharding as layout  # noqa: E402
from tests.optimizer_cases import CASES  # noqa: E402

N_DEVICES = 8
STEPS = 4
SAVE_AFTER = 2
FLOAT_TOLERANCE = 1e-5
SHAPES = {
  "embed": {"embedding": (64, 32)},
  "dense": {"kernel": (32, 128), "bias": (128,)},
  "out": {"kernel": (128, 64)},
  "norm": {"scale": (32,)},
}


def host_tree(seed: int, scale: float) -> dict:
  """The same numpy arrays in every process (from the seed)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda shape: rng.normal(0.0, scale, shape).astype(np.float32),
    SHAPES,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def global_tree(host: dict, shardings) -> dict:
  """Global arrays of which each process builds only its own shards."""
  return jax.tree.map(
    lambda array, sharding: jax.make_array_from_callback(array.shape, sharding, lambda index: array[index]),
    host,
    shardings,
  )


def quadratic_loss(params, target):
  return sum(jnp.sum((p - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target)))


def train_step(optimizer, shardings=None):
  """The jitted step; with ``shardings`` = (params', state's), its outputs are pinned to them."""

  def step(params, state, target):
    loss, grads = jax.value_and_grad(quadratic_loss)(params, target)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step, **({} if shardings is None else {"out_shardings": (*shardings, None)}))


def train(step, params, state, target, steps):
  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, target)
    losses.append(float(loss))
  return params, state, losses


def local_bytes(tree) -> int:
  """Bytes this process holds: each distinct shard of each leaf once."""
  return sum(
    sum({str(shard.index): shard.data.nbytes for shard in leaf.addressable_shards}.values())
    for leaf in jax.tree.leaves(tree)
  )


def bitwise_equal(expected, actual) -> bool:
  """Equal in dtype and bytes, compared shard by shard in this process."""
  for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    if want.dtype != got.dtype or want.shape != got.shape:
      return False
    got_shards = {str(shard.index): shard.data for shard in got.addressable_shards}
    for shard in want.addressable_shards:
      other = got_shards.get(str(shard.index))
      if other is None or np.asarray(shard.data).tobytes() != np.asarray(other).tobytes():
        return False
  return True


def mismatched_leaves(expected, actual) -> list[str]:
  """Leaves of ``actual`` whose shards in this process differ from ``expected`` beyond float rounding.

  Reductions split across devices (Adam-mini's block means, factored
  statistics) round differently: a float leaf may differ by a few fp32 ulps
  of its largest entry, or one rounding step of a low-precision stored value.
  """
  mismatched = []
  for (path, whole), leaf in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual)):
    whole, shards = np.asarray(whole), leaf.addressable_shards
    want = np.concatenate([whole[shard.index].ravel() for shard in shards])
    got = np.concatenate([np.asarray(shard.data).ravel() for shard in shards])
    if jnp.issubdtype(want.dtype, jnp.floating):
      want64, got64 = want.astype(np.float64), got.astype(np.float64)
      scale = float(np.max(np.abs(whole.astype(np.float64)), initial=0.0)) or 1.0
      relative = float(np.max(np.abs(want64 - got64), initial=0.0)) / scale
      if relative > max(FLOAT_TOLERANCE, 2 * float(jnp.finfo(want.dtype).eps)):
        mismatched.append(f"{jax.tree_util.keystr(path)}: relative difference {relative:.3g}")
    elif want.tobytes() != got.tobytes():
      mismatched.append(f"{jax.tree_util.keystr(path)}: {int(np.sum(want != got))} entries differ")
  return mismatched


def single_device_run(name: str) -> tuple[dict, list[float]]:
  """``({"params", "opt_state"}, losses)`` after ``STEPS`` steps on one local device, as numpy."""
  case = CASES[name]
  optimizer = case.factory(**case.kwargs)
  params, target = jax.device_put((host_tree(seed=0, scale=0.1), host_tree(seed=1, scale=0.5)), jax.local_devices()[0])
  params, state, losses = train(train_step(optimizer), params, optimizer.init(params), target, STEPS)
  return jax.device_get({"params": params, "opt_state": state}), losses


def share_single_device_runs(names: list[str], directory: str) -> None:
  """Each of ``names``' single-device runs pickled (or what it raised) into ``directory`` by the process that took it.

  Returns when all are written: the processes then meet at the sharded runs'
  first collective well within its timeout.
  """
  os.makedirs(directory, exist_ok=True)
  for name in names:
    try:
      os.close(os.open(os.path.join(directory, f"{name}.taken"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
      continue
    try:
      run = single_device_run(name)
    except Exception:  # Reported by ``check``, per optimizer.
      run = traceback.format_exc(limit=-8)
    with open(os.path.join(directory, f"{name}.partial"), "wb") as file:
      pickle.dump(run, file)
    os.replace(os.path.join(directory, f"{name}.partial"), os.path.join(directory, f"{name}.pickle"))
  while not all(os.path.exists(os.path.join(directory, f"{name}.pickle")) for name in names):
    time.sleep(0.2)


def check(name: str, checkpoints: str) -> dict:
  with open(os.path.join(checkpoints, "single_device", f"{name}.pickle"), "rb") as file:
    single_device = pickle.load(file)
  if isinstance(single_device, str):
    raise RuntimeError(f"the single-device run raised:\n{single_device}")
  single, single_losses = single_device
  case = CASES[name]
  optimizer = case.factory(**case.kwargs)
  host_params, host_target = host_tree(seed=0, scale=0.1), host_tree(seed=1, scale=0.5)

  mesh = layout.make_mesh(N_DEVICES)
  param_shardings = layout.param_shardings(host_params, mesh)
  params = global_tree(host_params, param_shardings)
  target = global_tree(host_target, param_shardings)
  state_shardings = optax_memopt.state_shardings(jax.eval_shape(optimizer.init, params), params, param_shardings, mesh)
  state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)
  step = train_step(optimizer, (param_shardings, state_shardings))

  expected_params, expected_state, losses = train(step, params, state, target, STEPS)

  params, state, _ = train(step, params, state, target, SAVE_AFTER)
  directory = os.path.join(checkpoints, name)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory, {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()
  fresh = case.factory(**case.kwargs)
  abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": fresh.init(p)}, params)
  abstract = jax.tree.map(
    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
    abstract,
    {"params": param_shardings, "opt_state": state_shardings},
  )
  restored = ocp.StandardCheckpointer().restore(directory, abstract)
  resumed_params, resumed_state, _ = train(step, restored["params"], restored["opt_state"], target, STEPS - SAVE_AFTER)

  return {
    "losses": losses,
    "single_device_losses": single_losses,
    "processes_holding_each_matrix": sorted(
      {len({d.process_index for d in leaf.sharding.device_set}) for leaf in jax.tree.leaves(params) if leaf.ndim == 2}
    ),
    "local_state_bytes": local_bytes(expected_state),
    "global_state_bytes": optax_memopt.state_nbytes(expected_state),
    "resumed_equals_uninterrupted": bitwise_equal(expected_params, resumed_params)
    and bitwise_equal(expected_state, resumed_state),
    "mismatches_to_single_device": mismatched_leaves(single, {"params": expected_params, "opt_state": expected_state}),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--coordinator", required=True, help="host:port of process 0")
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--checkpoints", required=True, help="a folder every process can reach")
  parser.add_argument("names", nargs="*", default=sorted(CASES), help="optimizers of tests.optimizer_cases.CASES")
  args = parser.parse_args()
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
  )
  if jax.device_count() != N_DEVICES:
    raise SystemExit(f"needs {N_DEVICES} devices over all processes, found {jax.device_count()}.")
  share_single_device_runs(args.names, os.path.join(args.checkpoints, "single_device"))
  results = {}
  for name in args.names:
    try:
      results[name] = check(name, args.checkpoints)
    except Exception:  # Reported per optimizer; the test fails on it.
      results[name] = {"error": traceback.format_exc(limit=-8)}
  print(json.dumps({"process_id": jax.process_index(), "results": results}), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
