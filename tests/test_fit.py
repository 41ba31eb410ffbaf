"""`python -m optax_memopt.fit`: bytes checked against arithmetic, bad input, nothing allocated."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_memopt import fit
from optax_memopt.training import optimizers

# Published parameter counts (Touvron et al. 2023, the Hugging Face checkpoints).
LLAMA2_7B_PARAMS = 6_738_415_616
LLAMA2_13B_PARAMS = 13_015_864_320


def llama_count(vocab, dim, layers, ffn):
  """Untied embedding and head, four attention and three MLP matrices and two norms per layer, a final norm."""
  return 2 * vocab * dim + layers * (4 * dim * dim + 3 * dim * ffn + 2 * dim) + dim


def count(tree):
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def live_bytes():
  return sum(a.nbytes for a in jax.live_arrays())


@pytest.fixture(scope="module")
def llama2_7b():
  return fit.model_params("llama2_7b")


def test_named_llama_configs_have_the_published_shapes(llama2_7b):
  assert llama_count(32000, 4096, 32, 11008) == LLAMA2_7B_PARAMS
  assert llama_count(32000, 5120, 40, 13824) == LLAMA2_13B_PARAMS
  assert count(llama2_7b) == LLAMA2_7B_PARAMS
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) and leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(llama2_7b))
  llama2_13b = fit.model_params("llama2_13b", jnp.bfloat16)
  assert count(llama2_13b) == LLAMA2_13B_PARAMS
  assert {leaf.dtype for leaf in jax.tree.leaves(llama2_13b)} == {jnp.dtype(jnp.bfloat16)}
  assert llama2_13b["layers"][0]["mlp"]["gate"]["kernel"].shape == (5120, 13824)


def test_llama2_7b_bytes_match_arithmetic_and_nothing_is_allocated(llama2_7b):
  n = LLAMA2_7B_PARAMS
  before = live_bytes()
  result = fit.report(llama2_7b, memory="80GiB", optimizer_names=["adamw", "microadam"])
  sharded = fit.report(llama2_7b, memory="80GiB", devices=8, optimizer_names=["adamw"])
  # The float32 model alone is 27 GB: anything real would show.
  assert live_bytes() - before < 2**20
  adamw = result.row("adamw")
  assert (adamw.param_bytes, adamw.gradient_bytes) == (4 * n, 4 * n)
  assert adamw.state_bytes == 8 * n + 4  # m and v in float32, an int32 step count.
  assert adamw.state_bytes_per_param == pytest.approx(8.0, abs=1e-9)
  assert adamw.total_bytes == 16 * n + 4 and not result.fits("adamw")  # 100 GiB
  assert result.fits("microadam")  # 8 n + 0.9 n bytes: 56 GiB.
  # Every dimension of Llama-2-7B (4096, 11008, 32000) splits over 8 devices.
  row = sharded.row("adamw")
  assert (row.param_bytes, row.gradient_bytes, row.state_bytes) == (4 * n // 8, 4 * n // 8, 8 * n // 8 + 4)
  assert sharded.fits("adamw")


def test_param_dtype_sets_params_gradients_and_adamw_moments():
  params = {"w": jnp.zeros((96, 40)), "b": jnp.zeros((40,))}
  n = 96 * 40 + 40
  row = fit.report(params, param_dtype="bfloat16", optimizer_names=["adamw"]).row("adamw")
  # optax.adamw keeps m and v in the parameters' dtype.
  assert (row.param_bytes, row.gradient_bytes, row.state_bytes) == (2 * n, 2 * n, 4 * n + 4)
  row = fit.report(params, optimizer_names=["adamw"]).row("adamw")
  assert (row.param_bytes, row.state_bytes) == (4 * n, 8 * n + 4)


def test_sharded_bytes_are_one_devices_share(seed):
  rng = np.random.default_rng(seed)
  devices = int(rng.choice([2, 4, 8]))
  shapes = [tuple(int(d) for d in rng.integers(1, 40, size=rng.integers(1, 4))) for _ in range(6)]
  shapes.append((devices * 12, 5))
  params = {f"p{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i, shape in enumerate(shapes)}
  # On a one-axis mesh a leaf is cut over every device when some dimension divides, else replicated.
  per_device = sum(math.prod(s) // devices if any(d % devices == 0 for d in s) else math.prod(s) for s in shapes)
  result = fit.report(params, devices=devices, optimizer_names=["adamw"])
  row = result.row("adamw")
  assert (row.param_bytes, row.gradient_bytes, row.state_bytes) == (
      4 * per_device, 4 * per_device, 8 * per_device + 4), f"seed {seed}, {devices} devices, shapes {shapes}"
  # The whole (unsharded) state over all parameters: two float32 moments and the int32 step count.
  n_params = sum(math.prod(s) for s in shapes)
  assert row.state_bytes_per_param == pytest.approx((8 * n_params + 4) / n_params, rel=1e-12), f"seed {seed}"
  assert result.devices == devices and f"sharded over {devices} devices" in str(result)


def test_fits_is_total_at_most_memory():
  params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
  total = 4 * 4096 * 2 + 8 * 4096 + 4
  assert fit.report(params, memory=total, optimizer_names=["adamw"]).fits("adamw")
  assert not fit.report(params, memory=total - 1, optimizer_names=["adamw"]).fits("adamw")
  table = str(fit.report(params, memory=total - 1, optimizer_names=["adamw"]))
  assert "| adamw |" in table and table.count("| no |") == 1


def test_every_registered_optimizer_is_reported_and_unbuildable_ones_say_why(monkeypatch):
  def refuses(learning_rate, config):
    def init(params):
      raise ValueError("refuses these parameters")
    return optax.GradientTransformation(init, None)

  monkeypatch.setitem(optimizers.OPTIMIZERS, "sgd_momentum",
                      optimizers.OptimizerSpec(lambda lr, config: optax.sgd(lr, momentum=0.9), 1e-2, "SGD"))
  monkeypatch.setitem(optimizers.OPTIMIZERS, "refuses", optimizers.OptimizerSpec(refuses, 1e-2, "refuses"))
  params = {"w": jnp.zeros((32, 48))}
  result = fit.report(params, memory="1MB", n_heads=4, n_kv_heads=2)
  assert [row.optimizer for row in result.rows] == list(optimizers.OPTIMIZERS)
  assert result.row("sgd_momentum").state_bytes == 4 * 32 * 48  # one float32 trace per parameter.
  assert result.row("refuses").error == "refuses these parameters"
  assert "| refuses | cannot be built: refuses these parameters |" in str(result)
  with pytest.raises(ValueError, match="refuses these parameters"):
    result.fits("refuses")


@pytest.mark.parametrize("text, nbytes", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("80 gib", 80 * 2**30), ("1.5TB", 15 * 10**11),
    ("512MiB", 2**29), ("4096", 4096), ("24kb", 24_000), (141 * 10**9, 141 * 10**9),
])
def test_parse_memory(text, nbytes):
  assert fit.parse_memory(text).nbytes == nbytes


@pytest.mark.parametrize("text", ["80 gigs", "GB", "", "-1GB", "0GB", "1e9", 0, "80GBB"])
def test_parse_memory_refuses_what_is_not_a_size(text):
  with pytest.raises(ValueError, match="memory must be"):
    fit.parse_memory(text)


def test_report_refuses_bad_input_naming_it():
  params = {"w": jnp.zeros((4, 4))}
  with pytest.raises(ValueError, match="devices must be an integer >= 1; got 0"):
    fit.report(params, devices=0)
  with pytest.raises(ValueError, match="param_dtype must be a floating-point dtype; got int8"):
    fit.report(params, param_dtype="int8")
  with pytest.raises(ValueError, match="leaf 'layers/0/w' is a str"):
    fit.report({"layers": [{"w": "weights"}]})
  with pytest.raises(ValueError, match="optimizer must be one of"):
    fit.report(params, optimizer_names=["sgd"])
  with pytest.raises(ValueError, match="model must be one of"):
    fit.model_params("gpt5")


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "--model: unknown model 'gpt5'; choose from llama2_7b, llama2_13b"),
    (["--memory", "80 gigs"], "--memory: memory must be a size"),
    (["--devices", "0"], "--devices: must be >= 1; got 0"),
    (["--param-dtype", "int8"], "--param-dtype: must be a floating-point dtype"),
    (["--param-dtype", "floaty"], "--param-dtype: must be a floating-point dtype"),
    (["--optimizers", "adamw", "sgd"], "--optimizers: unknown optimizer 'sgd'"),
])
def test_cli_bad_input_names_the_flag(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    fit.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_cli_prints_a_row_per_optimizer(capsys):
  fit.main(["--model", "tiny", "--memory", "300kB", "--devices", "2", "--optimizers", "adamw", "microadam"])
  out = capsys.readouterr().out
  assert out.startswith("tiny (float32): 25,696 parameters; per device, sharded over 2 devices, 300.00 KB each")
  rows = [line for line in out.splitlines() if line.startswith("| adamw |") or line.startswith("| microadam |")]
  assert len(rows) == 2 and all(row.endswith("| yes |") for row in rows)
