"""notebooks/quickstart.ipynb runs top to bottom, with few steps, so it never rots."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from tests import host_devices

NOTEBOOK = host_devices.REPOSITORY / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(monkeypatch):
  monkeypatch.setenv("QUICKSTART_STEPS", "15")
  # The kernel starts in notebooks/: it imports this checkout, not an installed copy.
  monkeypatch.setenv("PYTHONPATH", host_devices.environment(1)["PYTHONPATH"])
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
    "the notebook is stored without outputs"
  )
  NotebookClient(notebook, timeout=600, kernel_name="python3").execute(cwd=str(NOTEBOOK.parent))
  printed = "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))
  assert "microadam: final train loss" in printed
  images = [out for cell in notebook.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
  assert images, "the last cell draws the loss and memory plot"
