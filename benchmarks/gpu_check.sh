#!/usr/bin/env bash
# GPU readiness in one call, on a machine with an NVIDIA Hopper GPU and JAX,
# optax, flax and chex preinstalled (no network needed): installs this project
# without dependencies, lowers every kernel, checks each Pallas kernel against
# XLA on the GPU and times both at tens of millions of elements, then times the
# optimizers' steps against optax.adamw. Results go to ${OUT:-results}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>/dev/null \
  || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c 'import jax; print("JAX", jax.__version__, jax.devices())'

status=0
python -m pallas_kernels.check_lowering 2>&1 | tee "$out/check_lowering.txt" || status=1
python -m benchmarks.kernels --size $((32 * 1024 * 1024)) --out "$out" 2>&1 | tee "$out/kernels.txt" || status=1
python -m benchmarks.step_time --models 10M 40M --out "$out" 2>&1 | tee "$out/step_time.txt" || status=1
exit $status
