#!/usr/bin/env bash
# GPU readiness in one call, on a machine with an NVIDIA Hopper GPU and JAX,
# optax, flax and chex preinstalled (no network needed): uses this checkout
# without installing it; times the optimizers' steps (default paths) against
# optax.adamw, and the low-bit AdamW steps on both paths at 300M; checks
# each Pallas op against XLA and times both at tens of
# millions of elements, checks each optimizer's Pallas path against its XLA
# path step for step, and lowers every kernel. Each stage has its own time
# limit so that one slow stage cannot starve the rest; the most wanted come
# first. Results go to ${OUT:-results}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Tables of millions of parameters fit easily; let XLA allocate as it needs.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

python -c 'import jax, optax, flax; print("JAX", jax.__version__, "optax", optax.__version__, "flax", flax.__version__, jax.devices())'
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

status=0
stage() {  # stage SECONDS NAME COMMAND...: run COMMAND, log to $out/NAME.txt
  local limit=$1 name=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" || { echo "== $name FAILED (rc $?)"; status=1; }
}
stage 130 step_time python -m benchmarks.step_time --models 40M 300M \
  --optimizers adamw adam_mini microadam ternary_adam taco --repeats 20 --json "$out/step_time.json"
# The low-bit AdamW family against AdamW (the GPU target: 0.8x optax.adamw
# or less at 300M).
stage 120 lowbit_step_time python -m benchmarks.step_time --models 300M \
  --optimizers adamw adamw_8bit adamw_4bit adamw_fp8 --repeats 20 --json "$out/lowbit/step_time.json"
stage 60 kernels python -m benchmarks.kernels --size $((32 * 1024 * 1024)) --repeats 20 --out "$out"
stage 70 implementations python -m benchmarks.implementations --model 40M --steps 3 --out "$out"
stage 40 check_lowering python -m pallas_kernels.check_lowering
exit $status
