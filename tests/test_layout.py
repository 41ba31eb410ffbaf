"""The library (optax_memopt, pallas_kernels) imports none of its tools (memopt_tools); the tools' old paths forward."""

from __future__ import annotations

import importlib
import json
import pathlib
import pkgutil
import subprocess
import sys
import warnings

import pytest

import optax_memopt

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each old path of a module that moved to the tools, and where it is now.
MOVED = {
  "optax_memopt.__main__": "memopt_tools.main_job",
  "optax_memopt.fit": "memopt_tools.fit",
  "optax_memopt.gpu_compile": "memopt_tools.gpu_compile",
  "optax_memopt.gpu_targets": "memopt_tools.gpu_targets",
  "optax_memopt.train_compile": "memopt_tools.train_compile",
  "optax_memopt.training": "memopt_tools.training",
  "optax_memopt.training.data": "memopt_tools.training.data",
  "optax_memopt.training.loop": "memopt_tools.training.loop",
  "optax_memopt.training.model": "memopt_tools.training.model",
  "optax_memopt.training.optimizers": "memopt_tools.training.optimizers",
  "optax_memopt.training.report": "memopt_tools.training.report",
}


def library_modules() -> list[str]:
  """Every module of the library's packages, but the old paths of the tools."""
  names = []
  for package in ("optax_memopt", "pallas_kernels"):
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
      if not any(name == old or name.startswith(old + ".") for old in MOVED):
        names.append(name)
  return names


# Imports each module in turn and prints, for each, which tools (and Flax) modules had been imported by then.
PROBE = """
import importlib, json, sys
seen = {}
for name in sys.argv[1:]:
  importlib.import_module(name)
  seen[name] = sorted(m for m in sys.modules if m.split(".")[0] in ("memopt_tools", "flax"))
print(json.dumps(seen))
"""


def test_the_library_imports_none_of_the_tools_nor_flax():
  modules = library_modules()
  assert "optax_memopt" in modules and "optax_memopt.microadam" in modules and "pallas_kernels.quantize" in modules
  run = subprocess.run(
    [sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
  )
  seen = json.loads(run.stdout.splitlines()[-1])
  # Modules are imported in turn: the first one with tools or Flax in sys.modules is the one that imports them.
  first = next(((name, imported) for name, imported in seen.items() if imported), None)
  assert first is None, f"{first[0]} imports the tools or Flax: {first[1]}"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_each_old_path_warns_and_gives_the_new_paths_objects(old, new):
  old_module, new_module = importlib.import_module(old), importlib.import_module(new)
  for info in pkgutil.iter_modules(getattr(new_module, "__path__", [])):  # A package's names are its submodules.
    importlib.import_module(f"{new}.{info.name}")
  names = [name for name in vars(new_module) if not name.startswith("_")]
  assert names
  for name in names:
    if getattr(getattr(new_module, name), "__name__", None) == f"{new}.{name}":
      # A submodule has an old path of its own (a shim module, checked as its own case), which is the old
      # package's attribute once anything has imported it, and the new module forwarded before that.
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        forwarded = getattr(old_module, name)
      assert forwarded is getattr(new_module, name) or forwarded.__name__ == f"{old}.{name}"
      continue
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}: use {new}.{name}"):
      assert getattr(old_module, name) is getattr(new_module, name)


def test_old_paths_reach_submodules_and_the_remedy_that_moved_earlier():
  with pytest.warns(DeprecationWarning, match="memopt_tools.training.loop"):
    from optax_memopt.training import loop

    assert loop.train is importlib.import_module("memopt_tools.training.loop").train
  with pytest.warns(DeprecationWarning) as warned:
    from optax_memopt.training.optimizers import vocabulary_in_float32
  assert vocabulary_in_float32 is optax_memopt.vocabulary_in_float32
  messages = " | ".join(str(w.message) for w in warned)
  assert "use optax_memopt.vocabulary.vocabulary_in_float32" in messages and "moved to memopt_tools" in messages
  with pytest.raises(AttributeError, match="optax_memopt.fit"):
    importlib.import_module("optax_memopt.fit").no_such_name


@pytest.mark.parametrize(
  "module, usage",
  [("optax_memopt", "usage: python -m optax_memopt "), ("optax_memopt.fit", "usage: python -m optax_memopt.fit ")],
)
def test_the_documented_commands_run_the_tools_without_a_warning(module, usage):
  run = subprocess.run(
    [sys.executable, "-W", "error::DeprecationWarning:optax_memopt", "-m", module, "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr
  assert run.stdout.startswith(usage) and "moved to" not in run.stderr
