"""Bad input and faults, for every optimizer of the registry.

* A non-finite gradient without ``optax.apply_if_finite`` (the wrapper
  itself is covered in ``tests/test_transformation_properties.py``): the
  fault must stay in its tensor and stay visible. Each later step either
  shows it (a non-finite entry in the update, as Adam's NaN moments do) or
  has forgotten it (finite state); never a non-finite state behind finite
  updates beyond the step after the fault, nor finite updates far outside
  the clean run's scale (what a NaN read through a code or a masked square
  root produces). After one NaN entry, as many update entries stay
  non-finite, step by step, as ``docs/checkpoints.md`` says.
* Invalid hyper-parameters: a ``ValueError`` naming the parameter and its
  allowed range when the transformation is built.
* Integer, complex, scalar and zero-size parameters, ``None`` leaves and
  ``optax.MaskedNode``: handled as ``optax.adamw`` handles them, or refused
  at ``init`` with a ``ValueError`` that names the optimizer, the
  parameter's path and dtype, and what the optimizer supports.
* Random shapes (tails, vectors, 3-D, single elements) and dtypes: finite
  updates with the parameters' shapes and dtypes, a state that keeps its own.
"""

from __future__ import annotations

import functools
import inspect
import math
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import optax_memopt
from tests.optimizer_cases import CASES
from tests.test_transformation_properties import (
  build,
  make_params,
  make_target,
  quadratic_loss,
  shapes_and_dtypes,
)

NAMES = sorted(CASES)
# Validation is the library's promise; optax's own aliases do not check.
OURS = [name for name in NAMES if CASES[name].factory.__module__.startswith("optax_memopt")]

# ---------------------------------------------------------------------------
# Non-finite gradients without a guard.

FAULT_STEP = 2
STEPS = 10
# A finite update entry beyond this multiple of the clean run's largest is
# garbage, not optimisation (the clean runs stay within a factor of a few).
SCALE_FACTOR = 10.0


def documented_non_finite_updates(name: str, kernel_shape: tuple[int, int], k: int) -> int:
  """Update entries non-finite ``k`` steps after one NaN in the kernel's gradient (``docs/checkpoints.md``)."""
  if name == "microadam":  # The element, until its ring row is overwritten.
    return int(k < CASES[name].kwargs["window"])
  if name.startswith("adamw_"):  # The element at the fault; its moments are stored as zero.
    return int(k == 0)
  if name == "adam_mini":  # The element's block: an output neuron, one entry per input.
    return kernel_shape[0]
  if name == "ternary_adam":  # The tensor (its factored second moment).
    return math.prod(kernel_shape)
  return 1  # optax.adamw: the element; TACO: its row's one step.


def belongs_to_faulty_leaf(path) -> bool:
  return "['dense']['kernel']" in jax.tree_util.keystr(path)


def non_finite_state_leaves(state) -> list[str]:
  return [
    jax.tree_util.keystr(path)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    if jnp.issubdtype(leaf.dtype, jnp.inexact) and not np.all(np.isfinite(np.asarray(leaf).astype(np.float32)))
  ]


