"""Adam-mini's blocks: which parameters share a second moment.

Adam-mini (Zhang et al., ICLR 2025, https://arxiv.org/abs/2406.16793) keeps
one second moment per *block* of a parameter: an attention head, an output
neuron, a token's embedding row, a whole norm scale. Which block each
parameter gets is data: a :class:`BlockRule` per leaf, chosen by a sequence of
rule functions ``(path, leaf) -> rule or None`` and shown by
:func:`adam_mini_partition` as a table before training. Two ready rule sets:

* ``"flax"``: Flax layouts (``Dense`` kernels ``(in, out)``, ``DenseGeneral``
  attention kernels ``(in, heads, head_dim)`` and ``(heads, head_dim, out)``,
  ``Embed`` tables ``(vocab, features)``), matched on module and leaf names;
* ``"torch"``: the reference ``adam-mini==1.1.1`` rules for PyTorch names and
  ``(out, in)`` weights, matched by lowercase substring as the reference does.

Layers stacked by ``nn.scan`` / ``nnx.scan`` / ``nnx.vmap`` carry a leading
layer axis: name the stacked modules in ``stacked_modules`` and the rules see
one layer's shape while every layer keeps its own blocks.

The reference's weight-decay rule (no decay on norms and biases) is
:func:`adam_mini_decay_mask`. The optimizer is in ``optax_memopt.adam_mini``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp

from optax_memopt import hyperparameters
from optax_memopt.leaves import path_name

# The reference's name fragments (adam-mini 1.1.1), matched by substring in the
# lowercased parameter name, first rule that matches wins.
_TORCH_ELEMENT_NAMES = ("bias",)
_TORCH_QUERY_NAMES = ("q_proj", "wq", "query")
_TORCH_KEY_NAMES = ("k_proj", "wk", "key")
_TORCH_TOKEN_NAMES = ("embed", "embd", "wte", "lm_head", "output", "final_layer")
_TORCH_NEURON_NAMES = (
  "v_proj",
  "wv",
  "value",
  "o_proj",
  "wo",
  "attn.proj",
  "feed_forward",
  "linear",
  "mlp",
)
# Module names of Flax attention projections, matched exactly.
_FLAX_QUERY_MODULES = frozenset({"q", "query", "q_proj", "wq"})
_FLAX_KEY_MODULES = frozenset({"k", "key", "k_proj", "wk"})
_FLAX_VALUE_MODULES = frozenset({"v", "value", "v_proj", "wv"})
# The reference's weight-decay rule: no decay where the lowercased name holds
# any of these.
_NO_DECAY_NAMES = ("norm", "ln", "bias")


@dataclasses.dataclass(frozen=True)
class BlockRule:
  """How one parameter is cut into blocks that share a second moment.

  A block is a set of elements that differ only along the reduced axes. Axes
  in ``keep`` are not reduced (one block per index); the axis in ``split`` is
  cut into that many equal contiguous groups; every other axis is reduced.
  ``keep=None`` makes every element its own block (plain Adam).

  Attributes:
    name: what the table shows, e.g. ``"per head"``.
    keep: axes with one block per index, or ``None`` for one block per element.
    split: ``(axis, groups)``: that axis is cut into ``groups`` equal parts,
      e.g. ``(-1, n_heads)`` for a fused ``(in, heads * head_dim)`` kernel.

  Examples:
    >>> from optax_memopt.adam_mini_blocks import BlockRule
    >>> BlockRule("per head", split=(-1, 4)).block_shape((32, 64), "q/kernel")
    (1, 4)
    >>> BlockRule("per output neuron", keep=(-1,)).block_shape((32, 64), "w")
    (1, 64)
  """

  name: str
  keep: tuple[int, ...] | None = ()
  split: tuple[int, int] | None = None

  def block_shape(self, shape: Sequence[int], path: str) -> tuple[int, ...]:
    """The keep-dims shape of ``v`` for a parameter of ``shape``.

    Args:
      shape: the parameter's shape (one layer's, for stacked layers).
      path: the parameter's path, named in errors.

    Returns:
      A tuple of the parameter's rank whose entries divide ``shape``: 1 for
      reduced axes, the axis size for kept axes, ``groups`` for a split axis.
    """
    shape = tuple(shape)
    if self.keep is None:
      return shape
    ndim = len(shape)
    blocks = [1] * ndim
    axes = list(self.keep) + ([self.split[0]] if self.split else [])
    for axis in axes:
      if not -ndim <= axis < ndim:
        raise ValueError(
          f"Adam-mini rule {self.name!r} uses axis {axis}, but parameter"
          f" {path!r} has shape {shape}; give it another rule through"
          " `rules=`."
        )
    for axis in self.keep:
      blocks[axis] = shape[axis]
    if self.split is not None:
      axis, groups = self.split
      if groups < 1 or shape[axis] % groups:
        raise ValueError(
          f"Adam-mini rule {self.name!r} cuts axis {axis} of parameter"
          f" {path!r} (shape {shape}) into {groups} groups, which does not"
          f" divide {shape[axis]}. Check n_heads / n_kv_heads (grouped-query"
          " attention needs n_kv_heads) or give it another rule through"
          " `rules=`."
        )
      blocks[axis] = groups
    return tuple(blocks)


PER_ELEMENT = BlockRule("per element", keep=None)
WHOLE_TENSOR = BlockRule("whole tensor")
# Flax layout: a kernel's output features are its last axis.
PER_OUTPUT_NEURON = BlockRule("per output neuron", keep=(-1,))
# Embedding tables (and PyTorch (out, in) weights) keep their first axis.
PER_TOKEN = BlockRule("per token", keep=(0,))

# Names a rule function may return instead of a BlockRule.
RULE_NAMES: dict[str, BlockRule] = {
  "element": PER_ELEMENT,
  "tensor": WHOLE_TENSOR,
  "neuron": PER_OUTPUT_NEURON,
  "token": PER_TOKEN,
}

RuleFn = Callable[[str, jax.ShapeDtypeStruct], Union[BlockRule, str, None]]
Rules = Union[str, RuleFn, Sequence[Union[str, RuleFn]]]


def _head_split(path, shape, axis, groups, which):
  if groups is None:
    raise ValueError(
      f"Adam-mini: parameter {path!r} (shape {tuple(shape)}) is a fused-head"
      f" {which} projection; pass n_heads= (and n_kv_heads= for"
      " grouped-query attention) or give it a rule through `rules=`."
    )
  return BlockRule("per head", split=(axis, groups))


def flax_rules(n_heads: int | None = None, n_kv_heads: int | None = None) -> RuleFn:
  """Adam-mini blocks for Flax (linen and nnx) parameter trees.

  Matched on the leaf name (last path component) and the module holding it:

  * ``bias``: per element (plain Adam);
  * other 0-d and 1-d leaves (norm ``scale``): the whole tensor;
  * ``embedding`` ``(vocab, features)``: per token (reduce the last axis);
  * query/key ``kernel``: per head. ``(in, heads, head_dim)`` reduces axes
    (0, 2); a fused ``(in, heads * head_dim)`` is cut into ``n_heads``
    (query) or ``n_kv_heads`` (key) groups;
  * value ``kernel`` ``(in, heads, head_dim)``: per output neuron (reduce
    axis 0);
  * any other ``kernel`` (``Dense`` ``(in, out)``, attention out
    ``(heads, head_dim, out)``, convolutions): per output neuron (reduce
    every axis but the last);
  * anything else: the whole tensor.

  Query modules are named ``q``, ``query``, ``q_proj`` or ``wq``; key modules
  ``k``, ``key``, ``k_proj`` or ``wk``; value modules ``v``, ``value``,
  ``v_proj`` or ``wv``.

  Args:
    n_heads: query heads, needed only for fused 2-D query/key kernels.
    n_kv_heads: key/value heads (grouped-query attention); defaults to
      ``n_heads``.

  Returns:
    A rule function ``(path, leaf) -> BlockRule``; it matches every leaf.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from optax_memopt.adam_mini_blocks import flax_rules
    >>> rule = flax_rules(n_heads=4, n_kv_heads=2)
    >>> rule("layers_0/attention/key/kernel", jax.ShapeDtypeStruct((32, 16), jnp.float32))
    BlockRule(name='per head', keep=(), split=(-1, 2))
  """
  _check_head_counts(n_heads, n_kv_heads)
  kv_heads = n_kv_heads or n_heads

  def rule(path: str, leaf: jax.ShapeDtypeStruct) -> BlockRule:
    names = path.lower().split("/")
    leaf_name, module = names[-1], (names[-2] if len(names) > 1 else "")
    ndim = len(leaf.shape)
    if leaf_name == "bias":
      return PER_ELEMENT
    if ndim <= 1:
      return WHOLE_TENSOR
    if leaf_name == "embedding":
      return PER_TOKEN
    if leaf_name != "kernel":
      return WHOLE_TENSOR
    is_query, is_key = module in _FLAX_QUERY_MODULES, module in _FLAX_KEY_MODULES
    if is_query or is_key:
      heads = n_heads if is_query else kv_heads
      if ndim == 2:
        return _head_split(path, leaf.shape, -1, heads, "query" if is_query else "key")
      if heads is not None and leaf.shape[-2] != heads:
        raise ValueError(
          f"Adam-mini: parameter {path!r} has shape {tuple(leaf.shape)}, not"
          f" (in, heads={heads}, head_dim). If its module is stacked by"
          " scan, name it in stacked_modules=; otherwise give it a rule"
          " through `rules=`."
        )
      return BlockRule("per head", keep=(-2,))
    if module in _FLAX_VALUE_MODULES and ndim == 3:
      return BlockRule("per output neuron", keep=(-2, -1))
    return PER_OUTPUT_NEURON

  return rule


def torch_rules(n_heads: int | None = None, n_kv_heads: int | None = None) -> RuleFn:
  """The reference ``adam-mini==1.1.1`` blocks for PyTorch names and layouts.

  Paths are lowercased, ``/`` read as ``.``, and matched by substring; the
  first match wins, as in the reference:

  =====  ==============================================  =====================
  order  name contains any of                            block
  =====  ==============================================  =====================
  1      ``bias``                                        per element
  2      ``q_proj wq query`` / ``k_proj wk key``         per head: rows cut
                                                         into ``n_heads`` /
                                                         ``n_kv_heads`` groups
  3      ``embed embd wte lm_head output final_layer``   per token (row)
  3      ``v_proj wv value o_proj wo attn.proj``         per output neuron
         ``feed_forward linear mlp``                     (row)
  4      anything else                                   whole tensor
  =====  ==============================================  =====================

  Weights are ``(out_features, in_features)``; a row is an output neuron. For
  Llama-style models (``head_dim = dim / n_heads``) the head groups equal the
  reference's ``dim * dim / n_heads`` chunks, so the updates are the
  reference's. Where the reference crashes this gives a block instead: 0-d
  and 1-d leaves under rules 2 and 3 get the whole tensor, convolution
  weights ``(out, in, *kernel)`` one block per output channel; a name holding
  both query and key (fused ``query_key_value``) is cut into
  ``n_heads + 2 * n_kv_heads`` groups; head counts that do not divide the rows
  raise a ``ValueError`` naming the parameter.

  Args:
    n_heads: query heads; needed when a query/key weight is present.
    n_kv_heads: key/value heads (grouped-query attention); defaults to
      ``n_heads``. The reference accepts and ignores it.

  Returns:
    A rule function ``(path, leaf) -> BlockRule``; it matches every leaf.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from optax_memopt.adam_mini_blocks import torch_rules
    >>> rule = torch_rules(n_heads=4, n_kv_heads=2)
    >>> rule("model.layers.0.self_attn.k_proj.weight",
    ...      jax.ShapeDtypeStruct((16, 32), jnp.float32))
    BlockRule(name='per head', keep=(), split=(0, 2))
  """
  _check_head_counts(n_heads, n_kv_heads)
  kv_heads = n_kv_heads or n_heads

  def rule(path: str, leaf: jax.ShapeDtypeStruct) -> BlockRule:
    name = path.lower().replace("/", ".")
    ndim = len(leaf.shape)
    if any(part in name for part in _TORCH_ELEMENT_NAMES):
      return PER_ELEMENT
    is_query = any(part in name for part in _TORCH_QUERY_NAMES)
    is_key = any(part in name for part in _TORCH_KEY_NAMES)
    if is_query or is_key:
      if ndim <= 1:
        return WHOLE_TENSOR
      if n_heads is None:
        heads = None
      elif is_query and is_key:
        heads = n_heads + 2 * kv_heads
      else:
        heads = n_heads if is_query else kv_heads
      return _head_split(path, leaf.shape, 0, heads, "query" if is_query else "key")
    if any(part in name for part in _TORCH_TOKEN_NAMES):
      return PER_TOKEN if ndim >= 2 else WHOLE_TENSOR
    if any(part in name for part in _TORCH_NEURON_NAMES):
      return BlockRule("per output neuron", keep=(0,)) if ndim >= 2 else WHOLE_TENSOR
    return WHOLE_TENSOR

  return rule


RULE_SETS: dict[str, Callable[..., RuleFn]] = {
  "flax": flax_rules,
  "torch": torch_rules,
}


def _rule_entries(rules: Rules) -> tuple[Union[str, RuleFn], ...]:
  """Checks ``rules`` eagerly: rule-set names and callables only."""
  entries = (rules,) if isinstance(rules, str) or callable(rules) else rules
  if not isinstance(entries, (list, tuple)):
    raise ValueError(
      f"Adam-mini: `rules` must be a rule-set name, a function (path, leaf) -> rule or None, or a sequence of them;"
      f" got {rules!r}."
    )
  entries = tuple(entries)
  if not entries:
    raise ValueError("Adam-mini: `rules` is empty; use e.g. rules='flax'.")
  for entry in entries:
    if isinstance(entry, str):
      if entry not in RULE_SETS:
        raise ValueError(f"Adam-mini: unknown rule set {entry!r} in `rules`; known sets: {sorted(RULE_SETS)}.")
    elif not callable(entry):
      raise ValueError(
        f"Adam-mini: `rules` entries must be rule-set names or functions (path, leaf) -> rule or None; got {entry!r}."
      )
  return entries


def _check_head_counts(n_heads, n_kv_heads):
  for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
    if value is not None:
      hyperparameters.check_int(name, value, 1, hint=" or None")
  if n_kv_heads is not None:
    if n_heads is None:
      raise ValueError("Adam-mini: n_kv_heads needs n_heads.")
    if n_heads % n_kv_heads:
      raise ValueError(f"Adam-mini: n_kv_heads={n_kv_heads} must divide n_heads={n_heads}.")


def _stacked_names(stacked_modules: str | Sequence[str]) -> frozenset[str]:
  names = (stacked_modules,) if isinstance(stacked_modules, str) else stacked_modules
  if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) and name for name in names):
    raise ValueError(
      f"Adam-mini: stacked_modules must be module names (path components), e.g. 'layers'; got {stacked_modules!r}."
    )
  return frozenset(names)


def check_partition_arguments(
  rules: Rules,
  n_heads: int | None,
  n_kv_heads: int | None,
  stacked_modules: str | Sequence[str],
) -> None:
  """Raises ``ValueError`` naming the first bad argument of :func:`adam_mini_partition`.

  Head counts fix the blocks, hence the state's shapes: they must be plain
  Python ints (under ``optax.inject_hyperparams``, listed in ``static_args``).
  """
  _check_head_counts(n_heads, n_kv_heads)
  _rule_entries(rules)
  _stacked_names(stacked_modules)


class PartitionRow(NamedTuple):
  """One parameter of an :class:`AdamMiniPartition`."""

  path: str
  shape: tuple[int, ...]
  rule: str
  blocks: int
  block_shape: tuple[int, ...]  # the shape of this parameter's v


@dataclasses.dataclass(frozen=True)
class AdamMiniPartition:
  """The blocks Adam-mini gives every parameter; ``str()`` is a table.

  Attributes:
    rows: one :class:`PartitionRow` per array leaf, in ``jax.tree`` order.
    treedef: the structure of the parameter tree.
  """

  rows: tuple[PartitionRow, ...]
  treedef: Any

  @property
  def n_params(self) -> int:
    return sum(math.prod(row.shape) for row in self.rows)

  @property
  def n_blocks(self) -> int:
    return sum(row.blocks for row in self.rows)

  def __str__(self) -> str:
    header = ("path", "shape", "rule", "blocks")
    cells = [header] + [(row.path, str(row.shape), row.rule, f"{row.blocks:,}") for row in self.rows]
    widths = [max(len(cell[i]) for cell in cells) for i in range(4)]
    lines = [
      "  ".join(cell[i].rjust(widths[i]) if i == 3 else cell[i].ljust(widths[i]) for i in range(4)).rstrip()
      for cell in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    share = self.n_blocks / max(self.n_params, 1)
    lines.append(
      f"{len(self.rows)} tensors, {self.n_params:,} parameters,"
      f" {self.n_blocks:,} blocks (v holds {share:.3%} of Adam's)"
    )
    return "\n".join(lines)


def adam_mini_partition(
  params: Any,
  rules: Rules = "flax",
  *,
  n_heads: int | None = None,
  n_kv_heads: int | None = None,
  stacked_modules: str | Sequence[str] = (),
) -> AdamMiniPartition:
  """The Adam-mini block of every parameter, printable as a table.

  Each leaf is offered to the entries of ``rules`` in order; the first that
  returns a rule decides. An entry is a rule-set name (``"flax"``,
  ``"torch"``: these match every leaf) or a function
  ``(path, leaf) -> BlockRule | str | None`` where ``path`` is the key path
  joined by ``/`` (e.g. ``layers_0/attention/query/kernel``), ``leaf`` a
  ``jax.ShapeDtypeStruct`` of one layer's shape, a string one of
  ``RULE_NAMES`` (``"element"``, ``"tensor"``, ``"neuron"``, ``"token"``) and
  ``None`` falls through to the next entry.

  Args:
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
    rules: a rule-set name, a rule function, or a sequence of them.
    n_heads: query heads, for fused-head query/key kernels.
    n_kv_heads: key/value heads for grouped-query attention; defaults to
      ``n_heads``.
    stacked_modules: names of modules whose parameters carry a leading layer
      axis (``nn.scan``, ``nnx.scan``, ``nnx.vmap``); a leaf gets one leading
      axis per such name on its path. Those axes are never reduced over.

  Returns:
    An :class:`AdamMiniPartition`.

  Raises:
    ValueError: unknown rule set or rule name, a leaf no entry matched, or a
      rule that does not fit its leaf (the message names the parameter).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_memopt
    >>> params = {"embed": {"embedding": jnp.zeros((100, 16))},
    ...           "query": {"kernel": jnp.zeros((16, 16))},
    ...           "norm": {"scale": jnp.ones(16)}}
    >>> print(optax_memopt.adam_mini_partition(params, n_heads=4))
    path             shape      rule          blocks
    ---------------  ---------  ------------  ------
    embed/embedding  (100, 16)  per token        100
    norm/scale       (16,)      whole tensor       1
    query/kernel     (16, 16)   per head           4
    3 tensors, 1,872 parameters, 105 blocks (v holds 5.609% of Adam's)
  """
  check_partition_arguments(rules, n_heads, n_kv_heads, stacked_modules)
  stacked = _stacked_names(stacked_modules)
  functions = [
    RULE_SETS[entry](n_heads, n_kv_heads) if isinstance(entry, str) else entry for entry in _rule_entries(rules)
  ]
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  rows = []
  for key_path, leaf in leaves:
    path = path_name(key_path)
    shape = tuple(jnp.shape(leaf))
    n_layer_axes = sum(name in stacked for name in path.split("/"))
    if n_layer_axes > len(shape):
      raise ValueError(
        f"Adam-mini: parameter {path!r} of shape {shape} lies under"
        f" {n_layer_axes} stacked module(s) but has fewer axes; check"
        " stacked_modules."
      )
    layer_leaf = jax.ShapeDtypeStruct(shape[n_layer_axes:], jnp.result_type(leaf))
    rule = _first_rule(functions, path, layer_leaf)
    block_shape = shape[:n_layer_axes] + rule.block_shape(layer_leaf.shape, path)
    stacked_blocks = n_layer_axes and rule.keep is not None
    name = rule.name + (", per layer" if stacked_blocks else "")
    rows.append(PartitionRow(path, shape, name, math.prod(block_shape), block_shape))
  return AdamMiniPartition(tuple(rows), treedef)


def _first_rule(functions, path, leaf) -> BlockRule:
  for function in functions:
    rule = function(path, leaf)
    if rule is None:
      continue
    if isinstance(rule, str):
      if rule not in RULE_NAMES:
        raise ValueError(
          f"Adam-mini: unknown rule name {rule!r} for parameter {path!r};"
          f" known names: {sorted(RULE_NAMES)} (or return a BlockRule)."
        )
      return RULE_NAMES[rule]
    if not isinstance(rule, BlockRule):
      raise ValueError(
        f"Adam-mini: a rule function returned {rule!r} for parameter"
        f" {path!r}; expected a BlockRule, a rule name or None."
      )
    return rule
  raise ValueError(
    f"Adam-mini: no entry of `rules` matched parameter {path!r}; end"
    " `rules` with a rule set such as 'flax' or 'torch' to cover the rest."
  )


def adam_mini_decay_mask(params: Any) -> Any:
  """The reference's weight-decay mask: no decay on norms and biases.

  A leaf is decayed unless its lowercased path (see :func:`path_name`) holds
  ``norm``, ``ln`` or ``bias``.

  Args:
    params: the parameter pytree.

  Returns:
    A pytree of bools like ``params``, ``True`` where weight decay applies.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_memopt.adam_mini_blocks import adam_mini_decay_mask
    >>> adam_mini_decay_mask({"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(2)},
    ...                       "ln_f": {"scale": jnp.ones(2)}})
    {'dense': {'bias': False, 'kernel': True}, 'ln_f': {'scale': False}}
  """
  return jax.tree_util.tree_map_with_path(
    lambda key_path, _: not any(part in path_name(key_path).lower() for part in _NO_DECAY_NAMES),
    params,
  )
