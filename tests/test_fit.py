"""`python -m optax_memopt.fit`: bytes checked against arithmetic, bad input, nothing allocated."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from memopt_tools import fit
from memopt_tools.training import optimizers

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
  assert all(
    isinstance(leaf, jax.ShapeDtypeStruct) and leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(llama2_7b)
  )
  llama2_13b = fit.model_params("llama2_13b", jnp.bfloat16)
  assert count(llama2_13b) == LLAMA2_13B_PARAMS
  assert {leaf.dtype for leaf in jax.tree.leaves(llama2_13b)} == {jnp.dtype(jnp.bfloat16)}
  assert llama2_13b["layers"][0]["mlp"]["gate"]["kernel"].shape == (5120, 13824)


def test_the_cached_abstract_parameters_are_a_new_tree_on_every_call():
  config = fit.MODELS["tiny"]
  first = fit.abstract_transformer_params(config)
  expected = jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), first)
  first["layers"][0]["mlp"] = None  # A caller's edit of its own tree.
  assert jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), fit.abstract_transformer_params(config)) == expected


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


def test_param_dtype_sets_params_and_gradients_and_the_baseline_keeps_float32_moments():
  params = {"w": jnp.zeros((96, 40)), "b": jnp.zeros((40,))}
  n = 96 * 40 + 40
  result = fit.report(params, param_dtype="bfloat16", optimizer_names=["adamw", "adamw_bf16"])
  # The baseline is AdamW's 8 bytes per parameter, whatever the parameters' dtype; bfloat16
  # parameters add stochastic rounding's step count and key (12 bytes).
  row = result.row("adamw")
  assert (row.param_bytes, row.gradient_bytes, row.state_bytes) == (2 * n, 2 * n, 8 * n + 4 + 12)
  assert row.state_dtypes == "float32 (mu, nu)"
  # optax.adamw with mu_dtype=bfloat16 keeps v in the parameters' dtype.
  row = result.row("adamw_bf16")
  assert (row.param_bytes, row.state_bytes, row.state_dtypes) == (2 * n, 4 * n + 4 + 12, "bfloat16 (mu, nu)")
  assert f"| adamw | float32 (mu, nu) | {(8 * n + 16) / n:.3f} |" in str(result)
  assert "updates rounded stochastically (optax_memopt.stochastic_rounding)" in str(result).splitlines()[0]
  assert "rounded stochastically" not in str(fit.report(params, optimizer_names=["adamw"]))
  row = fit.report(params, optimizer_names=["adamw_bf16"]).row("adamw_bf16")
  assert (row.param_bytes, row.state_bytes, row.state_dtypes) == (4 * n, 6 * n + 4, "float32 (nu), bfloat16 (mu)")


# A dense layer in Flax's layout: a (512, 256) kernel and a bias. Over 4
# devices every dimension of it splits (the parameters' rows, FSDP-style).
ROWS, COLUMNS, DEVICES = 512, 256, 4


def dense_layer_state_bytes(name: str, param_bytes: int, devices: int) -> int:
  """One device's state bytes for the dense layer, from each optimizer's documented state.

  ``split(x)`` is a part cut over the devices with its parameter, ``whole(x)``
  one every device holds (step counts, keys, one-entry leaves, and leaves
  with nothing to split: Adam-mini's one row of per-neuron ``v``, MicroAdam's
  three top-k slots of the bias).
  """
  split = lambda nbytes: nbytes // devices
  whole = lambda nbytes: nbytes
  r, c = ROWS, COLUMNS
  kernel, bias = r * c, c
  count = whole(4)
  # Default blocks: 256 (8-bit, fp8) and 128 (4-bit) of the kernel; the bias
  # (under 4096 elements) keeps float32 m and v.
  lowbit_bias = split(8 * bias)
  formulas = {
    # m and v in float32: the baseline.
    "adamw": split(8 * (kernel + bias)) + count,
    # m in bfloat16, v in the parameters' dtype.
    "adamw_bf16": split((2 + param_bytes) * (kernel + bias)) + count,
    # Factored v of the kernel (one per row and one per column, and a
    # one-entry placeholder), full v of the bias (two one-entry
    # placeholders), in the parameters' dtype.
    "adafactor": split(param_bytes * (r + c))
    + whole(param_bytes)
    + split(param_bytes * c)
    + whole(2 * param_bytes)
    + count,
    # A window of 10 top-k slots (int16 index, bfloat16 value), k = 1% of
    # each block of 16384 rounded up: 8 blocks of 164 for the kernel, 3 for
    # the bias; 4-bit error feedback (half a byte per element) with a
    # bfloat16 minimum and maximum per bucket of 1024.
    "microadam": split(10 * 8 * 164 * 4)
    + whole(10 * 3 * 4)
    + split(kernel // 2 + bias // 2)
    + split(2 * 2 * kernel // 1024)
    + whole(2 * 2)
    + count,
    # m like the parameters; v per output neuron of the kernel (one row of
    # 256, float32), per element of the bias.
    "adam_mini": split(param_bytes * (kernel + bias)) + whole(4 * c) + split(4 * bias) + count,
    # Kernel: m as base-3 trits, 5 per byte, in blocks of 128 (26 bytes)
    # with a float32 scale each; v factored in float32: row statistics cut
    # with the rows, column statistics whole on every device that splits the
    # rows (docs/sharding.md). Bias (below min_size): float32 m and v. A
    # two-word key.
    "ternary_adam": split(r * (c // 128) * (26 + 4)) + split(4 * r) + whole(4 * c) + split(8 * bias) + whole(8) + count,
    # Kernel: per input feature (row) 16 parts of one slot, an int16 index
    # and a float8 momentum each, and a bfloat16 scale. Bias: Adam's m and v
    # in the parameters' dtype. Two step counts.
    "taco": split(r * (16 * 3 + 2)) + split(2 * param_bytes * bias) + 2 * count,
    # One part of 16 slots: the same bytes.
    "taco_one_segment": split(r * (16 * 3 + 2)) + split(2 * param_bytes * bias) + 2 * count,
    "adamw_8bit": split(2 * kernel + 2 * 4 * kernel // 256) + lowbit_bias + count,
    # One byte holds both 4-bit codes.
    "adamw_4bit": split(kernel + 2 * 4 * kernel // 128) + lowbit_bias + count,
    "adamw_fp8": split(2 * kernel + 2 * 4 * kernel // 256) + lowbit_bias + count,
    # optax's GaLore, rank 128: the kernel's left projector (512 x 128, cut as
    # the kernel), Adam's m and v in the projection (128 x 256: shaped like no
    # parameter, every device holds them), the bias's m and v, all in the
    # parameters' dtype. Two step counts.
    "galore": split(param_bytes * r * 128)
    + whole(2 * param_bytes * 128 * c)
    + split(2 * param_bytes * bias)
    + 2 * count,
  }
  # bfloat16 parameters: each optimizer is followed by stochastic_rounding, whose step count and key are whole.
  rounding = whole(4 + 8) if param_bytes == 2 else 0
  return formulas[name] + rounding


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("devices", [1, DEVICES])
def test_every_optimizers_state_bytes_follow_its_formula(param_dtype, devices):
  params = {"dense": {"kernel": jnp.zeros((ROWS, COLUMNS)), "bias": jnp.zeros((COLUMNS,))}}
  param_bytes = jnp.dtype(param_dtype).itemsize
  result = fit.report(params, param_dtype=param_dtype, devices=devices)
  assert [row.optimizer for row in result.rows] == list(optimizers.OPTIMIZERS)
  n = ROWS * COLUMNS + COLUMNS
  for row in result.rows:
    assert row.error is None, row
    assert row.param_bytes == row.gradient_bytes == param_bytes * n // devices, row.optimizer
    assert row.state_bytes == dense_layer_state_bytes(row.optimizer, param_bytes, devices), row.optimizer
    whole_state = dense_layer_state_bytes(row.optimizer, param_bytes, 1)
    assert row.state_bytes_per_param == pytest.approx(whole_state / n, rel=1e-12), row.optimizer


def test_headroom_is_memory_less_total_and_negative_when_it_does_not_fit():
  params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
  total = 4 * 4096 * 2 + 8 * 4096 + 4  # parameters, gradients, m and v, step count
  roomy = str(fit.report(params, memory="128KiB", optimizer_names=["adamw"]))
  assert f"| {(128 * 1024 - total) / 1024:.2f} KiB | yes |" in roomy
  tight = str(fit.report(params, memory=total - 1000, optimizer_names=["adamw"]))
  assert "| -1000.00 B | no |" in tight


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
    4 * per_device,
    4 * per_device,
    8 * per_device + 4,
  ), f"seed {seed}, {devices} devices, shapes {shapes}"
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

  monkeypatch.setitem(
    optimizers.OPTIMIZERS,
    "sgd_momentum",
    optimizers.OptimizerSpec(lambda lr, config: optax.sgd(lr, momentum=0.9), 1e-2, "SGD"),
  )
  monkeypatch.setitem(optimizers.OPTIMIZERS, "refuses", optimizers.OptimizerSpec(refuses, 1e-2, "refuses"))
  params = {"w": jnp.zeros((32, 48))}
  result = fit.report(params, memory="1MB", n_heads=4, n_kv_heads=2)
  assert [row.optimizer for row in result.rows] == list(optimizers.OPTIMIZERS)
  assert result.row("sgd_momentum").state_bytes == 4 * 32 * 48  # one float32 trace per parameter.
  assert result.row("refuses").error == "refuses these parameters"
  assert "| refuses | cannot be built: refuses these parameters |" in str(result)
  with pytest.raises(ValueError, match="refuses these parameters"):
    result.fits("refuses")


@pytest.mark.parametrize(
  "text, nbytes",
  [
    ("80GB", 80 * 10**9),
    ("80GiB", 80 * 2**30),
    ("80 gib", 80 * 2**30),
    ("1.5TB", 15 * 10**11),
    ("512MiB", 2**29),
    ("4096B", 4096),
    ("24kb", 24_000),
    (141 * 10**9, 141 * 10**9),
  ],
)
def test_parse_memory(text, nbytes):
  assert fit.parse_memory(text).nbytes == nbytes


@pytest.mark.parametrize("text", ["80 gigs", "GB", "", "-1GB", "0GB", "1e9", 0, "80GBB", "80", "-5GiB"])
def test_parse_memory_refuses_what_is_not_a_size(text):
  with pytest.raises(ValueError, match="memory must be"):
    fit.parse_memory(text)


def test_report_refuses_bad_input_naming_it():
  params = {"w": jnp.zeros((4, 4))}
  with pytest.raises(ValueError, match="devices must be an integer >= 1; got 0"):
    fit.report(params, devices=0)
  with pytest.raises(ValueError, match="param_dtype must be a floating-point dtype, one of .*; got int8"):
    fit.report(params, param_dtype="int8")
  with pytest.raises(ValueError, match="leaf 'layers/0/w' is a str"):
    fit.report({"layers": [{"w": "weights"}]})
  with pytest.raises(ValueError, match="optimizer must be one of"):
    fit.report(params, optimizer_names=["sgd"])
  with pytest.raises(ValueError, match="model must be one of"):
    fit.model_params("gpt5")


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--model", "gpt5"], "--model: unknown model 'gpt5'; choose from llama2_7b, llama2_13b"),
    (["--memory", "80 gigs"], "--memory: memory must be a size"),
    # A plain number is refused, with the units; a negative size is a bad value, not a missing one.
    (["--memory", "80"], "--memory: memory must be a size with its unit, such as 80GB, 80GiB or 512MiB (units B, KB,"),
    (["--memory", "-5GiB"], "--memory: memory must be positive; got '-5GiB'"),
    (["--memory=-5GiB"], "--memory: memory must be positive; got '-5GiB'"),
    (["--devices", "0"], "--devices: must be >= 1; got 0"),
    (["--param-dtype", "int8"], "--param-dtype: param_dtype must be a floating-point dtype"),
    (["--param-dtype", "floaty"], "--param-dtype: param_dtype must be a floating-point dtype"),
    (["--param-dtype", "float128"], "--param-dtype: param_dtype must be a floating-point dtype, one of float32,"),
    (["--optimizers", "adamw", "sgd"], "--optimizers: unknown optimizer 'sgd'"),
  ],
)
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


def table_row(out: str, optimizer: str) -> list[str]:
  """The cells of ``optimizer``'s row in a printed table."""
  (line,) = [line for line in out.splitlines() if line.startswith(f"| {optimizer} |")]
  return [cell.strip() for cell in line.strip("|").split("|")]