def bitwise(tree):
  return jax.tree.map(lambda x: np.asarray(x).tobytes(), tree)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad_value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_gradient_stays_visible_and_contained(name, bad_value, seed):
  rng = np.random.default_rng(seed)
  optimizer = build(name)
  params = make_params()
  gradient = jax.jit(jax.grad(quadratic_loss))
  gradients = [gradient(params, make_target(params, seed + t)) for t in range(STEPS)]
  kernel_shape = params["dense"]["kernel"].shape
  where = tuple(int(rng.integers(n)) for n in kernel_shape)
  faulty = jax.tree.map(lambda g: g, gradients[FAULT_STEP])
  faulty["dense"]["kernel"] = faulty["dense"]["kernel"].at[where].set(bad_value)
  update = jax.jit(optimizer.update)

  clean_state = faulty_state = optimizer.init(params)
  clean_updates, faulty_updates, faulty_states = [], [], []
  for t, grads in enumerate(gradients):
    # The parameters stay put: differences come from the state alone.
    u, clean_state = update(grads, clean_state, params)
    clean_updates.append(u)
    u, faulty_state = update(faulty if t == FAULT_STEP else grads, faulty_state, params)
    faulty_updates.append(u)
    faulty_states.append(faulty_state)

  context = f"{bad_value} at {where} of dense/kernel on step {FAULT_STEP}; seed {seed}"
  kernel_updates = [np.asarray(u["dense"]["kernel"]) for u in faulty_updates]
  clean_scale = max(float(np.max(np.abs(u["dense"]["kernel"]))) for u in clean_updates)
  for t in range(FAULT_STEP, STEPS):
    others_clean = {k: v for k, v in clean_updates[t].items() if k != "dense"}
    others_faulty = {k: v for k, v in faulty_updates[t].items() if k != "dense"}
    assert bitwise(others_faulty) == bitwise(others_clean), f"step {t}: {context}"
    assert bitwise(faulty_updates[t]["dense"]["bias"]) == bitwise(clean_updates[t]["dense"]["bias"]), (
      f"step {t}: dense/bias touched ({context})"
    )

    finite = np.isfinite(kernel_updates[t])
    largest = float(np.max(np.abs(kernel_updates[t][finite]), initial=0.0))
    assert largest <= SCALE_FACTOR * clean_scale, (
      f"step {t}: finite updates up to {largest:.3g} against at most {clean_scale:.3g} in the"
      f" clean run: the fault turned into silent garbage ({context})"
    )
    # A non-finite state must surface in the update of this step or the next.
    hidden = non_finite_state_leaves(faulty_states[t])
    surfaces = [not np.all(np.isfinite(u)) for u in kernel_updates[t : t + 2]]
    assert not hidden or any(surfaces), f"step {t}: non-finite state {hidden} behind finite updates ({context})"
    if np.isnan(bad_value):
      non_finite = sum(int(np.sum(~np.isfinite(np.asarray(u, np.float32)))) for u in jax.tree.leaves(faulty_updates[t]))
      documented = documented_non_finite_updates(name, kernel_shape, t - FAULT_STEP)
      assert non_finite == documented, f"step {t}: {non_finite} non-finite updates, documented {documented} ({context})"

  clean_leaves = jax.tree_util.tree_flatten_with_path(clean_state)[0]
  for (path, faulty_leaf), (_, clean_leaf) in zip(
    jax.tree_util.tree_flatten_with_path(faulty_state)[0], clean_leaves, strict=True
  ):
    if not belongs_to_faulty_leaf(path):
      assert np.asarray(faulty_leaf).tobytes() == np.asarray(clean_leaf).tobytes(), (
        f"{jax.tree_util.keystr(path)} touched by a fault in another tensor ({context})"
      )


# ---------------------------------------------------------------------------
# Invalid hyper-parameters.

INVALID_VALUES = {
  "learning_rate": [-1e-3],
  "b1": [-0.1, 1.0],
  "b2": [-0.1, 1.0],
  "beta": [-0.1, 1.0],
  "eps": [-1e-8],
  "density": [0.0, 1.5],
  "window": [0],
  "block_size": [0],
  "bucket_size": [0],
  "k": [-1],
  "min_quantized_size": [-1],
  "n_heads": [0],
  "n_kv_heads": [0],
  "rules": ["no_such_rules"],
  "packing": ["no_such_packing"],
  "implementation": ["no_such_implementation"],
}
# Words and signs by which a message states the allowed values.
RANGE_PATTERN = re.compile(r"[\[\(]|>=|<=|>|<|one of|known|positive|multiple|at least|at most")


def _int16_index_limit(name: str) -> list[tuple[str, object]]:
  """A block too large for the int16 block-local indices that a state keeps."""
  case = CASES[name]
  if "block_size" not in inspect.signature(case.factory).parameters:
    return []
  state = jax.eval_shape(build(name).init, make_params())
  if any(leaf.dtype == jnp.int16 for leaf in jax.tree.leaves(state)):
    return [("block_size", 2**15 + 1)]
  return []


def invalid_cases():
  for name in OURS:
    parameters = inspect.signature(CASES[name].factory).parameters
    for argument, values in INVALID_VALUES.items():
      if argument in parameters:
        for value in values:
          yield pytest.param(name, argument, value, id=f"{name}-{argument}={value}")
    for argument, value in _int16_index_limit(name):
      yield pytest.param(name, argument, value, id=f"{name}-{argument}={value}")


