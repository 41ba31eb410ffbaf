"""Real text corpora that ship with CPython, as byte tokens.

Nothing is downloaded: ``pydoc_topics`` is CPython's interactive help
(``pydoc_data.topics``, about 0.5 MB of English prose and code) and
``stdlib_source`` is the Python source of a fixed set of standard-library
modules, a different distribution for fine-tuning experiments.
"""

from __future__ import annotations

import pathlib
import sysconfig
from typing import Iterator

import numpy as np

VOCAB_SIZE = 256  # Bytes.

# Fixed so that every machine with the same CPython minor version reads the
# same text; the modules are plain Python and present in every install.
_STDLIB_SOURCE_FILES = (
  "argparse.py",
  "textwrap.py",
  "json/decoder.py",
  "json/encoder.py",
  "collections/__init__.py",
  "functools.py",
  "dataclasses.py",
  "pathlib.py",
  "shutil.py",
  "tempfile.py",
)


def _pydoc_topics() -> str:
  from pydoc_data.topics import topics

  return "\n\n".join(topics[name] for name in sorted(topics))


def _stdlib_source() -> str:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  texts = []
  for relative in _STDLIB_SOURCE_FILES:
    path = root / relative
    if path.is_dir():  # pathlib became a package in Python 3.13.
      path = path / "__init__.py"
    if path.exists():
      texts.append(path.read_text(encoding="utf-8"))
  return "\n\n".join(texts)


CORPORA = {"pydoc_topics": _pydoc_topics, "stdlib_source": _stdlib_source}


def load_corpus(name: str = "pydoc_topics") -> np.ndarray:
  """The corpus ``name`` as a flat uint8 array of UTF-8 bytes."""
  if name not in CORPORA:
    raise ValueError(f"corpus must be one of {sorted(CORPORA)}; got {name!r}.")
  return np.frombuffer(CORPORA[name]().encode("utf-8"), dtype=np.uint8)


def split(tokens: np.ndarray, validation_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
  """Train and held-out parts: the last ``validation_fraction`` of the text."""
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(f"validation_fraction must be in (0, 1); got {validation_fraction}.")
  cut = int(len(tokens) * (1.0 - validation_fraction))
  return tokens[:cut], tokens[cut:]


def random_windows(tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
  """Endless batches of ``seq_len + 1`` consecutive tokens at random offsets."""
  if len(tokens) <= seq_len + 1:
    raise ValueError(f"seq_len={seq_len} needs more than {seq_len + 1} tokens; the text has {len(tokens)}.")
  rng = np.random.default_rng(seed)
  offsets = np.arange(seq_len + 1)
  while True:
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    yield tokens[starts[:, None] + offsets].astype(np.int32)


def evaluation_windows(tokens: np.ndarray, *, batch_size: int, seq_len: int, max_batches: int) -> list[np.ndarray]:
  """Non-overlapping windows from the start of ``tokens``, the same every call."""
  window = seq_len + 1
  count = min(len(tokens) // window, batch_size * max_batches)
  windows = tokens[: count * window].reshape(count, window).astype(np.int32)
  return [windows[i : i + batch_size] for i in range(0, count - batch_size + 1, batch_size)]
