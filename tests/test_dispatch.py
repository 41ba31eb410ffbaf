"""The implementation switch: validation and the per-op device default."""

import pytest

from pallas_kernels import dispatch


@pytest.mark.parametrize("bad", ["cuda", "Pallas", 1, ""])
def test_unknown_implementation_is_refused_by_name(bad):
  with pytest.raises(ValueError, match=r"implementation must be one of None, 'xla', 'pallas' or 'interpret'"):
    dispatch.resolve("quantize", bad)


@pytest.mark.parametrize("op", sorted(dispatch.FASTER_ON_HOPPER))
@pytest.mark.parametrize("named", ["xla", "pallas", "interpret"])
def test_a_named_implementation_is_honoured_on_any_device(monkeypatch, op, named):
  for on_hopper in (False, True):
    monkeypatch.setattr(dispatch, "default_device_runs_mosaic_gpu", lambda: on_hopper)
    assert dispatch.resolve(op, named) == named


def test_none_takes_xla_off_hopper_and_the_tables_choice_on_it(monkeypatch):
  monkeypatch.setattr(dispatch, "default_device_runs_mosaic_gpu", lambda: False)
  assert {op: dispatch.resolve(op, None) for op in dispatch.FASTER_ON_HOPPER} == dict.fromkeys(
      dispatch.FASTER_ON_HOPPER, "xla"
  )
  monkeypatch.setattr(dispatch, "default_device_runs_mosaic_gpu", lambda: True)
  # From the H200 measurements in benchmarks/README.md.
  assert {op: dispatch.resolve(op, None) for op in dispatch.FASTER_ON_HOPPER} == {
      "block_topk": "xla",
      "quantize": "pallas",
      "ternary": "pallas",
      "microadam_update": "xla",
      "column_select": "pallas",
      "ternary_adam_update": "xla",
      "lowbit_adamw_update": "xla",
  }


def test_the_cpu_is_not_a_mosaic_gpu_device():
  assert not dispatch.default_device_runs_mosaic_gpu()
