"""Optimizer states laid out like the parameters they belong to.

Compressed states are not shaped like their parameters (flat packed codes,
rings of sparse entries, per-block statistics), so ``jax.jit`` cannot guess
their shardings from the parameters'. :func:`state_shardings` gives each
state leaf a sharding that follows its parameter's, for the ``out_shardings``
of ``jax.jit(optimizer.init)`` and of a train step, or a checkpoint restore's
target. Every state field's layout relative to its parameter is declared
(:class:`Layout`): by our state classes' ``field_layouts``, by
:data:`FIELD_LAYOUTS` for optax's states, by :func:`declare_layouts` for
anyone else's; a state that declares nothing follows optax's convention,
every per-parameter leaf shaped like its parameter (``Layout.PARAM``).
:func:`typed_like_inputs` lets an update run under a mesh whose axes are
``AxisType.Explicit``.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Any, Callable, Iterator, Sequence

import jax
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from optax_memopt import leaves


class Layout(enum.Enum):
  """How the arrays of a state field lie relative to their parameter of shape ``(..., rows, columns)``.

  Every array under a field (a tree like the parameters, or a few such
  trees) has the field's layout. Whatever the layout (but ``REPLICATED``),
  an array shaped like its parameter takes the parameter's sharding (a small
  parameter's dense copy), and any other array of a replicated parameter is
  replicated. An array with none of its layout's shapes is cut as ``FLAT``
  (blocks that cross rows, a stacked parameter's per-layer values); under
  ``PARAM``, which has no other shape, :func:`state_shardings` raises.
  """

  #: Shaped like the parameter, sharded as it is.
  PARAM = "param"
  #: ``(..., blocks, per_block)``: the last axis cut into blocks, block-major
  #: (packed codes, their ``(..., blocks, 1)`` scales, per-block heavy hitters).
  BLOCKS = "blocks"
  #: The per-block scales of codes kept in the parameter's own shape:
  #: ``(..., blocks, 1)`` where blocks tile the last axis, else ``(blocks, 1)``
  #: over the flattened parameter.
  BLOCK_SCALES = "block_scales"
  #: One value per row, ``(..., rows, 1)``, in a state with ``BLOCKS`` fields:
  #: the rows sharded as those fields' rows.
  ROWS = "rows"
  #: The parameter's rank, each axis its full size or reduced to blocks:
  #: sharded as the parameter's axis where each shard holds whole blocks,
  #: else whole (a block mean over a sharded axis is all-reduced).
  KEEPDIMS = "keepdims"
  #: ``(..., columns)``: a statistic over the second-to-last axis (Adafactor's
  #: column means), sharded as the parameter's other axes and whole over the
  #: mesh axes of its rows, which every device's rows read: an all-reduce of
  #: the columns' partial sums, not a scatter followed by a gather.
  COLUMN_STATISTICS = "column_statistics"
  #: A matrix's low-rank projection (GaLore's projectors and its moments of
  #: projected gradients): ``(rows, rank)`` or ``(rank, columns)``, the
  #: parameter's axis sharded as the parameter's and the rank axis whole; a
  #: projector of the columns, ``(columns, rank)``, is cut as ``FLAT``.
  LOW_RANK = "low_rank"
  #: Buffers with no axis of the parameter's (packed codes of the flattened
  #: parameter, rings of sparse entries), and statistics that reduce a
  #: sharded axis: cut over the whole mesh as far as their shape allows.
  FLAT = "flat"
  #: Not a parameter's (step counts, PRNG keys): replicated.
  REPLICATED = "replicated"


#: The layouts of optax's states that our registered optimizers and wrappers
#: hold, by state class. ``None`` marks a field holding states that declare
#: their own. :func:`declare_layouts` adds to it.
FIELD_LAYOUTS: dict[type, dict[str, Layout | None]] = {
  optax.ScaleByAdamState: dict(count=Layout.REPLICATED, mu=Layout.PARAM, nu=Layout.PARAM),
  # Adafactor: a factored matrix's row and column statistics and (1,) v; else
  # v shaped like the parameter and (1,) statistics.
  optax.FactoredState: dict(count=Layout.REPLICATED, v_row=Layout.FLAT, v_col=Layout.FLAT, v=Layout.FLAT),
  optax.MultiStepsState: dict(
    mini_step=Layout.REPLICATED,
    gradient_step=Layout.REPLICATED,
    inner_opt_state=None,
    acc_grads=Layout.PARAM,
    skip_state=None,
  ),
  optax.InjectHyperparamsState: dict(count=Layout.REPLICATED, hyperparams=Layout.REPLICATED, inner_state=None),
  optax.InjectStatefulHyperparamsState: dict(
    count=Layout.REPLICATED, hyperparams=Layout.REPLICATED, hyperparams_states=Layout.REPLICATED, inner_state=None
  ),
}
if hasattr(optax.contrib, "GaLoreState"):  # where this optax has GaLore
  # Its base optimizer's state (Adam's, by default) holds the moments of the
  # projected gradients: the field's layout covers the states inside it.
  FIELD_LAYOUTS[optax.contrib.GaLoreState] = dict(
    count=Layout.REPLICATED, base_optimizer_state=Layout.LOW_RANK, projector=Layout.LOW_RANK
  )


def _checked(state_type: type, field_layouts: Any) -> dict[str, Layout | None]:
  fields = getattr(state_type, "_fields", ())
  if set(field_layouts) != set(fields) or not all(isinstance(v, Layout | None) for v in field_layouts.values()):
    raise ValueError(
      f"{state_type.__name__}.field_layouts must give a Layout (or None) for each of its fields"
      f" {fields}; got {field_layouts!r}."
    )
  return field_layouts


def declare_layouts(state_type: type, field_layouts: dict[str, Layout | None]) -> None:
  """Declares the :class:`Layout` of each field of a state ``NamedTuple`` class one cannot edit.

  A class of one's own declares them in a class attribute
  ``field_layouts: dict[str, Layout | None]`` instead. ``None`` marks a field
  holding states that declare their own.

  Raises:
    ValueError: ``field_layouts`` does not give a layout for each field of ``state_type`` once.

  Examples:
    >>> from typing import NamedTuple
    >>> class LowRankState(NamedTuple):  # another library's
    ...   count: jax.Array
    ...   factor: dict
    >>> declare_layouts(LowRankState, {"count": Layout.REPLICATED, "factor": Layout.LOW_RANK})
  """
  FIELD_LAYOUTS[state_type] = _checked(state_type, dict(field_layouts))


def _field_layouts(node: Any) -> dict[str, Layout | None] | None:
  """A state's declared field layouts: its class's ``field_layouts``, else :data:`FIELD_LAYOUTS`'."""
  declared = getattr(type(node), "field_layouts", None) or FIELD_LAYOUTS.get(type(node))
  return None if declared is None else _checked(type(node), declared)


def _leaf_layouts(state: Any) -> list[tuple[Layout | None, str]]:
  """Per leaf of ``state`` (in ``jax.tree.leaves`` order): its declared layout, or None, and its field.

  The field is ``Type.name`` of the innermost ``NamedTuple`` state holding
  the leaf (``""`` where there is none). A field's layout covers every array
  under it, states inside it included; a field declared ``None`` leaves them
  to declare their own.
  """

  def walk(node: Any, layout: Layout | None, field: str) -> Iterator[tuple[Layout | None, str]]:
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      declared = _field_layouts(node) or {}
      for name in node._fields:
        yield from walk(getattr(node, name), layout or declared.get(name), f"{type(node).__name__}.{name}")
      return
    children = jax.tree_util.tree_flatten(node, is_leaf=lambda child: child is not node)[0]
    if len(children) == 1 and children[0] is node:
      yield layout, field
    else:
      for child in children:
        yield from walk(child, layout, field)

  return list(walk(state, None, ""))


def declared_layouts(state: Any) -> list[Layout | None]:
  """Per leaf of ``state`` (in ``jax.tree.leaves`` order): its declared layout, or None (taken as ``Layout.PARAM``).

  Raises:
    ValueError: a state class's declaration does not name each of its fields once.
  """
  return [layout for layout, _ in _leaf_layouts(state)]


def split_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """Shards a leaf over as many devices as its shape allows, without padding.

  Mesh axes, largest first, each go to the dimension with the most elements
  left per shard among those they divide. A flat block-major buffer
  (MicroAdam's 4-bit codes, its ``(window, n_blocks * k)`` ring) is thereby
  cut into contiguous runs of elements; where the mesh does not divide the
  long axis, a remaining mesh axis may go to a short one (the ring's window).
  """
  assigned: list[list[str]] = [[] for _ in shape]
  per_shard = list(shape)
  for axis in sorted(mesh.axis_names, key=lambda a: -mesh.shape[a]):
    size = mesh.shape[axis]
    divisible = [d for d in range(len(shape)) if size > 1 and per_shard[d] % size == 0]
    if divisible:
      dim = max(divisible, key=lambda d: per_shard[d])
      assigned[dim].append(axis)
      per_shard[dim] //= size
  return PartitionSpec(*(tuple(a) if len(a) > 1 else (a[0] if a else None) for a in assigned))


def _last_match(path: tuple, part: tuple) -> int:
  """Where ``part`` last occurs in ``path`` after its first key, or -1.

  A state's own container (a chain's index, a state field) always comes
  first, so a parameter path never starts a state leaf's path.
  """
  starts = [i for i in range(1, len(path) - len(part) + 1) if path[i : i + len(part)] == part]
  return starts[-1] if starts else -1


def _owners_in_containers(state: Any, params: Any) -> list[tuple[int, tuple[str, ...]]]:
  """Per leaf of ``state`` (in ``jax.tree.leaves`` order): its parameter's index, or -1,
  and the path of the state it is a field of.

  ``[0].mu['w']`` and ``[0].mu_scales['w']`` are fields of ``[0]``;
  ``.acc_grads['w']`` (a wrapper's own buffer) and
  ``.inner_opt_state[0].mu.packed['w']`` are not fields of one state.
  """
  param_paths = [
    (leaves.key_names(path), index) for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])
  ]

  def owner(path):
    keys = leaves.key_names(path)
    matches = [
      (len(param_path), _last_match(keys, param_path), index)
      for param_path, index in param_paths
      if _last_match(keys, param_path) >= 0
    ]
    if not matches:
      return -1, keys
    _, start, index = max(matches)
    return index, keys[: start - 1]

  return [owner(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def owners(state: Any, params: Any) -> Any:
  """For each state leaf, the index in ``jax.tree.leaves(params)`` of its parameter, or -1.

  A state leaf belongs to the parameter whose path its own path holds
  (``[0].mu['dense']['kernel']`` to ``['dense']['kernel']``): the longest such
  path, and of equally long ones the last in the leaf's path. Step counts and
  PRNG keys belong to none.
  """
  indices = [index for index, _ in _owners_in_containers(state, params)]
  return jax.tree.unflatten(jax.tree.structure(state), indices)


def _flat_blocks(leaf_shape: tuple, shape: tuple, first_axis_spec: Any, mesh: Mesh) -> bool:
  """Whether a leaf is ``(blocks, 1)``, a value per block of the flattened parameter, splittable as its first axis.

  Low-bit AdamW's scales where blocks cross rows. The shards of a
  parameter's first axis are contiguous runs of its flattened elements, so
  its blocks split with them, as the partitioner splits an update's output.
  """
  first = _mesh_axes(first_axis_spec)
  return (
    len(shape) >= 2
    and len(leaf_shape) == 2
    and leaf_shape[1] == 1
    and bool(first)
    and leaf_shape[0] % _shard_count(first, mesh) == 0
  )


def _mesh_axes(entry: Any) -> tuple[str, ...]:
  return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def _shard_count(names: Sequence[str], mesh: Mesh) -> int:
  return math.prod(mesh.shape[name] for name in names)


def _block_major_spec(
  leaf_shape: Sequence[int], shape: Sequence[int], spec: tuple, mesh: Mesh, *, codes_in_param_layout: bool
) -> PartitionSpec | None:
  """The spec of ``(*shape[:-1], blocks, per_block)``, the parameter's last axis cut into blocks; else None.

  The parameter's spec with its last axis's mesh axes moved to where they
  divide. Onto the blocks when they divide their number: each device then
  holds the blocks of its own columns. Otherwise, when the codes are
  block-major too (not ``codes_in_param_layout``) and several blocks cut the
  last axis evenly (ternary Adam's 3 blocks of a 384-wide row over 2
  devices), or the leaf holds one value per block (``per_block == 1``:
  ternary Adam's scales, which the partitioner scatters like any reduction
  over a sharded axis), onto the rows beside the mesh axes the rows already
  have, the layout the partitioner gives an update's output there; else
  nowhere (replicated over them: the partitioner keeps the codes of one
  block per row whole, TACO's 3 parts of a 256-wide row, and the block
  scales of codes in the parameter's own layout, which every device holding
  part of a row reads). Matrices and higher only: a vector's flat buffers
  have the same rank.
  """
  if len(shape) < 2 or len(leaf_shape) != len(shape) + 1 or tuple(leaf_shape[: len(shape) - 1]) != tuple(shape[:-1]):
    return None
  last = _mesh_axes(spec[-1])
  blocks = leaf_shape[-2]
  if blocks % _shard_count(last, mesh) == 0:
    return PartitionSpec(*spec[:-1], spec[-1], None)
  rows = _mesh_axes(spec[-2]) + last
  if (
    not codes_in_param_layout
    and (blocks > 1 or leaf_shape[-1] == 1)
    and shape[-1] % blocks == 0
    and leaf_shape[-3] % _shard_count(rows, mesh) == 0
  ):
    return PartitionSpec(*spec[:-2], rows, None, None)
  return PartitionSpec(*spec[:-1], None, None)


def _kept_axis_spec(blocks: int, size: int, entry: Any, mesh: Mesh) -> Any:
  """The mesh axes of a keep-dims axis of ``blocks`` values over a parameter axis of ``size``.

  The parameter's where each of its shards holds whole blocks (Adam-mini's
  query heads over ``tp`` when the devices divide the heads), else none: a
  mean over an axis cut within a block (a column's rows, or a head's rows
  over ``fsdp``) is all-reduced, and every device reads it whole.
  """
  if blocks == size or (blocks > 1 and blocks % _shard_count(_mesh_axes(entry), mesh) == 0):
    return entry
  return None


def state_shardings(state: Any, params: Any, shardings: Any, mesh: Mesh) -> Any:
  """Shardings for an optimizer state that follow the parameters' shardings.

  Each state leaf is placed after its parameter (see :func:`owners`), as its
  field's :class:`Layout` says. Layouts are declared: by a state class's
  ``field_layouts`` (all of ours), by :data:`FIELD_LAYOUTS` (optax's
  states), or by :func:`declare_layouts`. A state that declares nothing
  follows optax's convention: each of its leaves that belongs to a parameter
  is shaped like it (``Layout.PARAM``). Leaves of no parameter (step counts,
  PRNG keys) are replicated.

  The ``BLOCKS`` of a sharded parameter carry the mesh axes of its last axis
  on ``blocks`` where they divide it; otherwise block-major codes whose
  blocks cut the last axis evenly put those mesh axes on the rows (ternary
  Adam's 3 blocks of a 384-wide row over 2 devices), and everything else is
  replicated over them (``BLOCK_SCALES``: a device needs the scale of every
  block its columns touch).

  Args:
    state: the state or its ``jax.eval_shape``.
    params: the parameters or their ``jax.eval_shape``.
    shardings: the parameters' ``NamedSharding``, a tree like ``params``.
    mesh: the mesh of ``shardings``.

  Returns:
    A tree like ``state`` of ``NamedSharding``, for ``out_shardings`` of
    ``jax.jit(optimizer.init)`` and of the train step, or the ``target`` of a
    checkpoint restore.

  Raises:
    ValueError: a leaf of a ``Layout.PARAM`` field (declared, or of a state
      that declares nothing) is not shaped like its parameter; or a state
      class's declaration does not name each of its fields once.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("fsdp",))
    >>> params = {"w": jnp.zeros((8, 4))}
    >>> shardings = {"w": NamedSharding(mesh, P("fsdp"))}
    >>> state = jax.eval_shape(optax.adam(1e-3).init, params)
    >>> state_shardings(state, params, shardings, mesh)[0].mu["w"] == shardings["w"]
    True
  """
  param_leaves = list(zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))
  replicated = NamedSharding(mesh, PartitionSpec())
  state_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  layouts = _leaf_layouts(state)
  # A leaf's owner: its parameter's index and the state it is a field of
  # (the fields of one state are laid out together).
  state_owners = _owners_in_containers(state, params)

  def param_spec(param, sharding):
    return tuple(sharding.spec) + (None,) * (param.ndim - len(sharding.spec))

  def block_major_spec(leaf, owner, layout):
    param, sharding = param_leaves[owner[0]]
    if sharding.is_fully_replicated:
      return None
    return _block_major_spec(
      leaf.shape,
      param.shape,
      param_spec(param, sharding),
      mesh,
      codes_in_param_layout=layout is Layout.BLOCK_SCALES,
    )

  # The rows' spec of each state's block-major leaves, which its per-row
  # values (TACO's scales) share: the partitioner derives those from them.
  block_rows = {}
  for (_, leaf), owner, (layout, _) in zip(state_leaves, state_owners, layouts):
    if owner[0] >= 0 and layout is Layout.BLOCKS and (spec := block_major_spec(leaf, owner, layout)) is not None:
      block_rows[owner] = spec[-3]

  def place(path, leaf, owner, layout, field):
    index = owner[0]
    if index < 0 or layout is Layout.REPLICATED:
      return replicated
    param, sharding = param_leaves[index]
    shape, leaf_shape = tuple(param.shape), tuple(leaf.shape)
    # Small parameters keep a dense copy in any field (low-bit AdamW's float32 moments).
    if leaf_shape == shape:
      return sharding
    if layout in (Layout.PARAM, None):
      declared = "is declared Layout.PARAM" if layout else "declares no layout, so is taken as Layout.PARAM"
      raise ValueError(
        f"State leaf {jax.tree_util.keystr(path)} has shape {leaf_shape}, its parameter {shape}, but its field"
        f" {field or '(of no NamedTuple state)'} {declared}. Declare its state's layouts (optax_memopt.sharding.Layout)"
        " in a class attribute field_layouts, or by optax_memopt.sharding.declare_layouts(StateClass, {field: Layout})."
      )
    if sharding.is_fully_replicated:
      return replicated
    spec = param_spec(param, sharding)
    block_spec = block_major_spec(leaf, owner, layout) if layout in (Layout.BLOCKS, Layout.BLOCK_SCALES) else None
    if block_spec is not None:
      return NamedSharding(mesh, block_spec)
    if layout is Layout.BLOCK_SCALES and _flat_blocks(leaf_shape, shape, spec[0], mesh):
      return NamedSharding(mesh, PartitionSpec(spec[0], None))
    if layout is Layout.ROWS and leaf_shape == (*shape[:-1], 1):
      return NamedSharding(mesh, PartitionSpec(*spec[:-2], block_rows.get(owner, spec[-2]), None))
    if layout is Layout.KEEPDIMS and len(leaf_shape) == len(shape):
      kept = [_kept_axis_spec(blocks, size, entry, mesh) for blocks, size, entry in zip(leaf_shape, shape, spec)]
      return NamedSharding(mesh, PartitionSpec(*kept))
    if layout is Layout.COLUMN_STATISTICS and leaf_shape == (*shape[:-2], shape[-1]):
      return NamedSharding(mesh, PartitionSpec(*spec[:-2], spec[-1]))
    if layout is Layout.LOW_RANK and len(leaf_shape) == len(shape) and any(a == b for a, b in zip(leaf_shape, shape)):
      return NamedSharding(mesh, PartitionSpec(*(s if a == b else None for a, b, s in zip(leaf_shape, shape, spec))))
    return NamedSharding(mesh, split_spec(leaf_shape, mesh))

  return treedef.unflatten(
    [
      place(path, leaf, owner, layout, field)
      for (path, leaf), owner, (layout, field) in zip(state_leaves, state_owners, layouts)
    ]
  )


def _explicit_mesh(tree: Any) -> Any:
  """The mesh whose explicit axes type ``tree``'s arrays: the current one, else the arrays' own.

  ``jax.make_mesh`` makes explicit axes by default, and arrays placed on such
  a mesh carry it in their type even when no ``jax.set_mesh`` is in effect.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return mesh
  for leaf in jax.tree.leaves(tree):
    leaf_mesh = jax.typeof(leaf).sharding.mesh
    if not leaf_mesh.empty and AxisType.Explicit in leaf_mesh.axis_types:
      return leaf_mesh
  return mesh


def _split_explicit_axes(mesh: Any) -> tuple[str, ...]:
  """The mesh's explicit axes that split something (of size > 1)."""
  if mesh.empty:
    return ()
  return tuple(
    name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit and mesh.shape[name] > 1
  )


# Whether the steps whose kernels XLA cannot partition (MicroAdam's) are
# partitioned along their blocks by ``custom_partitioning``.
# The JAX versions CI tests differ: JAX 0.10 partitions them; JAX 0.12 refuses
# ``custom_partitioning`` when it lowers for another platform without devices
# (an abstract mesh), which is how kernels are lowered for CUDA on a CPU host.
# Elsewhere those steps take the unpartitioned program: the same numbers, with
# the partitioner gathering a sharded tensor's blocks around the kernels.
PARTITIONS_KERNEL_STEPS = jax.__version_info__[:2] <= (0, 10)


def typed_like_inputs(update_fn: Callable[..., Any]) -> Callable[..., Any]:
  """Lets an ``update_fn`` run on arrays sharded over explicit mesh axes.

  Under a mesh of ``AxisType.Explicit`` axes an array's sharding is part of
  its type, and every reshape, gather or scatter that splits a sharded axis
  (a parameter cut into blocks, heads or packed codes) would need its output
  sharding spelled out. Our states keep their shapes and dtypes from step to
  step and the updates take the gradients' shapes, so the outputs' shardings
  are the inputs': the body runs with the explicit axes left to the
  partitioner (``jax.sharding.auto_axes``) and its outputs are given the
  shardings of the incoming gradients and state. The mesh is the current
  one (``jax.set_mesh``) or, without one, the mesh in the arrays' types.
  Elsewhere (no mesh, or ``AxisType.Auto`` axes) ``update_fn`` runs as it is.
  """

  @functools.wraps(update_fn)
  def update(updates, state, params=None):
    mesh = _explicit_mesh((updates, state, params))
    axes = _split_explicit_axes(mesh)
    if not axes:
      return update_fn(updates, state, params)
    # Specs, not shardings: arrays created without a mesh (a step count)
    # carry an empty one.
    spec_of = lambda leaf: jax.typeof(leaf).sharding.spec
    out_sharding = (jax.tree.map(spec_of, updates), jax.tree.map(spec_of, state))
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.sharding.auto_axes(update_fn, axes=axes, out_sharding=out_sharding)(updates, state, params)

  return update
