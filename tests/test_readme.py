"""The README's examples run as written, and CI runs the README's test command."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_examples_run_in_order():
  blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
  assert len(blocks) >= 5
  namespace: dict = {}
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    except Exception as e:
      raise AssertionError(f"README python block {i} failed:\n{block}") from e


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
  test_command = next(c for c in commands if "pytest" in c).strip()
  install, run = (part.strip() for part in test_command.split("&&"))
  ci = (ROOT / ".ci" / "run").read_text()
  assert re.search(rf"^pip install( -q)? {re.escape(install.removeprefix('pip install '))}$", ci, flags=re.M)
  assert re.search(rf"^{re.escape(run)}$", ci, flags=re.M)
