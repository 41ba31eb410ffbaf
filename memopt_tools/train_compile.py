"""A whole training step compiled for a GPU on any machine: will forward, backward and optimizer fit?

:func:`compile_train_step` compiles one donated step of a user's training,

.. code-block:: python

  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)

for a GPU of :data:`memopt_tools.gpu_compile.TARGETS` from shapes alone
(``jax.eval_shape`` results: nothing is allocated, no GPU is needed), and
reads XLA's peak of the optimized program (``Compiled.memory_analysis``:
arguments + outputs - aliased + temporaries). The peak is cut into parts
whose sizes are known or measured on their own:

* parameters, optimizer state and the batch: the step's arguments;
* gradients: one set in the parameters' dtypes;
* activations and the rest: the temporaries of the forward and backward
  pass alone, ``jax.value_and_grad(loss_fn)`` compiled for the same target
  with the gradients as its outputs (what the backward pass keeps from the
  forward pass, and every other temporary of the two passes);
* the update: what is left, signed. Positive where the optimizer's update
  holds temporaries of its own beside a whole set of gradients; negative
  where XLA frees memory by updating some parameters before the backward
  pass has made every gradient (an optimizer that updates each tensor from
  its own gradient lets it), so that the peak never holds activations and a
  whole set of gradients at once.

The step fits when the peak is at most the device's memory less a margin,
:data:`MARGIN` of it by default, for what the compile cannot see: the CUDA
context, cuBLAS and cuDNN workspaces, NCCL buffers and the allocator's
fragmentation (``docs/memory-planning.md``, "What the compile cannot see").

:func:`largest_batch` finds the largest batch that fits from compiles: two
batch sizes, the line through their peaks, a compile at the batch the line
predicts to confirm it (and again from there while the line is off).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, Sequence

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

import optax_memopt  # noqa: E402
from memopt_tools import gpu_compile  # First: it sets the CUDA plugin's environment.
from optax_memopt.state_bytes import state_nbytes  # noqa: E402

# The share of a device's memory the report keeps free for what the compile
# cannot see. JAX takes 75% of a GPU's memory by default; running with
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 gives it the 90% this margin assumes.
MARGIN = 0.10


@dataclasses.dataclass(frozen=True)
class TrainStepProgram(gpu_compile.ProgramMemory):
  """XLA's peak of one compiled training step on one device, and its parts, in bytes."""

  target: str
  n_params: int
  param_bytes: int
  gradient_bytes: int
  state_bytes: int
  batch_bytes: int
  # The temporaries of the forward and backward pass compiled alone.
  activations_bytes: int
  memory: int  # The device's memory.
  margin: float  # The share of ``memory`` kept free.

  @property
  def update_bytes(self) -> int:
    """The peak beyond parameters, gradients, state, batch and activations; negative where XLA overlaps
    the update with the backward pass."""
    return (
      self.peak_bytes
      - self.param_bytes
      - self.gradient_bytes
      - self.state_bytes
      - self.batch_bytes
      - self.activations_bytes
    )

  @property
  def budget_bytes(self) -> int:
    """The memory the step may take: the device's, less the margin."""
    return int(self.memory * (1 - self.margin))

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.budget_bytes


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), tree)


def training_step(loss_fn: Callable[[Any, Any], jax.Array], tx: optax.GradientTransformation) -> Callable:
  """``step(params, state, batch) -> (params, state, loss)``: gradients of ``loss_fn``, ``tx``'s update, applied."""

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def _single_device(target: str) -> Callable[[Any], Any]:
  (device,) = gpu_compile.target_devices(target)
  single = SingleDeviceSharding(device)
  return lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=single), tree)


def activations_bytes(
  loss_fn: Callable[[Any, Any], jax.Array], params: Any, batch: Any, *, target: str = "h100"
) -> int:
  """The temporaries of ``jax.value_and_grad(loss_fn)`` compiled alone for one GPU of ``target``.

  What the forward and backward pass hold beside their arguments (parameters
  and batch) and outputs (the loss and one set of gradients): the
  activations the backward pass reads, and every other temporary of the two
  passes at their peak. It does not depend on the optimizer.

  Args:
    loss_fn, params, batch, target: as for :func:`compile_train_step`.
  """
  place = _single_device(target)
  gradients = jax.jit(jax.value_and_grad(loss_fn))
  return (
    gradients.lower(place(_abstract(params)), place(_abstract(batch))).compile().memory_analysis().temp_size_in_bytes
  )


def _compiled_step(loss_fn, params, state, batch, tx: optax.GradientTransformation, target: str) -> Any:
  """:func:`training_step` compiled for one GPU of ``target``, parameters and state donated."""
  place = _single_device(target)
  step = jax.jit(training_step(loss_fn, tx), donate_argnums=(0, 1))
  return step.lower(place(params), place(state), place(batch)).compile()


