"""Results of training runs as JSON, markdown tables and loss-curve plots."""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

import jax
import numpy as np
import optax

from optax_memopt.state_bytes import state_nbytes
from optax_memopt.training.loop import TrainResult


def smoothed(losses: Sequence[float], window: int = 20) -> np.ndarray:
  losses = np.asarray(losses, dtype=np.float64)
  window = max(1, min(window, len(losses)))
  kernel = np.ones(window) / window
  return np.convolve(losses, kernel, mode="valid")


def final_train_loss(result: TrainResult, window: int = 20) -> float:
  """Mean of the last ``window`` steps: one batch's loss is too noisy to compare."""
  return float(np.mean(result.train_losses[-window:]))


def summary(name: str, result: TrainResult) -> dict:
  """The figures of one run, with what ``optax.adamw`` would keep for the same parameters."""
  adamw_state_bytes = state_nbytes(jax.eval_shape(optax.adamw(1e-3).init, result.params))
  return {
      "optimizer": name,
      "final_train_loss": final_train_loss(result),
      "validation_loss": result.validation_loss,
      "state_bytes": result.state_bytes,
      "state_bytes_per_param": result.state_bytes / result.n_params,
      "adamw_state_bytes": adamw_state_bytes,
      "adamw_state_bytes_per_param": adamw_state_bytes / result.n_params,
      "n_params": result.n_params,
      "ms_per_step": 1e3 * result.seconds_per_step,
      "train_losses": list(result.train_losses),
  }


def markdown_table(rows: Sequence[dict], baseline: str | None = "adamw") -> str:
  base = next((r for r in rows if r["optimizer"] == baseline), None)
  lines = [
      "| optimizer | train loss | validation loss | gap to AdamW | state bytes/param | ms/step |",
      "|---|---|---|---|---|---|",
  ]
  for r in rows:
    gap = f"{r['validation_loss'] - base['validation_loss']:+.3f}" if base else "n/a"
    lines.append(
        f"| {r['optimizer']} | {r['final_train_loss']:.3f} | {r['validation_loss']:.3f}"
        f" | {gap} | {r['state_bytes_per_param']:.3f} | {r['ms_per_step']:.1f} |"
    )
  return "\n".join(lines)


def write_json(path: pathlib.Path, payload) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1))


def plot_losses(path: pathlib.Path, rows: Sequence[dict], title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.2))
  for r in rows:
    curve = smoothed(r["train_losses"])
    ax.plot(np.arange(len(curve)) + len(r["train_losses"]) - len(curve), curve,
            label=f"{r['optimizer']} ({r['state_bytes_per_param']:.2f} B/param)")
  ax.set_xlabel("step")
  ax.set_ylabel("train loss (nats per byte, smoothed)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
