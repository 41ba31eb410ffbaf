"""Will my model fit? Bytes of parameters, gradients and optimizer state, per device.

For every optimizer of :data:`memopt_tools.training.optimizers.OPTIMIZERS`
the state is built with ``jax.eval_shape(tx.init, params)``: shapes only,
nothing is allocated, so Llama-2-13B is measured on a laptop in seconds. It
is added to the parameters and to one set of gradients in the parameters'
dtype. Sharded over ``N`` devices, each parameter is cut FSDP-style along a
dimension that ``N`` divides (:func:`optax_memopt.sharding.split_spec`;
replicated where none does), the gradients alike, and the state is laid out
by :func:`optax_memopt.state_shardings`; the figures are then one device's.
Activations, gradient-accumulation buffers and the framework's own memory
come on top: the "headroom" column is what is left for them.

The ``adamw`` row is the baseline the others compare with: AdamW's ``m`` and
``v`` in float32, 8 bytes per parameter, whatever the parameters' dtype
(``optax.adamw`` alone keeps them in the parameters' dtype, which for
bfloat16 parameters is ``adamw_bf16``'s 4 bytes). Each row names its state's
dtypes, with the state fields that hold them.

    python -m optax_memopt.fit --model llama2_7b --memory 80GiB --param-dtype bfloat16 --devices 8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding

from memopt_tools import gpu_targets
from memopt_tools.training import model, optimizers
from optax_memopt import leaves
from optax_memopt.sharding import split_spec, state_shardings
from optax_memopt.state_bytes import state_nbytes
from optax_memopt.stochastic_rounding import ROUNDED_DTYPES, with_stochastic_rounding

# Llama-style decoders in this library's Flax layout (``training.model``):
# untied input embedding and output head, no biases, RMSNorm scales.
MODELS: dict[str, model.TransformerConfig] = {
  # Touvron et al., "Llama 2", arXiv 2307.09288; the published Hugging Face configs.
  "llama2_7b": model.TransformerConfig(
    vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_len=4096
  ),
  "llama2_13b": model.TransformerConfig(
    vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, max_len=4096
  ),
  # Grattafiori et al., "The Llama 3 Herd of Models", arXiv 2407.21783: a 128K-token vocabulary.
  "llama3_8b": model.TransformerConfig(
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    max_len=8192,
    rope_base=500_000.0,
  ),
  # The main job's model sizes (``python -m memopt_tools --model-size``).
  **model.MODEL_SIZES,
}

# The row whose state is built from float32 copies of the parameters.
FLOAT32_BASELINE = "adamw"
# A state's dtypes are listed if they hold at least this share of its bytes.
LISTED_SHARE = 0.01

_DECIMAL_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BINARY_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class Memory:
  """A device's memory in bytes, and whether it was given in decimal (GB) or binary (GiB) units."""

  nbytes: int
  binary: bool = True

  def format(self, nbytes: int) -> str:
    """``nbytes`` in this memory's units, the largest that keeps the number at least 1."""
    base, names = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if self.binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    power = 0
    while power < len(names) - 1 and abs(nbytes) >= base ** (power + 1):
      power += 1
    return f"{nbytes / base**power:.2f} {names[power]}"


def parse_memory(text: str | int | Memory) -> Memory:
  """``"80GB"`` (decimal, 80e9 bytes), ``"80GiB"`` (binary), ``"4096B"``, or an int number of bytes.

  Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of
  1024), case-insensitive. A card sold as "80GB" (H100) holds 80 GiB. A
  string needs its unit: ``"80"`` is refused, being most likely 80 GB with
  the unit forgotten rather than 80 bytes.
  """
  if isinstance(text, Memory):
    return text
  if isinstance(text, int) and not isinstance(text, bool):
    if text < 1:
      raise ValueError(f"memory must be a positive number of bytes; got {text}.")
    return Memory(text)
  match = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
  unit = match.group(2).upper() if match else ""
  if not match or unit not in _DECIMAL_UNITS and unit not in _BINARY_UNITS:
    raise ValueError(
      f"memory must be a size with its unit, such as 80GB, 80GiB or 512MiB (units B, KB, MB, GB, TB,"
      f" KiB, MiB, GiB, TiB); got {text!r}."
    )
  nbytes = int(float(match.group(1)) * (_BINARY_UNITS.get(unit) or _DECIMAL_UNITS[unit]))
  if nbytes < 1:
    raise ValueError(f"memory must be positive; got {text!r}.")
  return Memory(nbytes, binary=unit in _BINARY_UNITS)


