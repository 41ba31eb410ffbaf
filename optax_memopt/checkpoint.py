"""Restoring checkpoints written before a state field was renamed.

A checkpoint stores a state's fields under their names, and restoring it
into a state whose fields were renamed since fails on the structure
(orbax: "Target path ... not found"). Restore such a checkpoint into
:func:`target_with_saved_names` of the new target, then rebuild the new
state with :func:`rename_restored`:

.. code-block:: python

  target = jax.eval_shape(optimizer.init, params)
  saved = ocp.StandardCheckpointer().restore(directory, checkpoint.target_with_saved_names(target))
  opt_state = checkpoint.rename_restored(saved, target)

Renamed so far (release 0.1.0's name -> today's):

* ``ScaleByTacoState``: ``index`` -> ``indices``, ``scale`` -> ``scales``.
* ``ScaleByLowbitAdamState``: ``mu`` -> ``mu_or_paired`` (in 4-bit it holds
  both moments' codes).
"""

from __future__ import annotations

from typing import Any

import jax

from optax_memopt.lowbit_adamw import ScaleByLowbitAdamState
from optax_memopt.taco import ScaleByTacoState

# Per state class: {today's field name: the name checkpoints saved it under}.
SAVED_NAMES: dict[type, dict[str, str]] = {
  ScaleByTacoState: {"indices": "index", "scales": "scale"},
  ScaleByLowbitAdamState: {"mu_or_paired": "mu"},
}


def _renamed(node: Any) -> bool:
  return type(node) in SAVED_NAMES


def target_with_saved_names(target: Any) -> Any:
  """``target`` with each renamed state as a dict of its fields under their saved names.

  Args:
    target: the state (or a tree holding it, such as ``{"params": ...,
      "opt_state": ...}``) to restore, typically its ``jax.eval_shape``.

  Returns:
    A tree to pass to a checkpointer's ``restore`` as its target.
  """

  def saved(node):
    if not _renamed(node):
      return node
    names = SAVED_NAMES[type(node)]
    return {names.get(field, field): target_with_saved_names(getattr(node, field)) for field in node._fields}

  return jax.tree.map(saved, target, is_leaf=_renamed)


def rename_restored(restored: Any, target: Any) -> Any:
  """The tree restored into :func:`target_with_saved_names` ``(target)``, in ``target``'s structure.

  Args:
    restored: what the checkpointer restored.
    target: the same ``target`` as given to :func:`target_with_saved_names`.

  Returns:
    ``restored`` with each renamed state rebuilt as its class, fields under today's names.
  """

  def rebuild(node, saved):
    if not _renamed(node):
      return saved
    names = SAVED_NAMES[type(node)]
    return type(node)(*(rename_restored(saved[names.get(f, f)], getattr(node, f)) for f in node._fields))

  return jax.tree.map(rebuild, target, restored, is_leaf=_renamed)
