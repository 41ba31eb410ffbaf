"""Compiling steps for an H100 without a GPU: the byte counter, the step's figures, the planner's option.

The counter is checked on hand-written HLO whose traffic is known, and (where
JAX's CUDA plugin is installed: the CI's gpu-compile lane sets
``OPTAX_MEMOPT_GPU_COMPILE=required`` so that a missing plugin fails there
instead of skipping) on programs XLA compiles for an H100: AdamW moves 28
bytes per float32 parameter, a scaled copy 8 per element, a sum 4.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

from memopt_tools import gpu_compile


def _plugin_present() -> bool:
  try:
    gpu_compile.target_devices()
  except gpu_compile.GpuCompilerMissing:
    return False
  return True


PLUGIN = _plugin_present()
REQUIRED = os.environ.get("OPTAX_MEMOPT_GPU_COMPILE") == "required"
needs_plugin = pytest.mark.skipif(
  not PLUGIN and not REQUIRED, reason="JAX's CUDA plugin is not installed (the gpu-compile extra)"
)

# An optimized module in XLA's text format: a multi-output fusion over two
# f32[1024] parameters, a while loop of 3 trips whose body runs one fusion
# over f32[256], an asynchronous copy pair, and the free operations (an
# uninitialized buffer among them).
HLO = """HloModule jit_step, entry_computation_layout={(f32[1024]{0})->f32[1024]{0}}

%fused_add (p0: f32[1024], p1: f32[1024]) -> (f32[1024], bf16[1024]) {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  %add = f32[1024]{0} add(%p0, %p1)
  %convert = bf16[1024]{0} convert(%add)
  ROOT %tuple = (f32[1024]{0}, bf16[1024]{0}) tuple(%add, %convert)
}

%body (state: (s32[], f32[256])) -> (s32[], f32[256]) {
  %state = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[256]{0} get-tuple-element(%state), index=1
  %scaled = f32[256]{0} fusion(%x), kind=kLoop, calls=%fused_scale
  ROOT %next = (s32[], f32[256]{0}) tuple(%i, %scaled)
}

ENTRY %main (a: f32[1024], b: f32[1024], c: f32[256]) -> (f32[1024], bf16[1024], f32[256]) {
  %a = f32[1024]{0} parameter(0), sharding={replicated}
  %b = f32[1024]{0} parameter(1)
  %c = f32[256]{0} parameter(2)
  %zero = s32[] constant(0)
  %empty = f32[4096]{0} custom-call(), custom_call_target="AllocateBuffer"
  %fusion = (f32[1024]{0}, bf16[1024]{0}) fusion(%a, %b), kind=kLoop, calls=%fused_add, metadata={op_name="x(y)"}
  %sum = f32[1024]{0} get-tuple-element(%fusion), index=0
  %half = bf16[1024]{0} get-tuple-element(%fusion), index=1
  %view = f32[32,32]{1,0} bitcast(%sum)
  %init = (s32[], f32[256]{0}) tuple(%zero, %c)
  %while = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[256]{0} get-tuple-element(%while), index=1
  %copy-start = (f32[256]{0}, f32[256]{0}, u32[]) copy-start(%out)
  %copy-done = f32[256]{0} copy-done(%copy-start)
  ROOT %result = (f32[1024]{0}, bf16[1024]{0}, f32[256]{0}) tuple(%sum, %half, %copy-done)
}
"""


def test_shape_bytes_counts_every_array_of_a_shape():
  assert gpu_compile.shape_bytes("f32[4,8]{1,0}") == 128
  assert gpu_compile.shape_bytes("(bf16[10]{0}, u8[3], s32[], pred[2])") == 20 + 3 + 4 + 2
  assert gpu_compile.shape_bytes("f8e4m3fn[16]{0}") == 16
  assert gpu_compile.shape_bytes("s4[6]") == 3


def test_bytes_moved_reads_operands_and_writes_results_once_per_top_level_operation():
  fusion = 2 * 4096 + (4096 + 2048)  # reads a and b, writes the f32 and bf16 results
  loop = 3 * (1024 + 1024)  # three trips of a fusion reading and writing f32[256]
  copy = 1024 + (1024 + 1024 + 4)  # copy-start reads f32[256], writes its tuple; copy-done is free
  assert gpu_compile.bytes_moved(HLO) == fusion + loop + copy


# A loop writing a f32[1024] output in place, a chunk of 256 per trip: a
# fusion slicing the chunk's input out of a f32[1024] parameter and writing it
# into the output with dynamic-update-slice, and one scatter-adding 16
# elements into a u32[512] bitmap.
IN_PLACE_HLO = """HloModule jit_step

