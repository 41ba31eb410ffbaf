"""Results of training runs as JSON, markdown tables and loss-curve plots."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Sequence

import jax
import numpy as np
import optax

from memopt_tools.training.loop import TrainResult
from optax_memopt.state_bytes import state_nbytes


def smoothed(losses: Sequence[float], window: int = 20) -> np.ndarray:
  losses = np.asarray(losses, dtype=np.float64)
  window = max(1, min(window, len(losses)))
  kernel = np.ones(window) / window
  return np.convolve(losses, kernel, mode="valid")


def final_train_loss(result: TrainResult, window: int = 20) -> float:
  """Mean of the last ``window`` steps: one batch's loss is too noisy to compare."""
  return float(np.mean(result.train_losses[-window:]))


def summary(name: str, result: TrainResult, *, diverged_at_step: int | None = None) -> dict:
  """The figures of one run, with what ``optax.adamw`` would keep for the same parameters.

  For a run that diverged (``diverged_at_step``, the first step with a
  non-finite loss) the losses are the finite ones before it and the final
  train and validation losses are None.
  """
  adamw_state_bytes = state_nbytes(jax.eval_shape(optax.adamw(1e-3).init, result.params))
  diverged = diverged_at_step is not None
  return {
    "optimizer": name,
    "final_train_loss": None if diverged else final_train_loss(result),
    "validation_loss": None if diverged else result.validation_loss,
    "diverged_at_step": diverged_at_step,
    "state_bytes": result.state_bytes,
    "state_bytes_per_param": result.state_bytes / result.n_params,
    "adamw_state_bytes": adamw_state_bytes,
    "adamw_state_bytes_per_param": adamw_state_bytes / result.n_params,
    "n_params": result.n_params,
    "ms_per_step": 1e3 * result.seconds_per_step if math.isfinite(result.seconds_per_step) else None,
    "train_losses": list(result.train_losses),
  }


def markdown_table(rows: Sequence[dict], baseline: str | None = "adamw") -> str:
  """One line per run: losses, the validation gap to ``baseline`` and state bytes per parameter."""
  base = next((r for r in rows if r["optimizer"] == baseline and r["validation_loss"] is not None), None)
  lines = [
    "| optimizer | train loss | validation loss | gap to AdamW | state bytes/param | AdamW's state / this | ms/step |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    if r["validation_loss"] is None:
      losses = f"diverged at step {r['diverged_at_step']} | n/a | n/a"
    else:
      gap = f"{r['validation_loss'] - base['validation_loss']:+.3f}" if base else "n/a"
      losses = f"{r['final_train_loss']:.3f} | {r['validation_loss']:.3f} | {gap}"
    lines.append(
      f"| {r['optimizer']} | {losses} | {r['state_bytes_per_param']:.3f}"
      f" | {r['adamw_state_bytes'] / r['state_bytes']:.1f}x | {milliseconds(r['ms_per_step'])} |"
    )
  return "\n".join(lines)


def milliseconds(ms_per_step: float | None) -> str:
  """``ms_per_step`` for a table, "n/a" where no step was timed."""
  return "n/a" if ms_per_step is None else f"{ms_per_step:.1f}"


def write_json(path: pathlib.Path, payload) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1, allow_nan=False))


BASELINE = "adamw"


def plot_losses(path: pathlib.Path, rows: Sequence[dict], title: str, *, steps_per_point: int = 1) -> None:
  """Loss curves (whole run, and the second half zoomed) beside state bytes per parameter.

  The three panels answer "how close to AdamW, for how much memory": the
  zoomed panel spans only the losses of the second half of training, where
  the optimizers differ; AdamW is drawn on top, black and dashed, so curves
  that coincide with it stay visible; the bars show each optimizer's state
  bytes per parameter next to AdamW's (computed for the same parameters
  when AdamW was not trained). Each point of a row's ``train_losses`` stands
  for ``steps_per_point`` steps (runs that keep the mean of every 10 steps).
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, (whole, zoom, bars) = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1, 1, 0.8]})
  # tab10 for up to ten curves besides AdamW's, tab20 (pairs of shades) for more.
  colors = iter(plt.get_cmap("tab10" if len(rows) <= 11 else "tab20").colors)
  styles = {
    r["optimizer"]: {"color": "black", "linestyle": "--", "linewidth": 2.0, "zorder": 10}
    if r["optimizer"] == BASELINE
    else {"color": next(colors), "linewidth": 1.4}
    for r in rows
  }
  # A window of a fortieth of the run, at most 50 steps: smooth on long runs, raw on short ones.
  window = min(50, max(1, max(len(r["train_losses"]) for r in rows) // 40))
  half = []
  for r in rows:
    if not r["train_losses"]:
      continue
    curve = smoothed(r["train_losses"], window=window)
    steps = (np.arange(len(curve)) + len(r["train_losses"]) - len(curve) + 1) * steps_per_point
    label = (
      r["optimizer"]
      if r["diverged_at_step"] is None
      else (f"{r['optimizer']} (diverged at step {r['diverged_at_step']})")
    )
    for ax in (whole, zoom):
      ax.plot(steps, curve, label=label, **styles[r["optimizer"]])
    if r["diverged_at_step"] is None:
      half.append(curve[steps > len(r["train_losses"]) * steps_per_point // 2])
  half = np.concatenate(half) if half else np.zeros(0)
  if half.size:
    low, high = half.min(), half.max()
    pad = max(0.08 * (high - low), 1e-3)
    zoom.set_ylim(low - pad, high + pad)
    zoom.set_xlim(max(len(r["train_losses"]) for r in rows) * steps_per_point // 2, None)
  whole.set_title("train loss")
  zoom.set_title("second half, zoomed")
  for ax in (whole, zoom):
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  whole.set_ylabel("nats per byte" + (f", mean of {window} steps" if window > 1 else ""))
  whole.legend(fontsize=8)

  bar_rows = list(rows)
  if not any(r["optimizer"] == BASELINE for r in rows):
    reference = rows[0]
    bar_rows.append(
      {
        "optimizer": BASELINE,
        "state_bytes_per_param": reference["adamw_state_bytes_per_param"],
        "state_bytes": reference["adamw_state_bytes"],
        "adamw_state_bytes": reference["adamw_state_bytes"],
      }
    )
  names = [r["optimizer"] if r["optimizer"] in styles else f"{r['optimizer']} (not trained)" for r in bar_rows]
  values = [r["state_bytes_per_param"] for r in bar_rows]
  y = np.arange(len(bar_rows))[::-1]
  bars.barh(
    y, values, color=[styles[r["optimizer"]]["color"] if r["optimizer"] in styles else "black" for r in bar_rows]
  )
  for yi, r in zip(y, bar_rows):
    ratio = r["adamw_state_bytes"] / r["state_bytes"]
    note = "" if r["optimizer"] == BASELINE else f"  ({ratio:.1f}x less)"
    bars.text(r["state_bytes_per_param"], yi, f" {r['state_bytes_per_param']:.2f}{note}", va="center", fontsize=8)
  bars.set_yticks(y, names)
  bars.set_xlim(0, max(values) * 1.45)
  bars.set_xlabel("optimizer-state bytes per parameter")
  bars.set_title("memory")
  bars.grid(alpha=0.3, axis="x")

  fig.suptitle(title)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
