"""TACO: Ternary Absolute-max Column-wise One-sparse Optimizer.

Jiang, McGee, Bergou, Cai, Dutta, "TACO: Ternary Absolute-max Column-wise
One-sparse Optimizer for LLM Fine-Tuning", 2026,
https://arxiv.org/abs/2610.02199.

Steepest descent, as Muon, but under the dimension-normalized 1->1 operator
norm of each weight matrix. For a torch-layout ``W`` of shape
``(m_out, n_in)`` that norm is ``(n_in / m_out) * max_j ||W[:, j]||_1`` and
the steepest-descent direction has one non-zero per column: the sign of the
column's largest gradient entry, scaled by ``m_out / n_in``. The practical
variant keeps a few low-precision momentum entries per column ("heavy
hitters") instead of a momentum matrix, so the state is a small fraction of a
byte per parameter.

Only the abstract is public; every choice below it leaves open is ours:

* Layout. Flax kernels are ``(in, out)``: the torch column of input feature
  ``i`` is the kernel's row ``i``, and the selection runs along the output
  axis of each row. A parameter of shape ``(*batch, *inputs, *outputs)`` is
  a batch of independent ``(prod(inputs), prod(outputs))`` matrices, as told
  by :class:`MatrixAxes`; the default (no batch axis, one input axis) reads
  ``Dense`` kernels ``(in, out)`` and ``DenseGeneral`` kernels
  ``(in, heads, head_dim)`` as ``(in, heads * head_dim)``. Stacked layers
  (``nn.scan``, ``nnx.vmap``) take ``batch_dims=1``; an attention output
  kernel ``(heads, head_dim, out)`` takes ``input_dims=2``.
* Ties go to the lower output index (``pallas_kernels.column_select``).
* Merge rule. Per row, untracked entries have momentum zero, so the candidate
  momentum is ``u = beta * u_tracked + (1 - beta) * g`` on tracked entries
  and ``(1 - beta) * g`` elsewhere. The ``k`` entries of largest ``|u|`` over
  the whole row are kept (this is the tracked entries merged with the row's
  top entries of ``|g|``: no other entry can enter), and the step is on the
  largest. An evicted entry's momentum is dropped; a newcomer starts at
  ``(1 - beta) * g``, without bias correction. The selection ranks
  ``u / (1 - beta) = g + w * u_tracked`` with ``w = beta / (1 - beta)``
  rounded to bfloat16 (a relative change under ``2**-9``, far below the
  float8 codes' ``2**-4``): the product is then exact, so ``u`` rounds the
  same way wherever XLA recomputes it, with or without a fused multiply-add.
* Segments (default: ``k`` of them, one heavy hitter each). The row's
  outputs are cut into ``segments`` contiguous parts of
  ``ceil(n_out / segments)`` columns, and the merge rule runs in each part
  with ``k / segments`` slots. The step is still on the row's largest
  ``|u|`` (it is some part's largest), but the slots spread over the row
  instead of following its ``k`` largest entries (``segments = 1``). One
  slot per part is the default because the selection is then one reduction
  per part instead of a per-row top-k (faster on CPU: the ``taco`` and
  ``taco_one_segment`` rows of ``benchmarks/data/step_time.json``), and a
  part's slots live with its columns, so under tensor parallelism every
  device keeps the state of its own columns (``segments`` a multiple of the
  ``tp`` size). It costs a little loss against ``segments = 1``
  (``benchmarks/README.md``, convergence).
* Storage. Momenta are float8 e4m3 codes with one bfloat16 scale per row, the
  smallest power of two at or above ``max|u| / 448`` (448 is e4m3's largest
  value): dividing by a power of two is exact, so codes round only once and
  values that e4m3 represents survive unchanged. Indices are int16 (int32
  for more than 32768 outputs).
* Defaults ``k = 16``, ``beta = 0.9``: sixteen slots cost
  ``16 * 3 + 2 = 50`` bytes per row, under 0.05 bytes per parameter from
  1024 outputs on (0.012 at 4096, the paper's ~0.01 regime); ``beta`` is
  Adam's and Lion's usual first-moment decay. ``k = 0`` is the paper's
  stateless method (``beta`` is then unused).

Parameters TACO does not cover (vectors, scalars and, by default,
embeddings) go to a fallback transformation: :func:`taco` routes with
``optax.partition`` and :func:`taco_labels`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from optax_memopt import hyperparameters, leaves, sharding
from pallas_kernels import static_args
from pallas_kernels.column_select import column_select

TACO_LABEL = "taco"
FALLBACK_LABEL = "fallback"
# Lowercase substrings of a parameter's path that mark an embedding table.
DEFAULT_EMBEDDING_NAMES = ("embed", "wte", "wpe")
_CODE_DTYPE = jnp.float8_e4m3fn
_CODE_MAX = float(jnp.finfo(_CODE_DTYPE).max)
_SCALE_DTYPE = jnp.bfloat16
# Scales stay normal bfloat16 numbers: a subnormal one could flush to zero.
_MIN_SCALE_EXPONENT = int(jnp.finfo(_SCALE_DTYPE).minexp)


@dataclasses.dataclass(frozen=True)
class MatrixAxes:
  """How a parameter of shape ``(*batch, *inputs, *outputs)`` is read as matrices.

  The leading ``batch_dims`` axes index independent matrices, the next
  ``input_dims`` axes fold into the input axis (the torch columns, one step
  each), all remaining axes fold into the output axis (searched for the
  largest entry).

  Attributes:
    batch_dims: leading axes of independent matrices, ``>= 0`` (1 for layers
      stacked by ``nn.scan``).
    input_dims: axes after them that form the input, ``>= 1`` (2 for an
      attention output kernel ``(heads, head_dim, out)``).

  Examples:
    >>> from optax_memopt.taco import MatrixAxes
    >>> MatrixAxes().matrix_shape((64, 4, 16))  # DenseGeneral (in, heads, head_dim)
    ((), 64, 64)
    >>> MatrixAxes(batch_dims=1).matrix_shape((2, 64, 256))  # two stacked layers
    ((2,), 64, 256)
  """

  batch_dims: int = 0
  input_dims: int = 1

  def __post_init__(self):
    hyperparameters.check_int("MatrixAxes.batch_dims", self.batch_dims, 0)
    hyperparameters.check_int("MatrixAxes.input_dims", self.input_dims, 1)

  def matrix_shape(self, shape: Sequence[int]) -> tuple[tuple[int, ...], int, int] | None:
    """``(batch_shape, n_in, n_out)``, or ``None`` when ``shape`` has no output axis left."""
    split = self.batch_dims + self.input_dims
    if len(shape) <= split:
      return None
    return (
      tuple(shape[: self.batch_dims]),
      math.prod(shape[self.batch_dims : split]),
      math.prod(shape[split:]),
    )


# One ``MatrixAxes`` for every parameter, or a function of (path, parameter).
MatrixAxesSpec = MatrixAxes | Callable[[jax.tree_util.KeyPath, Any], MatrixAxes]


def _axes_for(matrix_axes: MatrixAxesSpec, path, leaf) -> MatrixAxes:
  axes = matrix_axes(path, leaf) if callable(matrix_axes) else matrix_axes
  if not isinstance(axes, MatrixAxes):
    raise ValueError(
      "matrix_axes must be a MatrixAxes or a function (path, parameter) ->"
      f" MatrixAxes; got {axes!r} for {jax.tree_util.keystr(path)}."
    )
  return axes


class ScaleByTacoState(NamedTuple):
  """State of :func:`scale_by_taco`: ``k`` heavy hitters per row of every matrix.

  Per parameter of matrix shape ``(batch_shape, n_in, n_out)`` (see
  :class:`MatrixAxes`), with rows cut into ``parts`` segments of ``width``
  columns, each keeping ``slots = min(k // segments, n_out - (parts - 1) *
  width)`` heavy hitters by decreasing ``|momentum|`` (``parts = 1`` and
  ``slots = min(k, n_out)`` for one segment). The segment axis lets the state
  shard with its parameter's output axis (``optax_memopt.state_shardings``).

  ``indices``, ``mu`` and ``scales`` are trees like the parameters, with
  exactly one array per parameter (the layout Flax NNX's ``nnx.Optimizer``
  keeps intact under ``nnx.jit``); with ``k = 0`` those arrays are empty
  (``slots = 0``), of the shapes below.
  """

  count: jax.typing.ArrayLike  # shape=(), dtype=jnp.int32.
  # shape=(*batch_shape, n_in, parts, slots), dtype=jnp.int16 (int32 above
  # static_args.INT16_INDEX_LIMIT outputs): the tracked output indices,
  # distinct within a row.
  indices: optax.Updates
  # shape=(*batch_shape, n_in, parts, slots), dtype=jnp.float8_e4m3fn: the tracked
  # entries' momentum (optax's mu: an EMA of the gradient) / scales.
  # optax_memopt.checkpoint also restores checkpoints that name it momentum.
  mu: optax.Updates
  # shape=(*batch_shape, n_in, min(parts * slots, 1)), dtype=jnp.bfloat16: a power of two.
  scales: optax.Updates

  field_layouts = {
    "count": sharding.Layout.REPLICATED,
    "indices": sharding.Layout.BLOCKS,
    "mu": sharding.Layout.BLOCKS,
    "scales": sharding.Layout.ROWS,
  }


def _power_of_two_at_least(x: jax.Array) -> jax.Array:
  """The smallest power of two ``>= x`` (1 for ``x = 0``), no smaller than bfloat16's least normal."""
  mantissa, exponent = jnp.frexp(x)
  exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
  return jnp.ldexp(jnp.float32(1), jnp.maximum(exponent, _MIN_SCALE_EXPONENT))