%fused_update (p0: f32[1024], p1: f32[1024], p2: s32[]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  %p2 = s32[] parameter(2)
  %chunk = f32[256]{0} dynamic-slice(%p1, %p2), dynamic_slice_sizes={256}
  %doubled = f32[256]{0} add(%chunk, %chunk)
  ROOT %update = f32[1024]{0} dynamic-update-slice(%p0, %doubled, %p2)
}

%fused_scatter (q0: u32[512], q1: s32[16,1], q2: u32[16]) -> u32[512] {
  %q0 = u32[512]{0} parameter(0)
  %q1 = s32[16,1]{1,0} parameter(1)
  %q2 = u32[16]{0} parameter(2)
  ROOT %scatter = u32[512]{0} scatter(%q0, %q1, %q2), update_window_dims={}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%body (state: (s32[], f32[1024], f32[1024], u32[512], s32[16,1], u32[16])) -> (s32[], f32[1024], f32[1024], u32[512], s32[16,1], u32[16]) {
  %state = (s32[], f32[1024]{0}, f32[1024]{0}, u32[512]{0}, s32[16,1]{1,0}, u32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %out = f32[1024]{0} get-tuple-element(%state), index=1
  %in = f32[1024]{0} get-tuple-element(%state), index=2
  %bitmap = u32[512]{0} get-tuple-element(%state), index=3
  %where = s32[16,1]{1,0} get-tuple-element(%state), index=4
  %bits = u32[16]{0} get-tuple-element(%state), index=5
  %written = f32[1024]{0} fusion(%out, %in, %i), kind=kLoop, calls=%fused_update
  %marked = u32[512]{0} fusion(%bitmap, %where, %bits), kind=kInput, calls=%fused_scatter
  ROOT %next = (s32[], f32[1024]{0}, f32[1024]{0}, u32[512]{0}, s32[16,1]{1,0}, u32[16]{0}) tuple(%i, %written, %in, %marked, %where, %bits)
}

ENTRY %main (init: (s32[], f32[1024], f32[1024], u32[512], s32[16,1], u32[16])) -> (s32[], f32[1024], f32[1024], u32[512], s32[16,1], u32[16]) {
  %init = (s32[], f32[1024]{0}, f32[1024]{0}, u32[512]{0}, s32[16,1]{1,0}, u32[16]{0}) parameter(0)
  ROOT %while = (s32[], f32[1024]{0}, f32[1024]{0}, u32[512]{0}, s32[16,1]{1,0}, u32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""  # noqa: E501 (HLO lines as XLA writes them)


def test_in_place_updates_and_slices_count_the_parts_they_touch():
  update = 1024 + 4 + 1024  # reads the chunk and the offset, writes the chunk; the output is not read
  scatter = (64 + 64) + (64 + 64)  # reads 16 indices, 16 updates and the 16 words it adds to; writes those
  assert gpu_compile.bytes_moved(IN_PLACE_HLO) == 4 * (update + scatter)


def test_a_while_loop_without_a_known_trip_count_is_refused():
  with pytest.raises(ValueError, match="known trip count"):
    gpu_compile.bytes_moved(HLO.replace('backend_config={"known_trip_count":{"n":"3"}}', ""))


# A step that branches, as optax.contrib.galore's does (its SVD every
# update_proj_gap steps): a conditional, written as XLA:GPU writes a lax.cond,
# whose true branch copies f32[1024] twice and whose false branch once.
BRANCHING_HLO = """HloModule jit_step

%twice (p: (f32[1024])) -> (f32[1024]) {
  %p = (f32[1024]{0}) parameter(0)
  %x = f32[1024]{0} get-tuple-element(%p), index=0
  %one = f32[1024]{0} copy(%x)
  %two = f32[1024]{0} copy(%one)
  ROOT %out = (f32[1024]{0}) tuple(%two)
}

%once (p: (f32[1024])) -> (f32[1024]) {
  %p = (f32[1024]{0}) parameter(0)
  %x = f32[1024]{0} get-tuple-element(%p), index=0
  %one = f32[1024]{0} copy(%x)
  ROOT %out = (f32[1024]{0}) tuple(%one)
}

ENTRY %main (flag: pred[], a: f32[1024]) -> (f32[1024]) {
  %flag = pred[] parameter(0)
  %a = f32[1024]{0} parameter(1)
  %args = (f32[1024]{0}) tuple(%a)
  ROOT %cond = (f32[1024]{0}) conditional(%flag, %args, %args), true_computation=%twice, false_computation=%once
}
"""


def test_a_conditional_counts_its_costliest_branch_or_on_request_its_cheapest():
  assert gpu_compile.bytes_moved(BRANCHING_HLO) == 2 * 8192
  assert gpu_compile.bytes_moved(BRANCHING_HLO, branch=min) == 8192


# A sharded module's collectives: a synchronous all-reduce of f32[1024] and
# an asynchronous all-gather pair of bf16[256] -> bf16[2048] in the entry, a
# reduce-scatter of f32[4096] -> f32[512] wrapped in an async computation,
# and a collective-permute of s32[8] in a while loop of 5 trips.
COLLECTIVES_HLO = """HloModule jit_step

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (w: f32[4096]) -> f32[512] {
  %w = f32[4096]{0} parameter(0)
  ROOT %rs = f32[512]{0} reduce-scatter(%w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

%body (state: (s32[], s32[8])) -> (s32[], s32[8]) {
  %state = (s32[], s32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %v = s32[8]{0} get-tuple-element(%state), index=1
  %permuted = s32[8]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}
  ROOT %next = (s32[], s32[8]{0}) tuple(%i, %permuted)
}

%cond (state: (s32[], s32[8])) -> pred[] {
  %state = (s32[], s32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[1024], b: bf16[256], c: f32[4096], d: s32[8]) -> (f32[1024], bf16[2048], f32[512]) {
  %a = f32[1024]{0} parameter(0)
  %b = bf16[256]{0} parameter(1)
  %c = f32[4096]{0} parameter(2)
  %d = s32[8]{0} parameter(3)
  %reduced = f32[1024]{0} all-reduce(%a), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %gather-start = (bf16[256]{0}, bf16[2048]{0}) all-gather-start(%b), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %gather-done = bf16[2048]{0} all-gather-done(%gather-start)
  %rs-start = ((f32[4096]{0}), f32[512]{0}) async-start(%c), calls=%wrapped_reduce_scatter
  %rs-done = f32[512]{0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  %zero = s32[] constant(0)
  %init = (s32[], s32[8]{0}) tuple(%zero, %d)
  %loop = (s32[], s32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = (f32[1024]{0}, bf16[2048]{0}, f32[512]{0}) tuple(%reduced, %gather-done, %rs-done)
}
"""


def test_collective_bytes_counts_each_collective_once_at_its_larger_side():
  assert gpu_compile.collective_bytes(COLLECTIVES_HLO) == {
    "all-reduce": 4 * 1024,
    "all-gather": 2 * 2048,  # the gathered result, not the start's tuple of operand and result
    "reduce-scatter": 4 * 4096,  # the whole operand, once though the async pair names the computation twice
    "all-to-all": 0,
    "collective-permute": 5 * 4 * 8,  # once per trip
  }
  assert set(gpu_compile.collective_bytes(HLO).values()) == {0}


def test_unknown_targets_and_device_counts_are_refused_by_name():
  with pytest.raises(ValueError, match="target must be one of h100"):
    gpu_compile.target_devices("a100")
  with pytest.raises(ValueError, match="devices must be an integer >= 1"):
    gpu_compile.target_devices("h100", 0)
  with pytest.raises(ValueError, match="hosts must be an integer >= 1"):
    gpu_compile.target_devices("h100", 8, 0)


@pytest.mark.skipif(PLUGIN, reason="the CUDA plugin is installed")
def test_without_the_plugin_the_error_says_how_to_install_it():
  with pytest.raises(gpu_compile.GpuCompilerMissing, match=r"optax-memopt\[gpu-compile\]"):
    gpu_compile.compile_step(optax.adamw(1e-3), {"w": jax.ShapeDtypeStruct((8,), jnp.float32)})
  run = subprocess.run(
    [sys.executable, "-m", "optax_memopt.fit", "--model", "tiny", "--compile", "h100"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 2
  assert "--compile h100" in run.stderr and "gpu-compile" in run.stderr
  # Refused before any work: the arithmetic table was not printed.
  assert "optimizer" not in run.stdout


def _compiled(fn, *shapes):
  (device,) = gpu_compile.target_devices()
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
  return jax.jit(fn).lower(*args).compile().as_text()


@needs_plugin
def test_on_an_h100_program_a_copy_moves_8_bytes_and_a_sum_4_per_element():
  x = jax.ShapeDtypeStruct((1 << 22,), jnp.float32)
  assert gpu_compile.bytes_moved(_compiled(lambda x: 2 * x, x)) == 8 * x.size
  # The sum's partial results add a few bytes per block.
  assert gpu_compile.bytes_moved(_compiled(jnp.sum, x)) / x.size == pytest.approx(4, rel=1e-2)


@needs_plugin
def test_adamw_moves_28_bytes_per_float32_parameter_with_no_temporaries():
  params = {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32), "b": jax.ShapeDtypeStruct((4096,), jnp.float32)}
  program = gpu_compile.compile_step(optax.adamw(1e-3), params)
  assert program.n_params == 1024 * 4096 + 4096
  assert program.moved_bytes / program.n_params == pytest.approx(28, rel=1e-4)
  assert program.state_bytes == 8 * program.n_params + 4  # m, v and the step count
  assert program.param_bytes == program.gradient_bytes == 4 * program.n_params
  assert 0 <= program.temporaries_bytes < 1e-3 * program.n_params


@needs_plugin
def test_a_sharded_step_is_compiled_per_device():
  params = {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32)}
  program = gpu_compile.compile_step(optax.adamw(1e-3), params, devices=4)
  assert program.param_bytes == 4 * 1024 * 4096 // 4
  assert program.moved_bytes / (program.n_params / 4) == pytest.approx(28, rel=1e-3)


@needs_plugin
def test_collectives_of_a_program_compiled_for_two_hosts_of_eight():
  params = {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32)}
  # AdamW's elementwise step moves nothing between devices.
  program = gpu_compile.compile_step(optax.adamw(1e-3), params, devices=8, hosts=2)
  assert program.param_bytes == 4 * 1024 * 4096 // 16
  assert set(program.collectives.values()) == {0}
  # A global norm (clipping) all-reduces a scalar: 4 bytes.
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  program = gpu_compile.compile_step(clipped, params, devices=8, hosts=2)
  assert program.collectives == {**dict.fromkeys(gpu_compile.COLLECTIVES, 0), "all-reduce": 4}
  # Tensor parallelism over the last axis as well: still elementwise, nothing moves.
  program = gpu_compile.compile_step(optax.adamw(1e-3), params, devices=8, tensor_parallel=2)
  assert program.param_bytes == 4 * 1024 * 4096 // 8
  assert set(program.collectives.values()) == {0}
  # The planner's sharded table (fit --devices N --compile h100) shows them.
  report = gpu_compile.peak_report(params, devices=8, optimizer_names=["adamw"])
  assert "| collectives |" in str(report) and report.rows[0].collective_bytes == 0


@needs_plugin
@pytest.mark.parametrize("name", ["microadam", "taco"])
def test_block_and_row_steps_sharded_over_8_h100s_step_each_shard_alone(name):
  import optax_memopt

  # MicroAdam: 128 blocks of 16384 (the default), 16 whole blocks on each
  # device: the selection, the error feedback, the window's bitmap and update
  # stay local; its Pallas kernels, which the partitioner cannot split, run
  # on each device's part. TACO: each device selects in its own rows (XLA's
  # reductions, which the partitioner splits by rows).
  params = {"w": jax.ShapeDtypeStruct((2048, 1024), jnp.float32)}
  program = gpu_compile.compile_step(getattr(optax_memopt, name)(1e-3), params, devices=8)
  assert program.param_bytes == 4 * 2048 * 1024 // 8
  assert set(program.collectives.values()) == {0}


@needs_plugin
def test_peak_report_on_eval_shape_params_and_the_planners_option():
  import flax.linen as nn

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(10)(nn.relu(nn.Dense(512)(x)))

  params = jax.eval_shape(Mlp().init, jax.random.key(0), jnp.zeros((1, 256)))
  report = gpu_compile.peak_report(params, optimizer_names=["adamw", "adamw_4bit"], memory=10**9)
  adamw, lowbit = report.rows
  n = 256 * 512 + 512 + 512 * 10 + 10
  assert report.n_params == n
  assert adamw.arithmetic_bytes == 16 * n + 4  # params, grads, m and v in float32, the count
  assert adamw.peak_bytes >= adamw.arithmetic_bytes and lowbit.arithmetic_bytes < adamw.arithmetic_bytes
  assert report.fits("adamw") and "| adamw |" in str(report)

  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "memopt_tools.fit",
      "--model",
      "tiny",
      "--compile",
      "h100",
      "--optimizers",
      "adamw",
      "adam_mini",
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stderr
  assert "XLA's peak" in run.stdout and "| adam_mini |" in run.stdout.split("XLA's peak")[1]