# The dtypes a JAX model's parameters and gradients take.
PARAM_DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_param_dtype(dtype: Any) -> np.dtype:
  """``dtype`` as a ``jnp.dtype`` of :data:`PARAM_DTYPES`, or a ``ValueError`` naming ``param_dtype``."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise ValueError(
      f"param_dtype must be a floating-point dtype, one of {', '.join(PARAM_DTYPES)}; got {dtype!r}."
    ) from None
  if dtype.name not in PARAM_DTYPES:
    raise ValueError(f"param_dtype must be a floating-point dtype, one of {', '.join(PARAM_DTYPES)}; got {dtype.name}.")
  return dtype


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
  """``parse`` for argparse's ``type=``: its ``ValueError`` becomes argparse's one-line usage error."""

  def argument(text: str) -> Any:
    try:
      return parse(text)
    except ValueError as error:
      raise argparse.ArgumentTypeError(str(error)) from None

  argument.__name__ = parse.__name__
  return argument


def _negative_values_attached(argv: Sequence[str]) -> list[str]:
  """``argv`` with ``--flag -5GiB`` as ``--flag=-5GiB``.

  argparse reads a value that starts with ``-`` and is not a plain number
  as a flag, and would report the flag's value missing instead of refusing
  the value.
  """
  joined = []
  for token in argv:
    if joined and joined[-1].startswith("--") and "=" not in joined[-1] and re.match(r"-\.?[0-9]", token):
      joined[-1] = f"{joined[-1]}={token}"
    else:
      joined.append(token)
  return joined


def model_params(name: str, param_dtype: Any = jnp.float32) -> Any:
  """The parameters of ``MODELS[name]`` as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
  if name not in MODELS:
    raise ValueError(f"model must be one of {sorted(MODELS)}; got {name!r}.")
  return _abstract(abstract_transformer_params(MODELS[name]), param_dtype)


def abstract_transformer_params(config: model.TransformerConfig) -> Any:
  """The parameters of ``model.Transformer(config)`` as ``jax.ShapeDtypeStruct`` leaves (nothing allocated).

  A new tree on every call, of a cached one: even built abstractly a
  Llama-sized model takes seconds, and the planner, the benchmarks and the
  tests ask for the same configurations again.
  """
  return jax.tree.map(lambda leaf: leaf, _abstract_transformer_params(config))


@functools.cache
def _abstract_transformer_params(config: model.TransformerConfig) -> Any:
  build = lambda: nnx.to_pure_dict(nnx.split(model.Transformer(config, rngs=nnx.Rngs(0)))[1])
  return jax.eval_shape(build)


@dataclasses.dataclass(frozen=True)
class Row:
  """One optimizer's bytes on one device; ``error`` says why it could not be built."""

  optimizer: str
  param_bytes: int
  gradient_bytes: int
  state_bytes: int  # On one device.
  state_bytes_per_param: float  # The whole state over the number of parameters.
  error: str | None = None
  state_dtypes: str = ""  # For example "uint8 (mu, nu), float32 (mu_scales, nu_scales)".

  @property
  def total_bytes(self) -> int:
    return self.param_bytes + self.gradient_bytes + self.state_bytes