@pytest.mark.parametrize("name, argument, value", list(invalid_cases()))
def test_invalid_hyperparameter_is_refused_when_built(name, argument, value):
  try:
    optimizer = build(name, **{argument: value})
  except ValueError as error:
    message = str(error)
    assert argument in message, f"the error does not name {argument!r}: {message}"
    assert RANGE_PATTERN.search(message.replace(repr(value), "")), (
      f"the error does not state the allowed values of {argument!r}: {message}"
    )
    return
  params = make_params()
  try:  # Tracing only: where, if anywhere, the value is refused later.
    state = jax.eval_shape(optimizer.init, params)
    jax.eval_shape(optimizer.update, params, state, params)
  except Exception as error:
    pytest.fail(f"{argument}={value!r} accepted when built; {type(error).__name__} later: {error}")
  pytest.fail(f"{argument}={value!r} accepted (no error when built, nor in init or update)")


# Every hyper-parameter of every transformation the package exports, given a
# value of the wrong type: a ValueError naming it when built. None is refused
# where it is not the default; a string where the parameter does not take
# strings. A renamed keyword's message names its new name.
WRONG_TYPES = {"string": "abc", "none": None, "vector": np.ones(3, np.float32), "complex": 1j}
RENAMED = {"min_size": "min_quantized_size"}


def _transformations():
  for export in optax_memopt.__all__:
    factory = getattr(optax_memopt, export)
    if inspect.isfunction(factory) and inspect.signature(factory).return_annotation == "optax.GradientTransformation":
      required = [p.name for p in inspect.signature(factory).parameters.values() if p.default is p.empty]
      if set(required) <= {"learning_rate"}:
        yield factory


def _wrong_type_cases():
  for factory in _transformations():
    for parameter in inspect.signature(factory).parameters.values():
      default = parameter.default
      takes_strings = isinstance(default, str) or "str" in str(parameter.annotation)
      values = {
        kind: value
        for kind, value in WRONG_TYPES.items()
        if not (kind == "none" and default is None) and not (kind == "string" and takes_strings)
      }
      if values:
        yield pytest.param(factory, parameter.name, values, id=f"{factory.__name__}-{parameter.name}")


@pytest.mark.parametrize("factory, argument, values", list(_wrong_type_cases()))
def test_wrong_type_hyperparameter_is_refused_when_built(factory, argument, values):
  others = {"learning_rate": 1e-3} if "learning_rate" in inspect.signature(factory).parameters else {}
  for kind, value in values.items():
    with pytest.raises(ValueError) as error:
      factory(**{**others, argument: value})
    assert RENAMED.get(argument, argument) in str(error.value), f"{kind}: the error does not name {argument!r}"


# ---------------------------------------------------------------------------
# Unusual parameters.

ODD_LEAVES = {
  "int32": lambda: jnp.arange(12, dtype=jnp.int32).reshape(3, 4),
  # Real-valued, so that weight decay adds no imaginary part of its own.
  "complex64": lambda: jnp.full((8, 4), 0.5, jnp.complex64),
  "scalar": lambda: jnp.asarray(0.5, jnp.float32),
  "zero_size_matrix": lambda: jnp.zeros((0, 4), jnp.float32),
  "zero_size_vector": lambda: jnp.zeros((0,), jnp.float32),
  "none": lambda: None,
  "masked_node": optax.MaskedNode,
}


# Parameter dtypes each optimizer of ours refuses at init. Integers: a step
# smaller than one rounds away in optax.apply_updates, so an integer
# parameter would never move, without a word. Complex: codes, trits and
# selected magnitudes have no phase; Adam-mini keeps complex parameters, its
# second moment being the block mean of |g|^2 as optax's Adam takes |g|^2.
REFUSED_AT_INIT = {
  "adam_mini": {"int32"},
  "microadam": {"int32", "complex64"},
  "taco": {"int32", "complex64"},
  "ternary_adam": {"int32", "complex64"},
  "adamw_8bit": {"int32", "complex64"},
  "adamw_4bit": {"int32", "complex64"},
  "adamw_fp8": {"int32", "complex64"},
}
# Leaves every optimizer handles as optax.adamw does.
ALWAYS_HANDLED = {"scalar", "zero_size_matrix", "zero_size_vector", "none", "masked_node"}
ODD_PATH = "block/odd"


