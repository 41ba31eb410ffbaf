"""Old import paths of the tools that moved to ``memopt_tools``: each name read warns and is the new module's."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def forward(old: str, new: str) -> Callable[[str], Any]:
  """A module ``__getattr__`` for ``old``, the old path of the module ``new``.

  Reading a name through ``old`` gives ``new``'s object of that name (a
  submodule where ``new`` is a package) and warns (DeprecationWarning) with
  the path to import instead.
  """

  def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # Module dunders (__path__, __test__, ...) are the shim's own.
      raise AttributeError(f"module {old!r} has no attribute {name!r}")
    module = importlib.import_module(new)
    try:
      value = getattr(module, name)
    except AttributeError:
      try:
        value = importlib.import_module(f"{new}.{name}")
      except ModuleNotFoundError as e:
        if e.name != f"{new}.{name}":
          raise
        raise AttributeError(f"module {old!r} has no attribute {name!r}") from None
    warnings.warn(f"{old} moved to {new}: use {new}.{name}.", DeprecationWarning, stacklevel=2)
    return value

  return __getattr__