# Adam-mini's second moments of the tiny model: per token of the embedding
# (256); per query head (4) and key/value head (2) of the query and key; per
# output neuron of the value (16), output (32), gate and up (64 each), down
# (32) and head (256) kernels; one per norm (3).
TINY_ADAM_MINI_BLOCKS = 256 + 4 + 2 + 16 + 32 + 64 + 64 + 32 + 256 + 3


def test_cli_hands_the_head_counts_to_adam_mini(capsys):
  fit.main(["--model", "tiny", "--optimizers", "adam_mini"])
  cells = table_row(capsys.readouterr().out, "adam_mini")
  assert "cannot be built" not in cells[1], cells
  n = 25_696
  # m like the float32 parameters, float32 v per block, the step count.
  state = 4 * n + 4 * TINY_ADAM_MINI_BLOCKS + 4
  assert cells[1:3] == ["float32 (mu, nu)", f"{state / n:.3f}"], cells
  assert cells[5] == f"{state / 1024:.2f} KiB", cells


def test_cli_builds_adam_mini_for_every_llama_model(capsys):
  for name in ("llama2_7b", "llama2_13b"):
    fit.main(["--model", name, "--param-dtype", "bfloat16", "--optimizers", "adam_mini"])
    cells = table_row(capsys.readouterr().out, "adam_mini")
    assert not cells[1].startswith("cannot be built"), cells
    # m in bfloat16, a small share of float32 v.
    assert cells[1] == "bfloat16 (mu)" and cells[2] == "2.001", cells


def test_help_shows_each_default_once_and_none_as_none(capsys):
  with pytest.raises(SystemExit):
    fit.main(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "(default: None)" not in text
  assert text.count("(default: all)") == 1 and "(default: llama2_7b)" in text
