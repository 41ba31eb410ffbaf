"""The implementation switch: validation and the per-platform default."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import _backend, dispatch

_MARKERS = {"xla": 7001, "pallas": 7002, "interpret": 7003}


def _path(resolved):
  """A path whose result, a constant in the lowered program, says which implementation it is."""
  return jnp.int32(_MARKERS[resolved])


def _lowered(op, implementation, platform):
  fn = lambda: dispatch.run(op, implementation, _path)
  if platform == "cuda":
    return _backend.lower_for_cuda(fn)
  return jax.jit(fn).trace().lower(lowering_platforms=(platform,)).as_text()


def _constant_returned(text):
  """The one implementation whose marker the lowered program holds."""
  (found,) = [name for name, marker in _MARKERS.items() if f"dense<{marker}>" in text]
  return found


@pytest.mark.parametrize("bad", ["cuda", "Pallas", 1, ""])
def test_unknown_implementation_is_refused_by_name(bad):
  with pytest.raises(ValueError, match=r"implementation must be one of None, 'xla', 'pallas' or 'interpret'"):
    dispatch.run("feedback_step", bad, _path)


@pytest.mark.parametrize("op", sorted(dispatch.FASTER_ON_HOPPER))
@pytest.mark.parametrize("named", ["xla", "pallas", "interpret"])
def test_a_named_implementation_is_honoured_on_any_platform(monkeypatch, op, named):
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: True)
  for platform in ("cpu", "cuda"):
    assert _constant_returned(_lowered(op, named, platform)) == named


def test_none_is_decided_by_the_platform_lowered_for(monkeypatch):
  """Lowered from this CPU process: the CUDA program takes the table's choice, the CPU program XLA."""
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: True)
  on_cuda = {op: _constant_returned(_lowered(op, None, "cuda")) for op in dispatch.FASTER_ON_HOPPER}
  on_cpu = {op: _constant_returned(_lowered(op, None, "cpu")) for op in dispatch.FASTER_ON_HOPPER}
  assert on_cpu == dict.fromkeys(dispatch.FASTER_ON_HOPPER, "xla")
  assert on_cuda == {op: "pallas" if faster else "xla" for op, faster in dispatch.FASTER_ON_HOPPER.items()}


def test_none_takes_xla_for_a_gpu_older_than_hopper(monkeypatch):
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: False)
  assert {op: _constant_returned(_lowered(op, None, "cuda")) for op in dispatch.FASTER_ON_HOPPER} == dict.fromkeys(
    dispatch.FASTER_ON_HOPPER, "xla"
  )


class _FakeGpu:
  def __init__(self, compute_capability):
    self.compute_capability = compute_capability


@pytest.mark.parametrize(
  ("capabilities", "runs"), [(["9.0"], True), (["10.0", "9.0"], True), (["8.0"], False), (["9.0", "8.6"], False)]
)
def test_the_process_cuda_devices_decide_the_generation(monkeypatch, capabilities, runs):
  monkeypatch.setattr(jax, "devices", lambda backend=None: [_FakeGpu(c) for c in capabilities])
  assert dispatch.cuda_target_is_hopper_or_newer() == runs


def test_a_process_without_cuda_devices_targets_hopper():
  """This CPU machine lowering for CUDA, or compiling for an H100 target description."""
  with pytest.raises(RuntimeError):
    jax.devices("cuda")
  assert dispatch.cuda_target_is_hopper_or_newer()


def test_a_kernel_that_cannot_take_the_arguments_raises_when_named_and_is_skipped_by_none(monkeypatch):
  monkeypatch.setattr(dispatch, "cuda_target_is_hopper_or_newer", lambda: True)
  reason = "block_size must be a multiple of 256 for the Pallas kernel; got 100."
  for named in ("pallas", "interpret"):
    with pytest.raises(ValueError, match="multiple of 256"):
      dispatch.run("feedback_step", named, _path, unsupported=reason)
  assert (
    _constant_returned(_backend.lower_for_cuda(lambda: dispatch.run("feedback_step", None, _path, unsupported=reason)))
    == "xla"
  )
  assert (
    _constant_returned(_backend.lower_for_cuda(lambda: dispatch.run("feedback_step", "xla", _path, unsupported=reason)))
    == "xla"
  )