@dataclasses.dataclass(frozen=True)
class FitReport:
  """Per-device bytes of every optimizer; ``str()`` is a markdown table."""

  rows: tuple[Row, ...]
  n_params: int
  devices: int
  memory: Memory | None
  title: str

  def fits(self, optimizer: str) -> bool:
    row = self.row(optimizer)
    if self.memory is None or row.error:
      raise ValueError(f"no fit for {optimizer!r}: " + (row.error or "no memory was given."))
    return row.total_bytes <= self.memory.nbytes

  def row(self, optimizer: str) -> Row:
    for row in self.rows:
      if row.optimizer == optimizer:
        return row
    raise ValueError(f"optimizer must be one of {[r.optimizer for r in self.rows]}; got {optimizer!r}.")

  def __str__(self) -> str:
    size = (self.memory or Memory(0)).format
    where = f"per device, sharded over {self.devices} devices" if self.devices > 1 else "one device"
    lines = [
      f"{self.title}: {self.n_params:,} parameters; {where}"
      + (f", {size(self.memory.nbytes)} each" if self.memory else "")
    ]
    header = ["optimizer", "state dtypes", "state B/param", "parameters", "gradients", "optimizer state", "total"]
    if self.memory:
      header += ["headroom", "fits"]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in self.rows:
      if row.error:
        lines.append(f"| {row.optimizer} | cannot be built: {row.error} |" + " |" * (len(header) - 2))
        continue
      cells = [
        row.optimizer,
        row.state_dtypes,
        f"{row.state_bytes_per_param:.3f}",
        size(row.param_bytes),
        size(row.gradient_bytes),
        size(row.state_bytes),
        size(row.total_bytes),
      ]
      if self.memory:
        cells += [size(self.memory.nbytes - row.total_bytes), "yes" if self.fits(row.optimizer) else "no"]
      lines.append("| " + " | ".join(cells) + " |")
    lines.append("Activations, gradient accumulation and the framework's own memory come on top of the total.")
    return "\n".join(lines)


def _abstract(params: Any, param_dtype: Any) -> Any:
  """``params`` as ``ShapeDtypeStruct`` leaves, floating ones cast to ``param_dtype`` if given."""

  def convert(path, leaf):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise ValueError(
        f"params must be arrays or jax.ShapeDtypeStruct (for example from jax.eval_shape); leaf"
        f" {leaves.path_name(path)!r} is a {type(leaf).__name__}."
      )
    dtype = leaf.dtype
    if param_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
      dtype = param_dtype
    return jax.ShapeDtypeStruct(tuple(leaf.shape), dtype)

  return jax.tree_util.tree_map_with_path(convert, params)


