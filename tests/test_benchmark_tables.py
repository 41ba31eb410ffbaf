"""Figures quoted in the documents equal the committed results they come from."""

from __future__ import annotations

import json
import pathlib
import re

from benchmarks import h100_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]
H100_RESULTS = json.loads((ROOT / "benchmarks" / "data" / "h100_compile.json").read_text())


def test_the_h100_compile_tables_are_rendered_from_the_results():
  assert h100_compile.render(H100_RESULTS) in (ROOT / "benchmarks" / "README.md").read_text()


def test_the_readmes_bytes_moved_column_quotes_the_results():
  """"Choosing an optimizer": each row's float32 bytes moved, as a ratio to AdamW's, from the same file."""
  readme = (ROOT / "README.md").read_text()
  table = readme.split("## Choosing an optimizer")[1].split("\n\n")[1].splitlines()
  header = [cell.strip() for cell in table[0].strip("|").split("|")]
  column = header.index("bytes one step moves on an H100, vs AdamW's")
  rows = H100_RESULTS["rows"]["float32"]
  adamw = rows["adamw"]["default"]["moved"]
  quoted = {}
  for line in table[2:]:
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    name = re.match(r"`(?:optax\.)?(\w+)`", cells[0]).group(1)
    quoted[name] = cells[column]
  assert quoted == {name: f"{rows[name]['default']['moved'] / adamw:.2f}x" for name in quoted}
  assert len(quoted) >= 8
