"""Parameter trees as users see them: path names, dtype checks at ``init``, per-leaf steps."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import xla_cpu


def _key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def key_names(path: Sequence[Any]) -> tuple[str, ...]:
  """A jax key path as names, without the trailing ``value`` of an ``nnx.Variable``."""
  names = tuple(_key_name(key) for key in path)
  if names and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
    names = names[:-1]
  return names


def path_name(path: Sequence[Any]) -> str:
  """A jax key path as ``a/b/c``, without the ``value`` of an ``nnx.Variable``.

  Examples:
    >>> import jax
    >>> from optax_memopt.leaves import path_name
    >>> (key_path, _), = jax.tree_util.tree_flatten_with_path({"layers": [{"w": 1}]})[0]
    >>> path_name(key_path)
    'layers/0/w'
  """
  return "/".join(key_names(path))


def is_real_floating(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def check_param_dtypes(
  params: Any,
  optimizer: str,
  supported=is_real_floating,
  supported_text: str = "real floating-point parameters (float16, bfloat16, float32, float64)",
) -> None:
  """Raises ``ValueError`` at the first array leaf of ``params`` whose dtype ``supported`` rejects.

  The message names the optimizer, the leaf's path and dtype, what is
  supported, and how to route the leaf elsewhere.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not supported(dtype):
      raise ValueError(
        f"{optimizer} supports {supported_text}; parameter {path_name(path)!r} is {jnp.dtype(dtype).name}."
        " Route it to another optimizer with optax.partition."
      )


def map_steps(step: Callable[..., tuple[Any, ...]], tree: Any, *rest: Any) -> Any:
  """``jax.tree.map(step, tree, *rest)`` for an optimizer's per-parameter step.

  ``step`` returns ``(direction, *state)``; :func:`unzip` makes trees of
  them. Values are those of ``jax.tree.map``; how the leaves are scheduled
  is this helper's business: in a program lowered for the CPU one leaf's step
  after another (``pallas_kernels.xla_cpu.tree_map`` says why and how).
  """
  return xla_cpu.tree_map(step, tree, *rest)


def unzip(like: Any, per_leaf: Any, n: int) -> tuple[Any, ...]:
  """``n`` trees shaped like ``like`` from ``per_leaf``, which holds an ``n``-tuple at each of its leaves.

  The inverse of mapping a function that returns several results over a
  tree (``per_leaf = jax.tree.map(step, like, ...)``). Unlike
  ``jax.tree.transpose`` it takes a tree without leaves (every parameter
  masked) and results that are ``None``.

  Examples:
    >>> from optax_memopt.leaves import unzip
    >>> unzip({"a": 1, "b": 2}, {"a": (1, -1), "b": (2, -2)}, 2)
    ({'a': 1, 'b': 2}, {'a': -1, 'b': -2})
  """
  return tuple(jax.tree.map(lambda _, results: results[i], like, per_leaf) for i in range(n))
