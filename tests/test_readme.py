"""The examples of the README and of docs/ run as written, and CI runs the README's test command."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import host_devices
from tests.optimizer_cases import SHARDING_CASES

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCUMENTS = ["README.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(position, code) of each ```python block of a markdown text."""
  return [(match.start(), match.group(1)) for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S)]


def section(text: str, position: int) -> str:
  """The title of the section of ``text`` that holds ``position``."""
  headings = re.findall(r"^#+ (.+)$", text[:position], flags=re.M)
  return headings[-1] if headings else "top"


def examples() -> list[tuple[str, str, str]]:
  """(document, id, code) of every example: the id names the document and the section."""
  found = []
  for document in DOCUMENTS:
    text = (ROOT / document).read_text()
    seen: dict[str, int] = {}
    for position, code in python_blocks(text):
      title = re.sub(r"\W+", "_", section(text, position)).strip("_").lower()
      seen[title] = seen.get(title, 0) + 1
      found.append((document, f"{document}:{title}_{seen[title]}", code))
  return found


EXAMPLES = examples()


def test_the_documents_have_their_examples():
  counts = {document: sum(1 for d, _, _ in EXAMPLES if d == document) for document in DOCUMENTS}
  assert counts["README.md"] >= 3, counts
  for page in ("docs/sharding.md", "docs/checkpoints.md", "docs/memory-planning.md"):
    assert counts[page] >= 1, counts


def _cuda_plugin_missing() -> bool:
  from memopt_tools import gpu_compile

  try:
    gpu_compile.target_devices()
  except gpu_compile.GpuCompilerMissing:
    return os.environ.get("OPTAX_MEMOPT_GPU_COMPILE") != "required"
  return False


@pytest.mark.parametrize("code", [code for _, _, code in EXAMPLES], ids=[name for _, name, _ in EXAMPLES])
def test_python_example_runs_on_its_own(code, tmp_path):
  """Each block, pasted alone into a fresh interpreter, runs.

  Eight CPU devices, as the sharding example asks of readers without
  accelerators; the others do not depend on the device count. An example
  that compiles for an H100 needs the gpu-compile extra, and runs in CI's
  lane that installs it.
  """
  if "gpu_compile" in code and _cuda_plugin_missing():
    pytest.skip("needs JAX's CUDA plugin (the gpu-compile extra)")
  path = tmp_path / "example.py"
  path.write_text(code)
  done = subprocess.run(
    [sys.executable, str(path)],
    cwd=tmp_path,
    env=host_devices.environment(8),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_h100_example_is_selected_by_cis_filter():
  """CI's gpu-compile lane runs `pytest tests/test_readme.py -k h100`: the H100 example's id must match it."""
  assert [name for _, name, code in EXAMPLES if "gpu_compile" in code and "h100" in name.lower()]
  assert "python -m pytest tests/test_readme.py -k h100" in (ROOT / ".ci" / "run").read_text()


def test_readme_lists_every_static_arg_for_inject_hyperparams():
  """Every hyper-parameter an optimizer needs in ``static_args`` (``tests/optimizer_cases.py``) is named."""
  start = README.index("## The optimizers")
  paragraph = README[start : README.index("\n\n", README.index("static_args", start))]
  static_args = {arg for case in SHARDING_CASES.values() for arg in case.static_args}
  assert {arg for arg in static_args if f"`{arg}`" not in paragraph} == set()


def test_ci_prints_each_lanes_time_where_the_docs_say():
  ci = (ROOT / ".ci" / "run").read_text()
  lanes = re.findall(r"^ *lane (\S+)$", ci, flags=re.M)
  # Every lane opens before its virtualenv and closes after it.
  assert len(lanes) == len(re.findall(r"^ *(?:PYENV_VERSION=3.12.1 )?python -m venv ", ci, flags=re.M)) >= 3
  assert len(re.findall(r"^ *deactivate\n *lane_done$", ci, flags=re.M)) == len(lanes)
  development = (ROOT / "docs" / "development.md").read_text()
  assert all(f"`lane {lane}" in development for lane in lanes)
  assert re.search(r"suite took [0-9.]+ minutes", development)


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
  test_command = next(c for c in commands if "pytest" in c).strip()
  install, run = (part.strip() for part in test_command.split("&&"))
  ci = (ROOT / ".ci" / "run").read_text()
  assert re.search(rf"^pip install( -q)? {re.escape(install.removeprefix('pip install '))}$", ci, flags=re.M)
  assert re.search(rf"^{re.escape(run)}$", ci, flags=re.M)


def test_the_documents_link_to_pages_that_exist():
  for document in DOCUMENTS:
    text = (ROOT / document).read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
      if not target.startswith("http"):
        assert (ROOT / document).parent.joinpath(target).exists(), f"{document} links to {target}"


def test_fit_example_prints_what_its_comment_says(tmp_path):
  """The planner's example names the optimizers that fit and those that do not, as its table does."""
  (code,) = [code for _, _, code in EXAMPLES if "fit.report(" in code]
  fits = re.search(r"^# fits: (.+)$", code, flags=re.M).group(1).split(", ")
  misses = re.search(r"^# \(not (.+?):", code, flags=re.M).group(1).split(", ")
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = [
    [cell.strip() for cell in line.strip("|").split("|")]
    for line in done.stdout.splitlines()
    if line.startswith("| ") and not line.startswith("| optimizer |")
  ]
  verdicts = {cells[0]: cells[-1] for cells in rows}
  assert sorted(fits + misses) == sorted(verdicts), verdicts
  assert {name: verdicts[name] for name in fits + misses} == {
    **{name: "yes" for name in fits},
    **{name: "no" for name in misses},
  }, done.stdout
