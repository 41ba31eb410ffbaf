"""The whole training step compiled for a GPU without one: its peak, its parts, the largest batch.

The parts are checked against sizes known without the compile (parameters,
gradients, AdamW's state, the batch: 4 bytes per float32 element) and against
XLA's own argument, output and alias figures; the compiles need JAX's CUDA
plugin (the gpu-compile lane), the search for the largest batch does not.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from memopt_tools import fit, gpu_compile, train_compile
from memopt_tools.training import loop, model
from tests.test_gpu_compile import needs_plugin

IN, HIDDEN, OUT = 64, 256, 8


def mlp_loss(params, batch):
  hidden = jax.nn.relu(batch["x"] @ params["w1"])
  return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def mlp(batch_size):
  params = {
    "w1": jax.ShapeDtypeStruct((IN, HIDDEN), jnp.float32),
    "w2": jax.ShapeDtypeStruct((HIDDEN, OUT), jnp.float32),
  }
  batch = {
    "x": jax.ShapeDtypeStruct((batch_size, IN), jnp.float32),
    "y": jax.ShapeDtypeStruct((batch_size, OUT), jnp.float32),
  }
  return params, batch


@needs_plugin
def test_the_peak_is_made_of_parameters_gradients_state_batch_activations_and_the_update():
  n = IN * HIDDEN + HIDDEN * OUT
  params, batch = mlp(512)
  program = train_compile.compile_train_step(mlp_loss, params, batch, optax.adamw(1e-3))
  assert program.n_params == n
  assert program.param_bytes == program.gradient_bytes == 4 * n
  assert program.state_bytes == 8 * n + 4  # AdamW's m and v in float32, and its step count.
  assert program.batch_bytes == 4 * 512 * (IN + OUT)
  # XLA's own figures: the step reads parameters, state and batch, writes parameters,
  # state and the loss, and updates the donated parameters and state in place.
  assert program.argument_bytes == program.param_bytes + program.state_bytes + program.batch_bytes
  # The outputs (8 arrays) are returned as a tuple: XLA adds its table of 8-byte pointers.
  assert program.output_bytes == program.param_bytes + program.state_bytes + 4 + 8 * 8
  assert program.alias_bytes == program.param_bytes + program.state_bytes
  # The backward pass holds the hidden layer (512 x 256 float32) from the forward pass and
  # its gradient, beside the gradient program's arguments and outputs.
  hidden = 4 * 512 * HIDDEN
  assert 2 * hidden <= program.activations_bytes <= 2 * hidden + program.batch_bytes
  assert program.peak_bytes >= program.argument_bytes + hidden
  parts = (program.param_bytes, program.gradient_bytes, program.state_bytes, program.batch_bytes)
  assert program.update_bytes == program.peak_bytes - sum(parts) - program.activations_bytes
  # The peak alone (what --largest-batch compiles) is the whole step's.
  assert train_compile.train_step_peak_bytes(mlp_loss, params, batch, optax.adamw(1e-3), target="h100") == (
    program.peak_bytes
  )
  # The activations are the forward and backward pass's, whatever the optimizer.
  sgd = train_compile.compile_train_step(mlp_loss, params, batch, optax.sgd(1e-3))
  assert sgd.activations_bytes == program.activations_bytes and sgd.state_bytes == 0
  # Twice the batch: at least one more hidden layer of activations.
  double = train_compile.compile_train_step(mlp_loss, params, mlp(1024)[1], optax.adamw(1e-3))
  assert double.activations_bytes - program.activations_bytes >= hidden


@needs_plugin
def test_fits_keeps_the_margin_free():
  params, batch = mlp(64)
  program = train_compile.compile_train_step(mlp_loss, params, batch, optax.sgd(1e-3), memory=10**9)
  exact = dataclasses.replace(program, memory=program.peak_bytes, margin=0.0)
  assert exact.fits and not dataclasses.replace(exact, memory=program.peak_bytes - 1).fits
  assert not dataclasses.replace(program, memory=math.ceil(program.peak_bytes / 0.95), margin=0.10).fits
  assert program.memory == 10**9 and program.margin == train_compile.MARGIN
  with pytest.raises(ValueError, match="margin"):
    train_compile.compile_train_step(mlp_loss, params, batch, optax.sgd(1e-3), margin=1.0)


def _tiny_llama(remat="none"):
  config = dataclasses.replace(fit.MODELS["tiny"], remat=remat)
  graphdef = nnx.split(nnx.eval_shape(lambda: model.Transformer(config, rngs=nnx.Rngs(0))))[0]
  return (lambda p, b: loop.next_token_loss(graphdef, p, b)), fit.model_params("tiny")


@needs_plugin
@pytest.mark.parametrize("target", gpu_compile.TARGETS)
def test_a_small_models_train_step_compiles_for_every_target(target):
  loss_fn, params = _tiny_llama()
  tokens = jax.ShapeDtypeStruct((4, 65), jnp.int32)
  # MicroAdam's step holds a Triton kernel (error_feedback.feedback_step, pallas_kernels.dispatch):
  # compiled through ptxas for the target's architecture.
  report = train_compile.train_step_report(loss_fn, params, tokens, target=target, optimizer_names=["microadam"])
  program = report.programs["microadam"]
  assert program.target == target and program.memory == gpu_compile.device_memory_bytes(target)
  # The descriptions' memory: 80 GB (H100), 141 GB (H200), about 180 GB (B200), as their drivers report it.
  assert program.memory / 2**30 > {"h100": 79, "h200": 140, "b200": 178}[target]
  assert program.activations_bytes > 0 and program.fits
  assert f"one {target.upper()}" in str(report) and "| microadam |" in str(report)
  assert "| activations and the rest | the update |" in str(report)


@needs_plugin
def test_microadams_update_makes_no_buffer_before_the_backward_pass():
  """What depends on nothing, XLA:GPU schedules with the step's arguments, before the forward pass.

  MicroAdam's compacted directions and bitmaps, made uninitialized or from
  constants, were so made for every tensor and held through the backward
  pass's peak (1.7 GB on Llama-3-8B at batch 8); each is now computed from
  its tensor's ring (``pallas_kernels.microadam_update``).
  """
  loss_fn, params = _tiny_llama()
  tokens = jax.ShapeDtypeStruct((4, 65), jnp.int32)
  tx = train_compile.registered_optimizer("microadam")
  compiled = train_compile._compiled_step(loss_fn, params, jax.eval_shape(tx.init, params), tokens, tx, "h100")
  entry, bodies = gpu_compile._computations(compiled.as_text())
  # The entry computation of a scheduled module lists its instructions in their order of execution.
  schedule = [(line, shape) for line, _, shape, _, _ in gpu_compile._instructions(bodies[entry], {})]
  backward = next(i for i, (line, _) in enumerate(schedule) if "transpose(jvp" in line)
  # Beside the buffers, the update computes only scalars and the window's weights before its gradient.
  early = [
    line.strip()[:160]
    for line, shape in schedule[:backward]
    if "_microadam_update" in line and gpu_compile.shape_bytes(shape) >= 1024
  ]
  assert not early, "\n".join(early)


@needs_plugin
def test_rematerializing_every_layer_keeps_fewer_activations():
  tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
  kept = {}
  for remat in ("none", "full"):
    loss_fn, params = _tiny_llama(remat)
    kept[remat] = train_compile.compile_train_step(loss_fn, params, tokens, optax.sgd(1e-3)).activations_bytes
  assert kept["full"] < kept["none"]


def test_largest_batch_follows_the_line_and_confirms_with_the_next_size():
  calls = []

  def peak(batch):
    calls.append(batch)
    return 100 + 7 * batch

  found = train_compile.largest_batch(peak, 150, first=1, second=2)
  assert found.batch == 7 and found.confirmed  # 149 fits, 156 does not.
  assert set(found.peaks) == set(calls) and len(calls) == 4

  # A step in the line (XLA schedules differently past some size): compiles find it.
  found = train_compile.largest_batch(lambda b: 100 + 7 * b + (20 if b > 5 else 0), 150, first=1, second=2)
  assert found.batch == 5 and found.confirmed
  # Nothing fits.
  assert train_compile.largest_batch(lambda b: 200 + b, 150).batch == 0


@needs_plugin
def test_the_planners_training_step_and_largest_batch(capsys):
  fit.main(
    ["--model", "tiny", "--compile", "h100", "--batch", "2", "--seq-len", "32", "--optimizers", "adamw"]
    + ["--memory", "3MB", "--margin", "0", "--largest-batch"]
  )
  out = capsys.readouterr().out
  assert "the training step compiled by XLA for one H100" in out and "| adamw |" in out
  line = next(line for line in out.splitlines() if "the largest batch that fits" in line)
  batch = int(re.search(r"fits in [\d.]+ \w+ is (\d+)", line).group(1))
  peaks = {int(b): float(p) for b, p in re.findall(r"(\d+): ([\d.]+) MB", line)}
  assert batch in peaks and batch + 1 in peaks
  assert peaks[batch] <= 3.0 < peaks[batch + 1]


def test_the_planner_refuses_a_training_step_without_a_target(capsys):
  with pytest.raises(SystemExit):
    fit.main(["--model", "tiny", "--batch", "2"])
  assert "--batch" in capsys.readouterr().err


def test_the_training_step_table_renders_each_row():
  from benchmarks import train_step_compile

  row = dict(model="llama3_8b", target="b200", param_dtype="bfloat16", optimizer="adamw_4bit", remat="full")
  row |= dict(seq_len=2048, batch=4, params=16e9, gradients=16e9, state=8.5e9, batch_bytes=32e3, activations=25e9)
  row |= dict(peak=61e9)
  row |= dict(memory=191514050560, margin=0.1, fits=True)
  table = train_step_compile.render({"jax": "0.10.2", "rows": [row]})
  assert (
    "| Llama-3-8B | B200 (191.5, 172.4) | bfloat16 | adamw_4bit | full | 4 x 2048"
    " | 24.5 | 16.0 | 25.0 | -4.5 | 61.0 | yes |" in table
  )
  assert "No training step" in train_step_compile.render({"jax": "0.10.2", "rows": []})