def train_step_peak_bytes(
  loss_fn: Callable[[Any, Any], jax.Array], params: Any, batch: Any, tx: optax.GradientTransformation, *, target: str
) -> int:
  """XLA's peak of :func:`compile_train_step`'s program alone, without compiling its activations' program.

  Args:
    loss_fn, params, batch, tx, target: as for :func:`compile_train_step`.
  """
  params, batch = _abstract(params), _abstract(batch)
  compiled = _compiled_step(loss_fn, params, jax.eval_shape(tx.init, params), batch, tx, target)
  return gpu_compile.ProgramMemory(**gpu_compile.ProgramMemory.fields_of(compiled)).peak_bytes


def compile_train_step(
  loss_fn: Callable[[Any, Any], jax.Array],
  params: Any,
  batch: Any,
  tx: optax.GradientTransformation,
  *,
  target: str = "h100",
  memory: int | None = None,
  margin: float = MARGIN,
  activations: int | None = None,
) -> TrainStepProgram:
  """Compiles ``tx``'s whole training step on ``loss_fn`` for one GPU of ``target``.

  Args:
    loss_fn: ``loss_fn(params, batch)``, a scalar.
    params: the parameters as arrays or ``jax.ShapeDtypeStruct`` (a
      ``jax.eval_shape`` of the model's initialisation); gradients take
      their shapes and dtypes.
    batch: one batch as arrays or ``jax.ShapeDtypeStruct`` (any pytree).
    tx: the optimizer; its state is ``jax.eval_shape(tx.init, params)``.
    target: the GPU, one of :data:`memopt_tools.gpu_compile.TARGETS`.
    memory: the device's bytes (default: the target's).
    margin: the share of ``memory`` kept free (default :data:`MARGIN`).
    activations: :func:`activations_bytes` of the same ``loss_fn``,
      ``params``, ``batch`` and ``target``, where already compiled (default:
      compiled here).

  Returns:
    A :class:`TrainStepProgram`.

  Raises:
    ValueError: for an unknown ``target`` or a ``margin`` outside [0, 1).
    GpuCompilerMissing: where JAX's CUDA plugin is missing.
  """
  if not 0 <= margin < 1:
    raise ValueError(f"margin must be in [0, 1); got {margin!r}.")
  params, batch = _abstract(params), _abstract(batch)
  state = jax.eval_shape(tx.init, params)
  compiled = _compiled_step(loss_fn, params, state, batch, tx, target)
  param_bytes = state_nbytes(params)
  return TrainStepProgram(
    target=target,
    n_params=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
    param_bytes=param_bytes,
    gradient_bytes=param_bytes,
    state_bytes=state_nbytes(state),
    batch_bytes=state_nbytes(batch),
    activations_bytes=activations_bytes(loss_fn, params, batch, target=target) if activations is None else activations,
    memory=gpu_compile.device_memory_bytes(target) if memory is None else memory,
    margin=margin,
    **gpu_compile.ProgramMemory.fields_of(compiled),
  )


@dataclasses.dataclass(frozen=True)
class TrainStepReport:
  """Every optimizer's training step on one GPU; ``str()`` is a markdown table.

  ``programs`` maps an optimizer's name to its :class:`TrainStepProgram`, or
  to the reason it could not be built.
  """

  programs: dict[str, TrainStepProgram | str]
  target: str
  title: str

  def fits(self, optimizer: str) -> bool:
    program = self.programs[optimizer]
    return not isinstance(program, str) and program.fits

  def __str__(self) -> str:
    gb = gpu_compile.decimal_bytes
    signed = lambda nbytes: ("+" if nbytes >= 0 else "") + gb(nbytes)
    built = [p for p in self.programs.values() if not isinstance(p, str)]
    head = f"{self.title}: the training step compiled by XLA for one {self.target.upper()}"
    if built:
      p = built[0]
      head += (
        f" ({gb(p.memory)}; fits: peak <= {gb(p.budget_bytes)}, {p.margin:.0%} kept for what the compile cannot see)"
      )
    lines = [
      head,
      "",
      "| optimizer | parameters | gradients | optimizer state | batch | activations and the rest | the update"
      " | XLA's peak | fits |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in self.programs.items():
      if isinstance(p, str):
        lines.append(f"| {name} | not compiled: {p} | | | | | | | |")
        continue
      cells = [gb(b) for b in (p.param_bytes, p.gradient_bytes, p.state_bytes, p.batch_bytes, p.activations_bytes)]
      cells += [signed(p.update_bytes), gb(p.peak_bytes), "yes" if p.fits else "no"]
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def registered_optimizer(
  name: str, *, n_heads: int | None = None, n_kv_heads: int | None = None, stochastic_rounding: bool = False
) -> optax.GradientTransformation:
  """``memopt_tools.training.optimizers.OPTIMIZERS[name]``, for bfloat16 parameters with stochastic rounding.

  Args:
    name: an entry of the registry.
    n_heads, n_kv_heads: the heads Adam-mini cuts fused query and key kernels into.
    stochastic_rounding: chain :func:`optax_memopt.stochastic_rounding` after
      it, as a step on bfloat16 or float16 parameters should.
  """
  from memopt_tools.training import optimizers

  tx = optimizers.get(name).build(1e-3, types.SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv_heads))
  return optax_memopt.with_stochastic_rounding(tx) if stochastic_rounding else tx


