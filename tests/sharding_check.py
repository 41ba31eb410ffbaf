"""Every registered optimizer on parameters sharded over 8 CPU devices, as JSON.

Run by ``tests/test_sharding.py`` in a fresh process, because the number of
host-platform devices is fixed when JAX starts::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m tests.sharding_check [names...]

For each optimizer of ``tests.optimizer_cases.SHARDING_CASES``: the parameters are
laid out on a ``("fsdp", "tp") = (4, 2)`` mesh (``benchmarks.sharding``:
FSDP on the first axis of every matrix, tensor parallelism on the last,
vectors replicated), the state is initialised by
``jax.jit(init, out_shardings=state_shardings(...))``, and a jitted train
step (update and ``apply_updates``, output shardings left to the
partitioner) runs on fixed random gradients beside the same steps on one
device. The same steps run again on a mesh of ``AxisType.Explicit`` axes,
where every array's sharding is part of its type, under ``jax.set_mesh`` and
without it. A checkpoint of the
single-device run, saved with orbax midway, is restored into the sharded
layout and training continues from it.

The shapes divide the mesh, and the registry's block sizes divide the
shards: the matrices have ``2**13``, ``2**17`` or ``3 * 2**14`` elements, so an eighth
of one is a whole number of MicroAdam's 256-element blocks and 64-element
buckets and of ternary Adam's 32-element blocks; Adam-mini's 4 query heads of
128 columns fall two to a tensor-parallel shard; TACO's rows follow ``fsdp``
and their parts ``tp`` (the default four parts, two per shard). The
96-wide output kernel is where blocks and ``tp`` do not meet: its rows hold
three of ternary Adam's blocks (and of TACO's parts at ``k = 3``), which
cannot split over ``tp = 2``; their state then splits its rows over both mesh
axes, while the scales of 4-bit AdamW's three blocks (codes in the kernel's
layout) are replicated over ``tp``. TACO's one-segment rule keeps each row
whole over ``tp``. The 32-wide gate kernel's rows are one ternary block each:
its codes keep the kernel's rows, and so do its row statistics.

Prints one JSON object: ``{name: result}``, where a result holds the
measurements ``tests/test_sharding.py`` asserts on, or ``{"error": ...}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback

# The device count is read once, when JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  (the device count must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import optax_memopt  # noqa: E402
from benchmarks import sharding as layout  # noqa: E402
from optax_memopt import state_nbytes  # noqa: E402
from tests.optimizer_cases import SHARDING_CASES  # noqa: E402

N_DEVICES = 8
STEPS = 4
RESTORE_AFTER = 2


def make_params(seed: int = 0, dtype: str = "float32") -> dict:
  """A small Transformer-shaped tree of ``dtype`` whose matrices dominate the state."""
  shapes = {
    "embed": {"embedding": (512, 256)},
    "attention": {"query": {"kernel": (256, 512)}, "out": {"kernel": (512, 96)}},
    "mlp": {
      "up": {"kernel": (256, 512), "bias": (512,)},
      "down": {"kernel": (512, 256)},
      "gate": {"kernel": (256, 32)},
    },
    "mlp_norm": {"scale": (256,)},
  }
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(treedef, [rng.normal(0.0, 0.1, shape).astype(np.float32).astype(dtype) for shape in leaves])


def make_gradients(params: dict, steps: int, seed: int = 1) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda p: rng.normal(0.0, 1e-2, p.shape).astype(np.float32), params) for _ in range(steps)]


def train_step(optimizer):
  """The jitted step; output shardings are left to the partitioner."""

  @jax.jit
  def step(params, state, grads):
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def train(step, params, state, gradients) -> list:
  """(params, state) after each step."""
  trajectory = []
  for grads in gradients:
    params, state = step(params, state, grads)
    trajectory.append((params, state))
  return trajectory


def is_code(dtype) -> bool:
  """Integers, booleans and floats narrower than float32: values stored, not summed, per step."""
  dtype = np.dtype(dtype)
  return not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits < 32


def differences(expected, actual) -> dict:
  """How ``actual`` departs from ``expected``, leaf by leaf.

  ``structure`` is empty when both trees have the same structure, shapes and
  dtypes, else it says where they differ (and no leaf is compared). Rows:
  codes (``is_code``) count the entries that differ bitwise; float32 leaves
  give their largest difference in units of float32's epsilon times the
  expected leaf's largest magnitude, and whether finiteness differs.
  """
  if jax.tree.structure(expected) != jax.tree.structure(actual):
    return {
      "structure": f"{jax.tree.structure(expected)} != {jax.tree.structure(actual)}",
      "rows": [],
    }
  rows, structure = [], []
  for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual), strict=True):
    want, got = np.asarray(want), np.asarray(got)
    name = jax.tree_util.keystr(path)
    if (want.shape, want.dtype) != (got.shape, got.dtype):
      structure.append(f"{name}: {want.dtype}{list(want.shape)} != {got.dtype}{list(got.shape)}")
      continue
    row = {"path": name, "dtype": str(want.dtype)}
    if is_code(want.dtype):
      # Bitwise: NaN payloads and signed zeros count as the stored value.
      row["mismatched"] = int(np.sum(want.view(f"u{want.itemsize}") != got.view(f"u{want.itemsize}")))
    else:
      want64, got64 = want.astype(np.float64), got.astype(np.float64)
      finite = np.isfinite(want64) & np.isfinite(got64)
      scale = float(np.max(np.abs(want64[finite]), initial=0.0)) or 1.0
      row["ulps"] = float(np.max(np.abs(want64 - got64)[finite], initial=0.0) / (scale * np.finfo(np.float32).eps))
      row["non_finite_mismatch"] = bool(np.any(np.isfinite(want64) != np.isfinite(got64)))
    rows.append(row)
  return {"structure": "; ".join(structure), "rows": rows}


def bitwise_equal(expected, actual) -> bool:
  return jax.tree.structure(expected) == jax.tree.structure(actual) and all(
    np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True)
  )


def sharding_changes(before, after) -> list[str]:
  if jax.tree.structure(before) != jax.tree.structure(after):
    return [f"structure: {jax.tree.structure(before)} -> {jax.tree.structure(after)}"]
  return [
    f"{jax.tree_util.keystr(path)}: {old.sharding} -> {new.sharding}"
    for (path, old), new in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after), strict=True)
    if not new.sharding.is_equivalent_to(old.sharding, old.ndim)
  ]


def restore_sharded(saved, directory, shardings):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory, saved)
  checkpointer.wait_until_finished()
  target = jax.tree.map(
    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
    saved,
    shardings,
  )
  return checkpointer.restore(directory, target)


def explicit_axes_run(optimizer, host_params, gradients, *, set_mesh: bool):
  """The same steps on a mesh whose axes are ``AxisType.Explicit``: (params, state) at the end.

  With ``set_mesh``, under ``jax.set_mesh``; else with the mesh only in the
  arrays' types (``jax.make_mesh``'s default axes, no mesh set).
  """
  mesh = layout.make_mesh(N_DEVICES, axis_type=AxisType.Explicit)
  param_shardings = layout.param_shardings(host_params, mesh)
  with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
    params = jax.device_put(host_params, param_shardings)
    abstract_state = jax.eval_shape(optimizer.init, params)
    state_shardings = optax_memopt.state_shardings(abstract_state, params, param_shardings, mesh)
    state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)
    grads = [jax.device_put(g, param_shardings) for g in gradients]
    return train(train_step(optimizer), params, state, grads)[-1]


def check(name: str, workdir: str) -> dict:
  case = SHARDING_CASES[name]
  optimizer = case.factory(**case.kwargs)
  host_params = make_params(dtype=jnp.dtype(case.param_dtype))
  gradients = make_gradients(host_params, STEPS)

  single_device = jax.devices()[0]
  params = jax.device_put(host_params, single_device)
  single_run = train(train_step(optimizer), params, optimizer.init(params), gradients)

  mesh = layout.make_mesh(N_DEVICES)
  param_shardings = layout.param_shardings(host_params, mesh)
  params = jax.device_put(host_params, param_shardings)
  abstract_state = jax.eval_shape(optimizer.init, params)
  state_shardings = optax_memopt.state_shardings(abstract_state, params, param_shardings, mesh)
  state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)
  initial_state = state
  sharded_grads = [jax.device_put(g, param_shardings) for g in gradients]
  step = train_step(optimizer)
  sharded_run = train(step, params, state, sharded_grads)
  final_params, final_state = sharded_run[-1]

  total = state_nbytes(final_state)
  result = {
    "param_differences": differences(single_run[-1][0], final_params),
    "state_differences": differences(single_run[-1][1], final_state),
    "state_sharding_changes": sharding_changes(initial_state, final_state),
    "param_sharding_changes": sharding_changes(params, final_params),
    "total_state_bytes": total,
    "per_device_state_bytes": sorted(layout.per_device_bytes(final_state).values()),
    "split_like_params_bytes": layout.split_like_params_bytes(final_state, final_params, param_shardings),
    "under_split_leaves": layout.under_split_leaves(final_state, final_params, param_shardings, 0.01 * total),
  }

  for prefix, set_mesh in (("explicit", True), ("explicit_unset", False)):
    try:
      explicit_params, explicit_state = explicit_axes_run(optimizer, host_params, gradients, set_mesh=set_mesh)
      result[f"{prefix}_param_differences"] = differences(single_run[-1][0], explicit_params)
      result[f"{prefix}_state_differences"] = differences(single_run[-1][1], explicit_state)
    except Exception:  # Reported on its own; the other measurements stand.
      result[f"{prefix}_error"] = traceback.format_exc(limit=-6)

  saved_params, saved_state = single_run[RESTORE_AFTER - 1]
  restored = restore_sharded(
    {"params": saved_params, "opt_state": saved_state},
    os.path.join(workdir, name),
    {"params": param_shardings, "opt_state": state_shardings},
  )
  resumed = train(step, restored["params"], restored["opt_state"], sharded_grads[RESTORE_AFTER:])
  result["restored_bitwise_equal"] = bitwise_equal({"params": saved_params, "opt_state": saved_state}, restored)
  result["restored_sharding_changes"] = sharding_changes({"params": params, "opt_state": initial_state}, restored)
  result["resumed_state_differences"] = differences(single_run[-1][1], resumed[-1][1])
  result["resumed_param_differences"] = differences(single_run[-1][0], resumed[-1][0])
  return result


def main(names: list[str]) -> None:
  if jax.device_count() < N_DEVICES:
    raise SystemExit(
      f"needs {N_DEVICES} devices, found {jax.device_count()}: set"
      f" XLA_FLAGS=--xla_force_host_platform_device_count={N_DEVICES} before JAX starts."
    )
  results = {}
  with tempfile.TemporaryDirectory() as workdir:
    # Each step is traced and lowered on its own; a program lowered twice (the
    # explicit-axes steps with and without ``jax.set_mesh`` lower to the same
    # one) is compiled once, from a cache of this run only.
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "compiled"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    for name in names or sorted(SHARDING_CASES):
      start = time.perf_counter()
      try:
        results[name] = check(name, workdir)
        results[name]["seconds"] = time.perf_counter() - start
      except Exception:  # Reported per optimizer; the test fails on it.
        results[name] = {"error": traceback.format_exc(limit=-6)}
  print(json.dumps(results))


if __name__ == "__main__":
  main(sys.argv[1:])
