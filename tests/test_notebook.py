"""notebooks/quickstart.ipynb runs top to bottom, with few steps, so it never rots."""

from __future__ import annotations

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(monkeypatch):
  monkeypatch.setenv("QUICKSTART_STEPS", "15")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
      "the notebook is stored without outputs"
  )
  NotebookClient(notebook, timeout=600, kernel_name="python3").execute(
      cwd=str(NOTEBOOK.parent)
  )
  printed = "".join(
      out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", [])
  )
  assert "microadam: final train loss" in printed
  images = [out for cell in notebook.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
  assert images, "the last cell draws the loss and memory plot"
