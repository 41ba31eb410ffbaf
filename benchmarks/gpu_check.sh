#!/usr/bin/env bash
# GPU readiness in one call, on a machine with an NVIDIA H200 and JAX, optax,
# flax and chex preinstalled (no network needed): uses this checkout without
# installing it. Times the optimizers' steps against optax.adamw with the
# bytes their programs move, checks each Pallas op against XLA and times both
# at tens of millions of elements, checks each optimizer's Pallas path
# against its XLA path step for step, compares the whole training step's
# compiled peak with the measured one, and lowers every kernel. Each stage
# has its own time limit so that one slow stage cannot starve the rest; the
# most wanted come first. Results go to ${OUT:-results}/ (about 8.5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Tables of millions of parameters fit easily; let XLA allocate as it needs
# (and the allocator's peak be the step's).
export XLA_PYTHON_CLIENT_PREALLOCATE=false

python -c 'import jax, optax, flax; print("JAX", jax.__version__, "optax", optax.__version__, "flax", flax.__version__, jax.devices())'
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

status=0
stage() {  # stage SECONDS NAME COMMAND...: run COMMAND, log to $out/NAME.txt
  local limit=$1 name=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" || { echo "== $name FAILED (rc $?)"; status=1; }
  # One archive of everything so far, rewritten after each stage (ARCHIVE=path.tar.gz).
  if [[ -n "${ARCHIVE:-}" ]]; then tar czf "$ARCHIVE" -C "$out" .; fi
}
# The sizes, smaller for a rehearsal on a CPU (MODEL=10M SMALL_MODEL=10M SIZE=1048576).
model="${MODEL:-300M}" small_model="${SMALL_MODEL:-40M}" size="${SIZE:-$((32 * 1024 * 1024))}"
# 1-2. Every registered optimizer's step against optax.adamw at 300M, default
# paths, and the XLA paths of the steps whose GPU default is a kernel; with
# each program's bytes and the time they take at the H200's 4.8 TB/s.
# float32 parameters, then bfloat16 (each optimizer with stochastic rounding).
# Ten steps per timed call: a step of 300M parameters in 219 tensors passes
# about 880 arrays, whose dispatch by the host can outlast the GPU's work.
# Compiles run 8 at once: a 300M step compiles for up to minutes (each row's
# compile_seconds in benchmarks/data/h200/).
all="adamw microadam taco adam_mini ternary_adam adamw_8bit adamw_4bit adamw_fp8 adafactor galore"
timing="--repeats 20 --steps-per-call 10 --compile-threads 8 --bandwidth 4.8"
stage 150 step_time python -m benchmarks.step_time --models $model --optimizers $all \
  --implementations auto xla $timing --compile-budget 110 --json "$out/step_time.json"
stage 130 step_time_bf16 python -m benchmarks.step_time --models $model --param-dtypes bfloat16 \
  --optimizers $all $timing --compile-budget 90 --json "$out/step_time_bf16.json"
# 3. Each kernel against its XLA path, timed, at 32M elements.
stage 45 kernels python -m benchmarks.kernels --size $size --repeats 20 --out "$out"
stage 60 implementations python -m benchmarks.implementations --model $small_model --steps 3 --out "$out"
# 4. The whole training step's compiled peak (the device's and the planner's
# H200 description's) against the allocator's measured peak.
stage 90 train_step_peak python -m benchmarks.train_step_peak --model $model --batch 8 \
  --optimizers adamw adamw_8bit --target h200 --json "$out/train_step_peak.json"
stage 25 check_lowering python -m pallas_kernels.check_lowering
exit $status
