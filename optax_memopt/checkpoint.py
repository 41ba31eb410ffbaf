"""Restoring checkpoints written before a state field was renamed.

A checkpoint stores a state's fields under their names, and restoring it
into a state whose fields were renamed since fails on the structure
(orbax: "Target path ... not found"). Restore such a checkpoint into
:func:`target_with_saved_names` of the new target, then rebuild the new
state with :func:`rename_restored`, both given the code that saved it
(a key of :data:`SAVED_NAMES`):

.. code-block:: python

  target = jax.eval_shape(optimizer.init, params)
  saved_target = checkpoint.target_with_saved_names(target, saved_by="0.1.0")
  saved = ocp.StandardCheckpointer().restore(directory, saved_target)
  opt_state = checkpoint.rename_restored(saved, target, saved_by="0.1.0")

Renamed so far (the saved name -> today's):

* Release 0.1.0, issue 29: ``ScaleByTacoState``: ``index`` -> ``indices``,
  ``scale`` -> ``scales``; ``ScaleByLowbitAdamState``: ``mu`` ->
  ``mu_or_paired`` (in 4-bit it holds both moments' codes).
* Issue 42 (``main`` until commit 92960de): ``ScaleByTacoState``:
  ``momentum`` -> ``mu``; ternary Adam's ``mu`` and ``nu``
  (``TernaryAdamMu``, ``TernaryAdamNu``; were ``TernaryMoment`` and
  ``FactoredSecondMoment``): ``dense`` -> ``per_element``.

A class's name is not saved, only its fields'.
"""

from __future__ import annotations

from typing import Any

import jax

from optax_memopt.lowbit_adamw import ScaleByLowbitAdamState
from optax_memopt.taco import ScaleByTacoState
from optax_memopt.ternary_adam_state import TernaryAdamMu, TernaryAdamNu

# The names that fields renamed since issue 42 were saved under until then.
_BEFORE_ISSUE_42: dict[type, dict[str, str]] = {
  ScaleByTacoState: {"mu": "momentum"},
  TernaryAdamMu: {"per_element": "dense"},
  TernaryAdamNu: {"per_element": "dense"},
}

# Per code that saved a checkpoint, per state class: {today's field name: the
# name the checkpoint saved it under}. "0.1.0": the release (and main until
# issue 29's renames); "main-92960de": main from issue 29's renames to commit
# 92960de, before issue 42's.
SAVED_NAMES: dict[str, dict[type, dict[str, str]]] = {
  "0.1.0": {
    **_BEFORE_ISSUE_42,
    ScaleByTacoState: {"indices": "index", "scales": "scale", **_BEFORE_ISSUE_42[ScaleByTacoState]},
    ScaleByLowbitAdamState: {"mu_or_paired": "mu"},
  },
  "main-92960de": _BEFORE_ISSUE_42,
}


def _names(saved_by: str) -> dict[type, dict[str, str]]:
  if saved_by not in SAVED_NAMES:
    raise ValueError(f"saved_by must be one of {', '.join(map(repr, SAVED_NAMES))}; got {saved_by!r}.")
  return SAVED_NAMES[saved_by]


def target_with_saved_names(target: Any, saved_by: str = "0.1.0") -> Any:
  """``target`` with each renamed state as a dict of its fields under their saved names.

  Args:
    target: the state (or a tree holding it, such as ``{"params": ...,
      "opt_state": ...}``) to restore, typically its ``jax.eval_shape``.
    saved_by: the code that saved the checkpoint, a key of :data:`SAVED_NAMES`.

  Returns:
    A tree to pass to a checkpointer's ``restore`` as its target.
  """
  names = _names(saved_by)

  def saved(node):
    if type(node) not in names:
      return node
    fields = names[type(node)]
    return {fields.get(f, f): target_with_saved_names(getattr(node, f), saved_by) for f in node._fields}

  return jax.tree.map(saved, target, is_leaf=lambda node: type(node) in names)


def rename_restored(restored: Any, target: Any, saved_by: str = "0.1.0") -> Any:
  """The tree restored into :func:`target_with_saved_names` ``(target, saved_by)``, in ``target``'s structure.

  Args:
    restored: what the checkpointer restored.
    target: the same ``target`` as given to :func:`target_with_saved_names`.
    saved_by: the same ``saved_by``.

  Returns:
    ``restored`` with each renamed state rebuilt as its class, fields under today's names.
  """
  names = _names(saved_by)

  def rebuild(node, saved):
    if type(node) not in names:
      return saved
    fields = names[type(node)]
    return type(node)(*(rename_restored(saved[fields.get(f, f)], getattr(node, f), saved_by) for f in node._fields))

  return jax.tree.map(rebuild, target, restored, is_leaf=lambda node: type(node) in names)