def _quantize(momentum: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float8 codes and per-row scales of ``momentum[rows, slots]``."""
  scale = _power_of_two_at_least(jnp.max(jnp.abs(momentum), axis=1, keepdims=True) / _CODE_MAX)
  return (momentum / scale).astype(_CODE_DTYPE), scale.astype(_SCALE_DTYPE)


def _dequantize(codes: jax.Array, scale: jax.Array) -> jax.Array:
  return codes.astype(jnp.float32) * scale.astype(jnp.float32)


def _matrix_shape(axes: MatrixAxes, path, leaf) -> tuple[tuple[int, ...], int, int]:
  shape = axes.matrix_shape(jnp.shape(leaf))
  if shape is None:
    raise ValueError(
      f"scale_by_taco needs more than batch_dims + input_dims ="
      f" {axes.batch_dims + axes.input_dims} axes; parameter"
      f" {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}. Route it to"
      " a fallback (optax_memopt.taco's labels, see taco_labels) or pass"
      " matrix_axes."
    )
  return shape


@dataclasses.dataclass(frozen=True)
class _Segments:
  """How a row of ``n_out`` outputs is cut for ``k`` heavy hitters in ``segments`` parts.

  Contiguous segments of ``width = ceil(n_out / segments)`` columns (fewer
  segments when ``n_out < segments``), the last one possibly shorter; each
  keeps ``per_segment = min(k // segments, last segment's width)`` heavy
  hitters, so no segment keeps a column twice or one past ``n_out``.
  ``k = 0`` is one segment and no slot.
  """

  count: int
  width: int
  per_segment: int

  @classmethod
  def of(cls, n_out: int, k: int, segments: int) -> "_Segments":
    if k == 0 or n_out == 0:
      return cls(count=1, width=n_out, per_segment=0)
    width = -(-n_out // segments)
    count = -(-n_out // width)
    return cls(count, width, min(k // segments, n_out - (count - 1) * width))

  @property
  def slots(self) -> int:
    return self.count * self.per_segment


@dataclasses.dataclass(frozen=True)
class _MatrixView:
  """A parameter read as ``prod(batch_shape) * n_in`` rows of ``n_out`` outputs, each row cut by ``cut``.

  Not a pytree: a tree of them, one per parameter, is an argument of the
  per-parameter step like the state's trees.
  """

  batch_shape: tuple[int, ...]
  n_in: int
  n_out: int
  cut: _Segments

  @property
  def slots_shape(self) -> tuple[int, ...]:
    """The shape of the parameter's tracked indices and codes."""
    return (*self.batch_shape, self.n_in, self.cut.count, self.cut.per_segment)


def _check_implementation(implementation: Any) -> None:
  """Refuses, naming it, an ``implementation`` other than ``None`` or ``"xla"``: the selection has no kernel."""
  if not (implementation is None or (isinstance(implementation, str) and implementation == "xla")):
    raise ValueError(
      "implementation must be one of None or 'xla' (TACO's selection, pallas_kernels.column_select, is XLA only,"
      f" with no Pallas kernel); got {implementation!r}."
    )


def scale_by_taco(
  k: int = 16,
  beta: jax.typing.ArrayLike = 0.9,
  *,
  segments: int | None = None,
  matrix_axes: MatrixAxesSpec = MatrixAxes(),
  implementation: Literal["xla"] | None = None,
) -> optax.GradientTransformation:
  r"""TACO's direction: per input feature, the sign of its largest output entry.

  For every matrix ``G`` of shape ``(n_in, n_out)`` (Flax layout; a torch
  column is a row here) the direction is

  .. math::

    D_{i, o} = \frac{n_{out}}{n_{in}} \, \operatorname{sign}(U_{i, o^*_i})
    \, [o = o^*_i], \qquad o^*_i = \arg\max_o |U_{i, o}|,

  ties toward the lower ``o``, returned with optax's sign convention (the
  alias's ``scale_by_learning_rate`` negates it). With ``k = 0``, ``U = G``:
  the paper's exact steepest-descent direction, with no state. With
  ``k > 0``, ``U`` is the momentum of the row's heavy hitters:

  .. math::

    U_{i, o} = \beta \, \hat{u}_{i, o} + (1 - \beta) \, G_{i, o}

  where :math:`\hat{u}` is the stored momentum on the row's tracked entries
  and 0 elsewhere; the ``min(k, n_out)`` entries of largest ``|U|`` are
  stored (float8 e4m3 with a power-of-two bfloat16 scale per row, int16
  indices) for the next step, or, by default, the row is cut into ``k``
  contiguous parts and each keeps its largest (``segments``). The module
  docstring lists these choices.

  Args:
    k: heavy hitters kept per row (torch column), ``>= 0``; 16 by default,
      50 bytes per row (module docstring). It fixes the state's shape: list
      it in ``static_args`` of ``optax.inject_hyperparams``.
    beta: momentum decay in ``[0, 1)``; 0.9, Adam's and Lion's usual first
      moment decay. Unused when ``k = 0``.
    segments: contiguous parts of each row that keep ``k / segments`` heavy
      hitters each, ``>= 1`` and dividing ``k``; ``None`` is ``k`` (one
      each, selected by reductions: faster on CPU than the per-row top-k of
      ``segments = 1``, which keeps the row's ``k`` largest wherever they
      are; see the module docstring). It fixes the state's shape: when
      given, list it in ``static_args`` of ``optax.inject_hyperparams``.
    matrix_axes: a :class:`MatrixAxes` for every parameter, or a function
      ``(path, parameter) -> MatrixAxes`` (a function goes in ``static_args``
      of ``optax.inject_hyperparams``, which otherwise calls it as a
      schedule). Every parameter must have an output axis left (use
      :func:`taco` to route the others elsewhere).
    implementation: ``None`` or ``"xla"``, the same: the selection
      (``pallas_kernels.column_select``) is XLA only on every platform, so
      ``"pallas"`` and ``"interpret"`` raise ``ValueError``.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ScaleByTacoState`.

  Raises:
    ValueError: for ``k < 0``, ``segments`` not dividing ``k``, ``beta``
      outside ``[0, 1)`` (when a Python number), an ``implementation``
      other than ``None`` or ``"xla"``, a traced ``k`` or ``segments`` (list them in
      ``static_args``), or (at ``init``) a parameter with too few axes or
      not real floating point.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_memopt
    >>> tx = optax_memopt.scale_by_taco(k=0)
    >>> grads = {"kernel": jnp.array([[0.1, -0.4], [0.3, 0.3]])}
    >>> updates, _ = tx.update(grads, tx.init(grads))
    >>> updates["kernel"]  # n_out / n_in = 1
    Array([[ 0., -1.],
           [ 1.,  0.]], dtype=float32)

  References:
    Jiang et al., "TACO: Ternary Absolute-max Column-wise One-sparse Optimizer
    for LLM Fine-Tuning", 2026, https://arxiv.org/abs/2610.02199
  """
  k = hyperparameters.check_int("k", k, 0, hint=" (0 is stateless TACO)")
  segments = hyperparameters.check_int("segments", max(k, 1) if segments is None else segments, 1)
  if k % segments:
    raise ValueError(f"segments must divide k={k}; got {segments}.")
  hyperparameters.check_decay_rate("beta", beta)
  _check_implementation(implementation)
  if not (isinstance(matrix_axes, MatrixAxes) or callable(matrix_axes)):
    raise ValueError(
      f"matrix_axes must be a MatrixAxes or a function (path, parameter) -> MatrixAxes; got {matrix_axes!r}."
    )

  def matrix_views(params) -> Any:
    """A ``_MatrixView`` per parameter, read by its :class:`MatrixAxes` (which may depend on its path)."""

    def view(path, leaf):
      batch_shape, n_in, n_out = _matrix_shape(_axes_for(matrix_axes, path, leaf), path, leaf)
      return _MatrixView(batch_shape, n_in, n_out, _Segments.of(n_out, k, segments))

    return jax.tree_util.tree_map_with_path(view, params)

  def first_columns(view):
    # Each part starts on its first columns, with zero momentum.
    cut = view.cut
    columns = jnp.arange(cut.count)[:, None] * cut.width + jnp.arange(cut.per_segment)
    return jnp.broadcast_to(columns.astype(static_args.index_dtype(view.n_out)), view.slots_shape)

  def unit_scale(view):
    return jnp.ones((*view.batch_shape, view.n_in, min(view.cut.slots, 1)), _SCALE_DTYPE)

  def init_fn(params):
    leaves.check_param_dtypes(params, "taco")
    views = matrix_views(params)
    return ScaleByTacoState(
      count=jnp.zeros([], jnp.int32),
      indices=jax.tree.map(first_columns, views),
      mu=jax.tree.map(lambda view: jnp.zeros(view.slots_shape, _CODE_DTYPE), views),
      scales=jax.tree.map(unit_scale, views),
    )

  def update_leaf(grad, view, index, codes, scale):
    """One parameter: select each row's heavy hitters, step on the largest, store them."""
    batch_shape, n_in, n_out, cut = view.batch_shape, view.n_in, view.n_out, view.cut
    if grad.size == 0:  # No row to select from, and n_out / n_in is undefined.
      return jnp.zeros_like(grad), index, codes, scale
    rows = math.prod(batch_shape) * n_in
    # Rows as (rows, parts, width), the last part zero-padded: where tensor
    # parallelism splits the outputs at part boundaries, every device selects
    # in its own parts and keeps their slots.
    grads = grad.reshape(rows, n_out)
    grads = jnp.pad(grads, ((0, 0), (0, cut.count * cut.width - n_out)))
    grads = grads.reshape(rows, cut.count, cut.width)
    start = (jnp.arange(cut.count, dtype=jnp.int32) * cut.width)[:, None]
    tracked = index.astype(jnp.int32).reshape(rows, cut.count, cut.per_segment) - start
    momentum = _dequantize(codes, scale[..., None]).reshape(tracked.shape)
    # U / (1 - beta) = g + w * momentum on the tracked entries: the same
    # order as |U|. w = beta / (1 - beta) is rounded to bfloat16 so that
    # w * momentum (8 bits times the codes' 4) is exact: wherever XLA
    # recomputes U, with or without a fused multiply-add, it rounds the same.
    decay = jnp.asarray(beta, jnp.float32)
    weight = (decay / (1 - decay)).astype(jnp.bfloat16).astype(jnp.float32)
    selected_index, selected_value = column_select(grads, tracked, weight * momentum, keep=max(cut.per_segment, 1))
    columns = selected_index + start
    # The step: the row's largest |U| is the first slot of its largest part
    # (parts in column order, so ties still go to the lower column).
    first = selected_value[..., 0]
    top_part = jnp.argmax(jnp.abs(first), axis=-1, keepdims=True)
    top_value = jnp.take_along_axis(first, top_part, axis=-1)
    # Its column as a masked sum rather than a slice of the selected columns:
    # XLA turns a top-k whose indices are also sliced into a full sort of the row.
    is_top = (jnp.arange(cut.count) == top_part)[..., None] & (jnp.arange(columns.shape[-1]) == 0)
    top_column = jnp.sum(jnp.where(is_top, columns, 0), axis=(1, 2))[:, None]
    direction = jnp.where(jnp.arange(n_out) == top_column, (n_out / n_in) * jnp.sign(top_value), 0)
    direction = direction.astype(grad.dtype).reshape(grad.shape)
    if cut.slots == 0:
      return direction, index, codes, scale
    # The heavy hitters: U = (1 - beta) * (U / (1 - beta)) at the selected columns.
    new_codes, new_scale = _quantize((1 - decay) * selected_value.reshape(rows, -1))
    return (
      direction,
      columns.astype(index.dtype).reshape(index.shape),
      new_codes.reshape(codes.shape),
      new_scale.reshape(scale.shape),
    )

  def update_fn(updates, state, params=None):
    del params
    per_leaf = leaves.map_steps(update_leaf, updates, matrix_views(updates), state.indices, state.mu, state.scales)
    directions, indices, mu, scales = leaves.unzip(updates, per_leaf, 4)
    return directions, ScaleByTacoState(count=optax.safe_increment(state.count), indices=indices, mu=mu, scales=scales)

  return optax.GradientTransformation(init_fn, sharding.typed_like_inputs(update_fn))


def taco_labels(
  params: optax.Params,
  *,
  matrix_axes: MatrixAxesSpec = MatrixAxes(),
  embedding_names: Sequence[str] = DEFAULT_EMBEDDING_NAMES,
) -> Any:
  """Which parameters :func:`taco` steps with TACO and which with its fallback.

  A parameter is labelled ``"taco"`` when it has an output axis left after
  its :class:`MatrixAxes` (a 2-D kernel, by default) and no name on its path
  contains one of ``embedding_names`` (lowercase substrings; embedding tables
  are lookups, not matrices applied to inputs); otherwise ``"fallback"``.

  Args:
    params: the parameters (or a pytree of arrays or ``jax.ShapeDtypeStruct``
      of their shapes).
    matrix_axes: as in :func:`scale_by_taco`.
    embedding_names: lowercase substrings of ``jax.tree_util.keystr(path)``
      that send a parameter to the fallback; ``()`` to let TACO take
      embedding tables too.

  Returns:
    A pytree like ``params`` with ``"taco"`` or ``"fallback"`` leaves: print
    it, edit it, and pass it to :func:`taco` as ``labels``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_memopt
    >>> params = {"embed": {"embedding": jnp.zeros((50, 8))},
    ...           "dense": {"kernel": jnp.zeros((8, 4)), "bias": jnp.zeros(4)}}
    >>> optax_memopt.taco_labels(params)
    {'dense': {'bias': 'fallback', 'kernel': 'taco'}, 'embed': {'embedding': 'fallback'}}
  """
  names = tuple(name.lower() for name in hyperparameters.check_names("embedding_names", embedding_names))

  def label(path, param):
    location = jax.tree_util.keystr(path).lower()
    if any(name in location for name in names):
      return FALLBACK_LABEL
    if _axes_for(matrix_axes, path, param).matrix_shape(jnp.shape(param)) is None:
      return FALLBACK_LABEL
    return TACO_LABEL

  return jax.tree_util.tree_map_with_path(label, params)


def _checked_labels(labels: Any) -> Any:
  for path, label in jax.tree_util.tree_leaves_with_path(labels):
    if not (isinstance(label, str) and label in (TACO_LABEL, FALLBACK_LABEL)):
      raise ValueError(
        f"labels must be {TACO_LABEL!r} or {FALLBACK_LABEL!r} for every"
        f" parameter; got {label!r} for {jax.tree_util.keystr(path)}."
      )
  return labels


def taco(
  learning_rate: optax.ScalarOrSchedule,
  k: int = 16,
  beta: jax.typing.ArrayLike = 0.9,
  weight_decay: jax.typing.ArrayLike = 0.0,
  mask: Any | Callable[[optax.Params], Any] | None = None,
  fallback: optax.GradientTransformation | None = None,
  labels: Any | Callable[[optax.Params], Any] | None = None,
  *,
  segments: int | None = None,
  matrix_axes: MatrixAxesSpec = MatrixAxes(),
  embedding_names: Sequence[str] = DEFAULT_EMBEDDING_NAMES,
  implementation: Literal["xla"] | None = None,
  fallback_learning_rate: optax.ScalarOrSchedule | None = None,
) -> optax.GradientTransformation:
  r"""TACO on matrices, a fallback elsewhere, weight decay and learning rates.

  .. math::

    p_t = p_{t-1} - \eta_t \left(d_t + \lambda \, p_{t-1}\right)

  where :math:`d_t` is :func:`scale_by_taco`'s direction on parameters
  labelled ``"taco"`` and ``fallback``'s on those labelled ``"fallback"``,
  and :math:`\eta_t` is ``learning_rate`` on the first group and
  ``fallback_learning_rate`` on the second: ``optax.chain(optax.partition(
  {"taco": scale_by_taco(...), "fallback": fallback}, labels),
  optax.add_decayed_weights(weight_decay, mask), optax.partition({"taco":
  optax.scale_by_learning_rate(learning_rate), "fallback":
  optax.scale_by_learning_rate(fallback_learning_rate)}, labels))``. With
  the default fallback (Adam's direction) the fallback group trains exactly
  as ``optax.adamw(fallback_learning_rate, weight_decay=weight_decay)``.

  TACO's step is a signed, dimension-normalized one, and it wants a larger
  rate than Adam's; by default (``fallback_learning_rate=None``) the
  fallback group trains at TACO's rate too (one
  ``optax.scale_by_learning_rate(learning_rate)`` after both groups), so
  embeddings, norms and biases take Adam's direction at that larger rate.
  Pass Adam's rate, as for ``optax.contrib.muon``'s ``adam_learning_rate``,
  to train them as AdamW would (the convergence benchmark's
  ``taco_fallback_adamw_rate``). No other alias of this library has groups
  that want different rates: MicroAdam, Adam-mini, ternary Adam and the
  low-bit AdamWs apply one Adam-like step to every parameter.

  Args:
    learning_rate: a scalar or schedule. TACO moves one entry per input
      feature by ``lr * n_out / n_in``, so it wants a larger rate than Adam.
    k: heavy hitters per input feature, ``>= 0`` (0: stateless TACO); static
      under ``optax.inject_hyperparams``.
    beta: heavy-hitter momentum decay in ``[0, 1)``.
    weight_decay: decoupled weight-decay rate, for both groups.
    mask: which leaves weight decay applies to (pytree of bools or a
      function of the params); ``None`` decays all.
    fallback: the direction for the ``"fallback"`` group, a transformation
      without learning rate; ``None`` is ``optax.scale_by_adam()``. Chain
      ``optax.scale(c)`` into it to give that group a relative step size.
    labels: ``"taco"``/``"fallback"`` per parameter, a pytree (prefix) of the
      params or a function of them; ``None`` is :func:`taco_labels` with
      ``matrix_axes`` and ``embedding_names``. Pass functions (of
      ``labels`` or ``matrix_axes``) in ``static_args`` of
      ``optax.inject_hyperparams``, which otherwise reads them as schedules.
    segments: parts of each row with their own heavy hitters, dividing ``k``
      (``None``: ``k``, one each; 1 keeps the row's ``k`` largest); static,
      see :func:`scale_by_taco`.
    matrix_axes: how parameters are read as matrices, see :class:`MatrixAxes`.
    embedding_names: path substrings of embeddings sent to the fallback by
      the default labels.
    implementation: ``None`` or ``"xla"``, see :func:`scale_by_taco`.
    fallback_learning_rate: a scalar or schedule for the ``"fallback"``
      group, or ``None`` (default) for ``learning_rate``.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: for ``k < 0``, ``segments`` not dividing ``k``, ``beta``
      outside ``[0, 1)``, labels other than ``"taco"``/``"fallback"``
      (eagerly for a pytree, at ``init`` for a function), a ``"taco"``
      parameter without an output axis or not real floating point, or a
      ``fallback`` that is not a transformation.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_memopt
    >>> params = {"dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}}
    >>> labels = optax_memopt.taco_labels(params)
    >>> labels
    {'dense': {'bias': 'fallback', 'kernel': 'taco'}}
    >>> tx = optax_memopt.taco(1e-2, k=4, weight_decay=0.1, labels=labels)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> optax_memopt.state_nbytes(state) < optax_memopt.state_nbytes(
    ...     optax.adamw(1e-2).init(params))
    True

  References:
    Jiang et al., "TACO: Ternary Absolute-max Column-wise One-sparse Optimizer
    for LLM Fine-Tuning", 2026, https://arxiv.org/abs/2610.02199
  """
  if fallback is None:
    fallback = optax.scale_by_adam()
  elif not isinstance(fallback, optax.GradientTransformation):
    raise ValueError(f"fallback must be an optax.GradientTransformation; got {type(fallback).__name__}.")
  hyperparameters.check_names("embedding_names", embedding_names)
  if labels is None:
    labels = functools.partial(taco_labels, matrix_axes=matrix_axes, embedding_names=embedding_names)
  if callable(labels):
    label_fn = labels

    def labels(params):
      return _checked_labels(label_fn(params))

  else:
    _checked_labels(labels)
  hyperparameters.check_learning_rate(learning_rate)
  hyperparameters.check_non_negative("weight_decay", weight_decay)
  hyperparameters.check_mask("mask", mask)
  if fallback_learning_rate is None:
    scale = optax.scale_by_learning_rate(learning_rate)
  else:
    if not callable(fallback_learning_rate):
      hyperparameters.check_non_negative("fallback_learning_rate", fallback_learning_rate)
    scale = optax.partition(
      {
        TACO_LABEL: optax.scale_by_learning_rate(learning_rate),
        FALLBACK_LABEL: optax.scale_by_learning_rate(fallback_learning_rate),
      },
      labels,
    )
  return optax.chain(
    optax.partition(
      {
        TACO_LABEL: scale_by_taco(
          k,
          beta,
          segments=segments,
          matrix_axes=matrix_axes,
          implementation=implementation,
        ),
        FALLBACK_LABEL: fallback,
      },
      labels,
    ),
    optax.add_decayed_weights(weight_decay, mask),
    scale,
  )
