"""The README's examples run as written, and CI runs the README's test command."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_examples_run_in_order_on_eight_devices(tmp_path):
  blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
  assert len(blocks) >= 8
  # One process runs every block in order, as a reader would paste them; the
  # sharding example needs the 8 virtual devices set before JAX starts.
  script = "\n".join(
      f"print('--- README python block {i}', flush=True)\n{block}" for i, block in enumerate(blocks)
  )
  path = tmp_path / "readme_examples.py"
  path.write_text(script)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert done.stdout.count("--- README python block") == len(blocks)


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
  test_command = next(c for c in commands if "pytest" in c).strip()
  install, run = (part.strip() for part in test_command.split("&&"))
  ci = (ROOT / ".ci" / "run").read_text()
  assert re.search(rf"^pip install( -q)? {re.escape(install.removeprefix('pip install '))}$", ci, flags=re.M)
  assert re.search(rf"^{re.escape(run)}$", ci, flags=re.M)
