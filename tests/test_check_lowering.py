"""Every Pallas kernel lowers for CUDA on this CPU-only machine, to the backend it declares."""

import pytest

from pallas_kernels import check_lowering

pytestmark = pytest.mark.kernels

EXAMPLES = list(check_lowering.kernel_examples())


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_kernel_lowers_for_cuda(example):
  assert check_lowering.check(example) == "lowered"
