"""One step, lowered on this CPU machine for CUDA and for the CPU, gets each platform's program.

Decisions that depend on the platform (the kernels' default, the XLA:CPU
scheduling aids) are taken for the platform a program is lowered for, never
from the process's default backend (``pallas_kernels.dispatch``,
``pallas_kernels.xla_cpu``).
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_memopt
from memopt_tools.training.optimizers import OPTIMIZERS
from optax_memopt import leaves
from pallas_kernels import _backend, dispatch, xla_cpu

# The ops with kernels the default step of each registered optimizer calls, and their kernels' custom calls;
# TACO's steps, which call none (its selection is XLA only), for their CPU aids.
OPS = {
  "microadam": {"feedback_step": _backend.TRITON_CALL},
  "taco": {},
  "taco_one_segment": {},
}
# TACO selects by an argmax per part, and with one segment per row by a plain top-k: nothing to aid.
WITHOUT_CPU_AIDS = {"taco", "taco_one_segment"}

# Large enough for every kernel's whole blocks and every quantized state.
PARAMS = {"kernel": jnp.zeros((64, 4096)), "embedding": jnp.zeros((512, 256)), "bias": jnp.zeros((512,))}


def _lowered_step(name: str, platform: str) -> str:
  tx = OPTIMIZERS[name].build(1e-3, None)
  state = jax.eval_shape(tx.init, PARAMS)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with _backend.cuda_lowering_context():
    lowered = jax.jit(step).trace(PARAMS, state, PARAMS).lower(lowering_platforms=(platform,))
  return lowered.as_text(debug_info=True)


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_cuda_program_holds_the_tables_kernels_and_no_cpu_aid(monkeypatch, name):
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: True)
  text = _lowered_step(name, "cuda")
  assert xla_cpu.SCOPE not in text
  if not OPS[name]:
    assert _backend.TRITON_CALL not in text
  for call in set(OPS[name].values()):
    assert (call in text) == any(dispatch.FASTER_ON_HOPPER[op] for op, c in OPS[name].items() if c == call), call


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_cpu_program_holds_the_cpu_aids_and_no_kernel(monkeypatch, name):
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: True)
  text = _lowered_step(name, "cpu")
  assert _backend.TRITON_CALL not in text
  assert (xla_cpu.SCOPE in text) == (name not in WITHOUT_CPU_AIDS)


def test_every_optimizer_with_kernels_is_covered():
  assert {name for name, spec in OPTIMIZERS.items() if spec.has_kernels} == {name for name, ops in OPS.items() if ops}


@pytest.mark.parametrize("name", ["adam_mini", "adamw_4bit", "microadam", "taco", "ternary_adam"])
def test_every_optimizer_maps_its_per_leaf_step_with_map_steps(monkeypatch, name):
  """One idiom, ``leaves.map_steps`` then ``leaves.unzip``: every optimizer's leaves get its scheduling on XLA:CPU."""
  mapped = []
  map_steps = leaves.map_steps

  def counted(step, tree, *rest):
    mapped.append(len(jax.tree.leaves(tree)))
    return map_steps(step, tree, *rest)

  monkeypatch.setattr(leaves, "map_steps", counted)
  tx = getattr(optax_memopt, name)(1e-3)
  jax.eval_shape(tx.update, PARAMS, jax.eval_shape(tx.init, PARAMS), PARAMS)
  # TACO steps the kernel, its fallback (Adam) the embedding and the bias.
  assert mapped == [1 if name == "taco" else len(PARAMS)]