def train_step_report(
  loss_fn: Callable[[Any, Any], jax.Array],
  params: Any,
  batch: Any,
  *,
  target: str = "h100",
  optimizer_names: Sequence[str] | None = None,
  n_heads: int | None = None,
  n_kv_heads: int | None = None,
  stochastic_rounding: bool = False,
  memory: int | None = None,
  margin: float = MARGIN,
  title: str = "model",
) -> TrainStepReport:
  """:func:`compile_train_step` for every registered optimizer (or ``optimizer_names``).

  Args:
    loss_fn, params, batch, target, memory, margin: as for :func:`compile_train_step`.
    optimizer_names: entries of ``memopt_tools.training.optimizers.OPTIMIZERS``
      (default: all of them).
    n_heads, n_kv_heads, stochastic_rounding: as for :func:`registered_optimizer`.
    title: the first line of the printed table.

  Returns:
    A :class:`TrainStepReport`.
  """
  from memopt_tools.training import optimizers

  names = optimizers.checked_names(optimizer_names)
  gpu_compile.target_devices(target)
  programs: dict[str, TrainStepProgram | str] = {}
  activations = None
  for name in names:
    try:
      tx = registered_optimizer(name, n_heads=n_heads, n_kv_heads=n_kv_heads, stochastic_rounding=stochastic_rounding)
      jax.eval_shape(tx.init, _abstract(params))
    except ValueError as error:
      programs[name] = str(error)
      continue
    if activations is None:
      activations = activations_bytes(loss_fn, params, batch, target=target)
    programs[name] = compile_train_step(
      loss_fn, params, batch, tx, target=target, memory=memory, margin=margin, activations=activations
    )
  return TrainStepReport(programs, target, title)


@dataclasses.dataclass(frozen=True)
class LargestBatch:
  """The largest batch whose step fits, and every compile that found it (batch size -> peak bytes)."""

  batch: int  # 0 when not even the smallest compiled batch fits.
  budget_bytes: int
  peaks: dict[int, int]

  @property
  def confirmed(self) -> bool:
    """Whether the batch one larger was compiled too (and did not fit)."""
    return self.batch + 1 in self.peaks


def largest_batch(
  peak_at: Callable[[int], int],
  budget_bytes: int,
  *,
  first: int = 1,
  second: int = 2,
  max_compiles: int = 6,
) -> LargestBatch:
  """The largest batch size whose peak is at most ``budget_bytes``, from compiles.

  The peak of a training step grows with the batch by about the same bytes
  per example (its activations). The line through the peaks at ``first`` and
  ``second`` predicts the largest batch that fits; a compile there confirms
  it, and then one at the next batch size up; where a prediction misses, the
  line through the two compiled batches nearest the budget predicts again.

  Args:
    peak_at: a batch size's peak bytes (one compile).
    budget_bytes: the bytes the step may take.
    first, second: the two batch sizes compiled first (``first < second``).
    max_compiles: at most this many compiles in all.

  Returns:
    A :class:`LargestBatch`.
  """
  if not 1 <= first < second:
    raise ValueError(f"need 1 <= first < second; got first={first}, second={second}.")
  peaks = {first: peak_at(first), second: peak_at(second)}
  while len(peaks) < max_compiles:
    fitting = [b for b in peaks if peaks[b] <= budget_bytes]
    over = [b for b in peaks if peaks[b] > budget_bytes]
    below, above = max(fitting, default=None), min(over, default=None)
    if below is not None and above == below + 1:
      break
    if below is None and first == min(peaks):
      # Not even the smallest batch fits.
      break
    nearest = sorted(peaks, key=lambda b: abs(peaks[b] - budget_bytes))[:2]
    (b1, p1), (b2, p2) = sorted((b, peaks[b]) for b in nearest)
    slope = (p2 - p1) / (b2 - b1)
    guess = max(1, math.floor(b1 + (budget_bytes - p1) / slope)) if slope > 0 else max(peaks) * 2
    if below is not None and above is not None:
      guess = min(max(guess, below + 1), above - 1)
    if guess in peaks:
      guess = guess + 1 if peaks[guess] <= budget_bytes else guess - 1
    if guess < 1 or guess in peaks:
      break
    peaks[guess] = peak_at(guess)
  fitting = [b for b in peaks if peaks[b] <= budget_bytes]
  return LargestBatch(max(fitting, default=0), budget_bytes, dict(sorted(peaks.items())))
