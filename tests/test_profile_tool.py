"""benchmarks.profile: instructions attributed to the step's stages, runtime events left out, concurrency."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import profile


def _compiled_step():
  @jax.jit
  def select_largest(x):
    return lax.top_k(x, 2)[0]

  def step(x):
    return select_largest(jnp.abs(x)) * 2.0

  return jax.jit(step).lower(jax.ShapeDtypeStruct((8, 64), jnp.float32)).compile()


def test_instructions_carry_their_stage_and_shape():
  described = profile.describe_instructions(_compiled_step().as_text())
  top_k = [(stage, shape) for stage, shape, _ in described.values() if shape.startswith("TopK")]
  assert top_k == [("select_largest", "TopK (f32[8,2], s32[8,2])")]
  assert all("{" not in shape for _, shape, _ in described.values())


def test_parts_are_the_product_of_the_outer_dimension_partitions(seed):
  rng = np.random.default_rng(seed)
  rows, columns = (int(n) for n in rng.integers(1, 5, size=2))
  hlo_text = (
    "  %sine_fusion = f32[64,32]{1,0} fusion(%p), kind=kLoop, calls=%fused,"
    f' backend_config={{"outer_dimension_partitions":["{rows}","{columns}"]}}\n'
    "  %single_fusion = f32[64]{0} fusion(%p), kind=kLoop, calls=%fused.1,"
    ' backend_config={"outer_dimension_partitions":[]}\n'
    "  ROOT %copy.3 = f32[64]{0} copy(%single_fusion)\n"
  )
  described = profile.describe_instructions(hlo_text)
  assert {name: parts for name, (_, _, parts) in described.items()} == {
    "sine_fusion": rows * columns,
    "single_fusion": 1,
    "copy.3": 1,
  }


def test_operation_times_sum_instruction_events_only():
  described = profile.describe_instructions(_compiled_step().as_text())
  names = sorted(described)
  events = [{"ph": "X", "name": name, "dur": 3.0, "pid": 1, "tid": i % 2} for i, name in enumerate(names)]
  events += [
    {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 1000.0, "pid": 1, "tid": 0},
    {"ph": "M", "name": names[0], "pid": 1, "tid": 5},
  ]
  stages, operations, threads = profile.operation_times(events, described)
  assert sum(stages.values()) == 3.0 * len(names)
  assert sum(calls for calls, _ in operations.values()) == len(names)
  assert threads == {(1, 0), (1, 1)} if len(names) > 1 else {(1, 0)}


def test_concurrency_matches_a_count_per_microsecond(seed):
  described = profile.describe_instructions(_compiled_step().as_text())
  names = sorted(described)
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, 200, size=12)
  durations = rng.integers(0, 40, size=12)
  events = [
    {"ph": "X", "name": names[i % len(names)], "ts": float(t), "dur": float(d), "pid": 1, "tid": i % 3}
    for i, (t, d) in enumerate(zip(starts, durations))
  ]
  # Runtime events overlapping everything do not count.
  events.append({"ph": "X", "name": "ThunkExecutor::Execute", "ts": -10.0, "dur": 500.0, "pid": 1, "tid": 0})
  lasting = durations > 0
  first, last = starts[lasting].min(), (starts + durations)[lasting].max()
  running = [int(np.sum((starts <= t) & (t < starts + durations))) for t in range(first, last)]
  expected = {k: float(sum(min(r, 2) == k for r in running)) for k in (0, 1, 2)}
  assert profile.concurrency(events, described) == expected