def _params_with(kind: str) -> dict:
  return {
    "dense": {"kernel": jnp.full((8, 4), 0.5, jnp.float32)},
    "block": {"odd": ODD_LEAVES[kind]()},
  }


def _step(optimizer, params):
  # A complex gradient with an imaginary part, so that dropping it shows.
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1 + 1j) if jnp.iscomplexobj(p) else jnp.ones_like(p), params)
  state = optimizer.init(params)
  updates, new_state = jax.jit(optimizer.update)(grads, state, params)
  return updates, state, new_state


@functools.cache
def _optax_step(kind: str):
  return _step(optax.adamw(1e-2), _params_with(kind))


def _assert_refusal_is_clear(message: str, name: str, kind: str) -> None:
  """The message names the optimizer, the parameter's path and dtype, and what is supported."""
  for what, word in [
    ("the optimizer", name),
    ("the parameter's path", repr(ODD_PATH)),
    ("the dtype", kind),
    ("what is supported", "supports"),
  ]:
    assert word in message, f"the refusal does not name {what} ({word!r}): {message}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", sorted(ODD_LEAVES))
def test_unusual_parameter_handled_as_optax_or_refused_clearly(name, kind):
  params = _params_with(kind)
  optimizer = build(name)
  refused = REFUSED_AT_INIT.get(name)
  if refused is not None and kind in refused:
    with pytest.raises(ValueError) as error:
      optimizer.init(params)  # At init, before any step.
    _assert_refusal_is_clear(str(error.value), name, kind)
    return
  expected_updates, optax_state, optax_new_state = _optax_step(kind)
  try:
    updates, state, new_state = _step(optimizer, params)
  except (ValueError, TypeError) as error:
    if refused is not None or kind in ALWAYS_HANDLED:
      raise AssertionError(f"{name} must handle a {kind} parameter as optax.adamw does") from error
    # An optimizer without an entry in REFUSED_AT_INIT may refuse a dtype, clearly.
    _assert_refusal_is_clear(str(error), name, kind)
    return
  assert jax.tree.structure(updates) == jax.tree.structure(expected_updates)
  assert shapes_and_dtypes(updates) == shapes_and_dtypes(expected_updates)
  # optax.adamw's moments of an integer parameter turn float after a step.
  if shapes_and_dtypes(optax_new_state) == shapes_and_dtypes(optax_state):
    assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
  for leaf, expected in zip(jax.tree.leaves(updates), jax.tree.leaves(expected_updates), strict=True):
    assert bool(jnp.all(jnp.isfinite(leaf))), f"non-finite update for a {kind} parameter"
    if jnp.iscomplexobj(expected) and bool(jnp.any(expected.imag != 0)):
      assert bool(jnp.any(leaf.imag != 0)), "the imaginary part of the gradient was dropped"


# ---------------------------------------------------------------------------
# Random shapes and dtypes.


@st.composite
def parameter_trees(draw):
  """One to three leaves of rank 0 to 3, up to 3000 elements, fp32 or bf16."""
  dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
  shapes = draw(
    st.lists(
      st.lists(st.integers(1, 70), max_size=3).filter(lambda s: math.prod(s) <= 3000),
      min_size=1,
      max_size=3,
    )
  )
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  # Flax-like names, so that rule-based methods see kernels, biases and scales.
  names = {0: "scale", 1: "bias"}
  return {
    f"layer{i}": {names.get(len(shape), "kernel"): jnp.asarray(rng.normal(0, 0.5, shape), dtype)}
    for i, shape in enumerate(shapes)
  }


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=8)
@given(params=parameter_trees())
def test_steps_on_random_shapes_and_dtypes(name, params):
  optimizer = build(name)
  state = optimizer.init(params)
  update = jax.jit(optimizer.update)
  for scale in (1.0, 1e-3):
    grads = jax.tree.map(lambda p: (p * scale + 1e-2).astype(p.dtype), params)
    updates, new_state = update(grads, state, params)
    assert shapes_and_dtypes(updates) == shapes_and_dtypes(params)
    assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
    for leaf in jax.tree.leaves(updates):
      assert bool(jnp.all(jnp.isfinite(leaf)))
    state = new_state