def _state_dtypes(state: Any) -> str:
  """The state's dtypes, largest share of its bytes first, each with its fields (``mu``, ``nu``).

  A field is the name of the state attribute nearest the leaf; dtypes under
  :data:`LISTED_SHARE` of the state's bytes (step counts, keys) are left out.
  """
  total = max(state_nbytes(state), 1)
  by_dtype: dict[str, dict[str, int]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    field = next((key.name for key in reversed(path) if isinstance(key, jax.tree_util.GetAttrKey)), "state")
    fields = by_dtype.setdefault(jnp.dtype(leaf.dtype).name, {})
    fields[field] = fields.get(field, 0) + state_nbytes(leaf)
  ranked = sorted(by_dtype.items(), key=lambda item: -sum(item[1].values()))
  return ", ".join(
    f"{dtype} ({', '.join(fields)})" for dtype, fields in ranked if sum(fields.values()) >= LISTED_SHARE * total
  )


def _shard_nbytes(leaf: Any, sharding: NamedSharding) -> int:
  """Bytes of the largest shard of ``leaf`` (uneven splits round up, as XLA pads them)."""
  spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
  shard = 1
  for dim, entry in zip(leaf.shape, spec):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    shard *= -(-dim // math.prod(sharding.mesh.shape[name] for name in names))
  return shard * jnp.dtype(leaf.dtype).itemsize


def _per_device_nbytes(tree: Any, shardings: Any) -> int:
  tree_leaves = jax.tree.leaves(tree)
  sharding_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  assert len(tree_leaves) == len(sharding_leaves), (len(tree_leaves), len(sharding_leaves))
  return sum(_shard_nbytes(leaf, sharding) for leaf, sharding in zip(tree_leaves, sharding_leaves))


def report(
  params: Any,
  *,
  memory: str | int | Memory | None = None,
  devices: int = 1,
  param_dtype: Any = None,
  n_heads: int | None = None,
  n_kv_heads: int | None = None,
  optimizer_names: Sequence[str] | None = None,
  title: str = "parameters",
) -> FitReport:
  """Per-device bytes of parameters, gradients and state for every optimizer, and whether they fit.

  Nothing is allocated: the states are ``jax.eval_shape(tx.init, params)``
  and measured by :func:`optax_memopt.state_nbytes`'s rule. Gradients are
  counted once, in the parameters' dtype.

  Args:
    params: the parameters, as arrays or ``jax.ShapeDtypeStruct`` (a
      ``jax.eval_shape`` of the model's initialisation, so that a model too
      large for this machine is never built). Flax layouts (``(in, out)``
      kernels) give Adam-mini and TACO their intended routing.
    memory: one device's memory, ``"80GB"``, ``"80GiB"`` or bytes; ``None``
      (default) prints the bytes without a verdict.
    devices: devices the model is sharded over (default 1). Each parameter
      and its gradient are cut along a dimension ``devices`` divides
      (replicated where none does), the state laid out after them by
      :func:`optax_memopt.state_shardings`.
    param_dtype: dtype of the floating-point parameters (and gradients), for
      example ``"bfloat16"``; ``None`` (default) keeps the given dtypes.
      Optimizers such as ``adamw_bf16`` keep some moments in this dtype;
      the ``adamw`` baseline keeps float32 moments. With bfloat16 or float16
      parameters every optimizer is followed by
      :func:`optax_memopt.stochastic_rounding`, the way to train them (its
      step count and key are in the state), and the title says so.
    n_heads, n_kv_heads: query and key/value heads, which Adam-mini needs to
      cut fused query and key kernels into heads (default ``None``: no fused
      kernels to cut).
    optimizer_names: entries of ``optimizers.OPTIMIZERS`` to report (default:
      all of them, in that table's order).
    title: the first line of the printed table.

  Returns:
    A :class:`FitReport`; ``print`` it for the table, or read ``rows`` and
    ``fits(name)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from memopt_tools import fit
    >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    >>> result = fit.report(params, memory="200MB", optimizer_names=["adamw", "microadam"])
    >>> result.row("adamw").state_bytes  # m and v in float32, plus the step count
    134217732
    >>> result.fits("adamw"), result.fits("microadam")
    (False, True)
  """
  names = optimizers.checked_names(optimizer_names)
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ValueError(f"devices must be an integer >= 1; got {devices!r}.")
  if param_dtype is not None:
    param_dtype = parse_param_dtype(param_dtype)
  device_memory = None if memory is None else parse_memory(memory)
  shapes = _abstract(params, param_dtype)
  n_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
  if n_params == 0:
    raise ValueError("params holds no parameters.")
  config = types.SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv_heads)
  rounded = any(jnp.dtype(leaf.dtype) in ROUNDED_DTYPES for leaf in jax.tree.leaves(shapes))
  if rounded:
    title += ", updates rounded stochastically (optax_memopt.stochastic_rounding)"

  mesh = param_shardings = None
  param_bytes = state_nbytes(shapes)
  if devices > 1:
    mesh = AbstractMesh((devices,), ("fsdp",))
    param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, split_spec(p.shape, mesh)), shapes)
    param_bytes = _per_device_nbytes(shapes, param_shardings)

  rows = []
  for name in names:
    # The baseline's m and v in float32: optax.adamw takes their dtype from
    # the parameters it is initialised with.
    init_shapes = _abstract(shapes, jnp.float32) if name == FLOAT32_BASELINE else shapes
    try:
      tx = optimizers.get(name).build(1e-3, config)
      state = jax.eval_shape(with_stochastic_rounding(tx).init if rounded else tx.init, init_shapes)
    except ValueError as error:
      rows.append(Row(name, param_bytes, param_bytes, 0, 0.0, error=str(error)))
      continue
    total_state = state_nbytes(state)
    state_bytes = total_state
    if mesh is not None:
      state_bytes = _per_device_nbytes(state, state_shardings(state, init_shapes, param_shardings, mesh))
    rows.append(
      Row(name, param_bytes, param_bytes, state_bytes, total_state / n_params, state_dtypes=_state_dtypes(state))
    )
  return FitReport(tuple(rows), n_params, devices, device_memory, title)


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows a default where there is one; an option without one says in its help what it means."""

  def _get_help_string(self, action: argparse.Action) -> str:
    return action.help if action.default is None else super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m optax_memopt.fit",
    description=__doc__.split("\n\n")[0],
    formatter_class=_DefaultsHelpFormatter,
  )
  parser.add_argument("--model", default="llama2_7b", help=f"one of {', '.join(MODELS)}")
  parser.add_argument(
    "--memory",
    type=_argument_type(parse_memory),
    default=None,
    help="one device's memory, e.g. 80GB (decimal) or 80GiB (binary); none: bytes only",
  )
  parser.add_argument(
    "--param-dtype",
    type=_argument_type(parse_param_dtype),
    default="float32",
    help=f"dtype of parameters and gradients: {', '.join(PARAM_DTYPES)}",
  )
  parser.add_argument("--devices", type=int, default=1, help="devices the model is sharded over (FSDP)")
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=None,
    metavar="OPTIMIZER",
    help=f"a subset of {', '.join(optimizers.OPTIMIZERS)} (default: all)",
  )
  parser.add_argument(
    "--compile",
    choices=gpu_targets.NAMES,
    default=None,
    help="also compile each optimizer's step for this GPU (no GPU needed; needs the"
    " gpu-compile extra) and report XLA's peak per device beside the arithmetic"
    " (default: no compile)",
  )
  step = parser.add_argument_group(
    "the whole training step (with --compile): forward, backward and optimizer on one GPU of the built-in model"
  )
  step.add_argument("--batch", type=int, default=None, help="sequences per step (default: the optimizer step only)")
  step.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
  step.add_argument(
    "--remat", choices=list(model.REMAT_POLICIES), default="none", help="what each layer keeps for the backward pass"
  )
  step.add_argument(
    "--margin", type=float, default=None, help="share of the memory kept free for what the compile cannot see (0.10)"
  )
  step.add_argument("--largest-batch", action="store_true", help="also find the largest batch that fits, from compiles")
  args = parser.parse_args(_negative_values_attached(sys.argv[1:] if argv is None else argv))
  if args.compile:
    # Before JAX starts its backends: the module sets the CUDA plugin's environment.
    from memopt_tools import gpu_compile

    try:
      gpu_compile.target_devices(args.compile, max(args.devices, 1))
    except gpu_compile.GpuCompilerMissing as error:
      parser.exit(2, f"--compile {args.compile}: {error}\n")

  if args.model not in MODELS:
    parser.error(f"--model: unknown model {args.model!r}; choose from {', '.join(MODELS)}")
  memory, param_dtype = args.memory, args.param_dtype
  if args.devices < 1:
    parser.error(f"--devices: must be >= 1; got {args.devices}")
  for name in args.optimizers or ():
    if name not in optimizers.OPTIMIZERS:
      parser.error(f"--optimizers: unknown optimizer {name!r}; choose from {', '.join(optimizers.OPTIMIZERS)}")
  if args.batch is not None and not args.compile:
    parser.error("--batch: compiles the training step for a GPU; give --compile h100, h200 or b200")
  if args.largest_batch and args.batch is None:
    parser.error("--largest-batch: give --batch, the second batch size compiled (the first is 1)")
  if args.batch is not None and args.batch < 1:
    parser.error(f"--batch: must be >= 1; got {args.batch}")
  if args.largest_batch and args.batch < 2:
    parser.error(f"--batch: must be >= 2 with --largest-batch; got {args.batch}")
  if args.batch is not None and not 1 <= args.seq_len <= MODELS[args.model].max_len:
    parser.error(f"--seq-len: must be in [1, {MODELS[args.model].max_len}] for {args.model}; got {args.seq_len}")
  if args.margin is not None and not 0 <= args.margin < 1:
    parser.error(f"--margin: must be in [0, 1); got {args.margin}")
  if args.batch is not None and args.devices != 1:
    parser.error("--batch: the training step is compiled for one device; --devices must be 1")

  config = MODELS[args.model]
  result = report(
    model_params(args.model, param_dtype),
    memory=memory,
    devices=args.devices,
    n_heads=config.n_heads,
    n_kv_heads=config.n_kv_heads,
    optimizer_names=args.optimizers,
    title=f"{args.model} ({param_dtype.name})",
  )
  print(result)
  if args.batch is not None:
    print()
    _print_training_step(args, param_dtype, memory)
  elif args.compile:
    compiled = gpu_compile.peak_report(
      model_params(args.model, param_dtype),
      target=args.compile,
      devices=args.devices,
      optimizer_names=args.optimizers,
      n_heads=config.n_heads,
      n_kv_heads=config.n_kv_heads,
      memory=None if memory is None else memory.nbytes,
      title=f"{args.model} ({param_dtype.name})",
    )
    print()
    print(compiled)


def training_loss(model_name: str, param_dtype: Any, remat: str, seq_len: int) -> tuple[Callable, Any, Callable]:
  """A built-in model's training: ``(loss_fn, params, tokens)``.

  ``loss_fn(params, tokens)`` is the next-token loss, ``params`` the
  parameters' shapes in ``param_dtype``, ``tokens(batch)`` a batch's shape:
  ``batch`` sequences of ``seq_len + 1`` tokens (predicting ``seq_len``).
  """
  from memopt_tools.training import loop

  config = dataclasses.replace(MODELS[model_name], remat=remat)
  graphdef = nnx.split(nnx.eval_shape(lambda: model.Transformer(config, rngs=nnx.Rngs(0))))[0]
  tokens = lambda batch: jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
  return (lambda p, batch: loop.next_token_loss(graphdef, p, batch)), model_params(model_name, param_dtype), tokens


def _print_training_step(args: argparse.Namespace, param_dtype: Any, memory: Memory | None) -> None:
  """The training-step table of ``fit --compile T --batch B``, and with ``--largest-batch`` the largest batch."""
  from memopt_tools import gpu_compile, train_compile

  config = MODELS[args.model]
  loss_fn, params, tokens = training_loss(args.model, param_dtype, args.remat, args.seq_len)
  options = dict(
    target=args.compile,
    memory=None if memory is None else memory.nbytes,
    margin=train_compile.MARGIN if args.margin is None else args.margin,
  )
  optimizer_options = dict(
    n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, stochastic_rounding=param_dtype != jnp.float32
  )
  title = f"{args.model} ({param_dtype.name}), batch {args.batch} x {args.seq_len} tokens, remat {args.remat}"
  report = train_compile.train_step_report(
    loss_fn,
    params,
    tokens(args.batch),
    optimizer_names=args.optimizers,
    title=title,
    **options,
    **optimizer_options,
  )
  print(report)
  if not args.largest_batch:
    return
  print()
  for name, program in report.programs.items():
    if isinstance(program, str):
      continue
    tx = train_compile.registered_optimizer(name, **optimizer_options)
    found = train_compile.largest_batch(
      lambda batch: (
        program.peak_bytes
        if batch == args.batch
        else train_compile.train_step_peak_bytes(loss_fn, params, tokens(batch), tx, target=args.compile)
      ),
      program.budget_bytes,
      first=1,
      second=args.batch,
    )
    size = gpu_compile.decimal_bytes
    peaks = ", ".join(f"{batch}: {size(peak)}" for batch, peak in found.peaks.items())
    print(
      f"{name}: the largest batch that fits in {size(found.budget_bytes)} is {found.batch}"
      + (f" ({found.batch + 1} does not)" if found.confirmed else "")
      + f"; XLA's peaks compiled, by batch: {peaks}"
    )


if __name__ == "__main__":
  main(sys.argv[1:])
