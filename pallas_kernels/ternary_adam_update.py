"""One fused step of ternary-state Adam for one tensor.

The first moment is stored as blockwise-scaled trits (a
:class:`pallas_kernels.ternary.TernaryArray`); the second moment ``nu`` is a
float32 array with one entry per element. One step reads the gradient ``g``,
the stored trits ``t`` with their block scales ``s`` and ``nu``, and computes

.. math::
  m = \\beta_1\\, t\\, s + (1 - \\beta_1)\\, g, \\qquad
  \\nu' = \\beta_2\\, \\nu + (1 - \\beta_2)\\, g^2, \\qquad
  u = \\frac{m / (1 - \\beta_1^k)}{\\sqrt{\\nu' / (1 - \\beta_2^k)} + \\epsilon},

then stores ``m`` again as trits with stochastic rounding (new absmax scales,
``P(t = \\operatorname{sign} m) = |m| / s``, unbiased), exactly as
``ternary_encode(m, key=key)`` does: the random bits are the same counter
hash of a seed drawn from ``key`` and of the element index. The direction
``u`` uses the unrounded ``m`` of this step; only the stored moment is
rounded. With ``update_nu=False`` the caller passes the second moment of this
step itself (for instance rebuilt from factored row and column statistics,
which need reductions over whole rows and columns) and ``nu`` is not updated
or returned.

The square root is ``x * rsqrt(x)`` (and 0 at ``x = 0``): Mosaic GPU on JAX
0.10 lowers ``rsqrt`` but not ``sqrt``, and the reference uses the same
function so that both implementations agree.

Implementations (``implementation=``):

* ``"xla"``: the reference: the XLA implementations behind
  ``ternary_decode`` and ``ternary_encode`` around the elementwise update.
  ``ternary_encode(m, key=key)`` produces the same trits.
* ``"pallas"``: one Mosaic GPU kernel (``plgpu.kernel``) over chunks of whole
  scale blocks and whole packed rows (the geometry of
  :mod:`pallas_kernels.ternary`). Per chunk it computes the new moment twice
  from the stored trits and the gradient, which is cheaper than holding it:
  a first pass finds the new block absmaxes, a second updates ``nu``, writes
  the direction and packs the new trits. The last partial chunk (and chunks
  that do not fill a grid step) run in XLA and are written in place, so the
  result equals ``"xla"`` bit for bit.
* ``"interpret"``: the same kernel run by the Mosaic GPU interpreter (CPU).
* ``None``: ``"pallas"`` on a Hopper-or-newer GPU, ``"xla"`` elsewhere.

Block sizes and packings are those of :mod:`pallas_kernels.ternary`:
``block_size`` 32, 64 or a multiple of 128, ``packing`` ``"base3"`` or
``"2bit"``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels import packing as planar
from pallas_kernels import ternary

PLANE_WIDTH = planar.PLANE_WIDTH
# Gradient dtypes the kernel reads directly (converted to float32 in registers).
_KERNEL_GRAD_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Order of the scalars in the kernel's hyper-parameter input.
_B1, _B2, _EPS, _BIAS_CORRECTION_1, _BIAS_CORRECTION_2 = range(5)


class TernaryAdamStep(NamedTuple):
  """What one step returns."""

  direction: jax.Array  # The gradient's shape and dtype.
  momentum: ternary.TernaryArray  # The new first moment, rounded stochastically.
  nu: jax.Array | None  # float32, nu's shape; None when update_nu=False.


# Elementwise math shared by the kernel body and the reference.


def _first_moment(previous: jax.Array, grad: jax.Array, b1: jax.Array) -> jax.Array:
  return b1 * previous + (1 - b1) * grad


def _second_moment(previous: jax.Array, grad: jax.Array, b2: jax.Array) -> jax.Array:
  return b2 * previous + (1 - b2) * (grad * grad)


def _direction(
    m: jax.Array, nu: jax.Array, bias_correction_1, bias_correction_2, eps
) -> jax.Array:
  nu_hat = nu / bias_correction_2
  # sqrt as x * rsqrt(x) (Mosaic GPU on JAX 0.10 has no sqrt), 0 where x is;
  # a NaN second moment stays NaN, so a non-finite gradient shows in the step.
  root = jnp.where(nu_hat != 0, nu_hat * lax.rsqrt(nu_hat), 0.0)
  return (m / bias_correction_1) / (root + eps)


def _hyperparameters(count, b1, b2, eps) -> jax.Array:
  """float32 ``[b1, b2, eps, 1 - b1**count, 1 - b2**count]``."""
  b1, b2, eps = (jnp.asarray(x, jnp.float32) for x in (b1, b2, eps))
  count = jnp.asarray(count).astype(jnp.float32)
  return jnp.stack([b1, b2, eps, 1 - b1**count, 1 - b2**count])


# XLA reference.


def _step_reference(
    grad: jax.Array,
    stored: jax.Array,
    scales: jax.Array,
    nu: jax.Array,
    seed: jax.Array,
    hyper: jax.Array,
    *,
    block_size: int,
    layout: Any,
    update_nu: bool,
    index_offset: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """The step on flat arrays; ``index_offset`` is the global index of ``grad[0]``."""
  size = grad.shape[0]
  previous = ternary.decode_reference(
      stored, scales, size=size, block_size=block_size, layout=layout, dtype=jnp.float32
  )
  g = grad.astype(jnp.float32)
  m = _first_moment(previous, g, hyper[_B1])
  new_nu = _second_moment(nu, g, hyper[_B2]) if update_nu else nu
  direction = _direction(
      m, new_nu, hyper[_BIAS_CORRECTION_1], hyper[_BIAS_CORRECTION_2], hyper[_EPS]
  ).astype(grad.dtype)
  new_stored, new_scales = ternary.encode_reference(
      m, block_size=block_size, layout=layout, seed=seed, index_offset=index_offset
  )
  return direction, new_stored, new_scales, new_nu if update_nu else None


# Mosaic GPU kernel.


class _MomentSlices:
  """Reads like a ref holding one chunk's new first moment.

  ``self[pl.ds(offset, PLANE_WIDTH)]`` computes the moment of the slice at
  ``offset`` within the chunk, so ``ternary.chunk_absmax`` finds the new
  block scales without the moment ever being stored.
  """

  def __init__(self, moment_at):
    self._moment_at = moment_at

  def __getitem__(self, index: pl.Slice) -> jax.Array:
    return self._moment_at(index.start)


def _step_kernel(
    *refs,
    geometry: Any,
    layout: Any,
    chunks_per_step: int,
    update_nu: bool,
    interpret: bool,
) -> None:
  """Per chunk: the new block scales (first pass), then per packed row the
  moment, ``nu``, the direction and the new trits (second pass)."""
  if update_nu:
    (grad_ref, stored_ref, scales_ref, nu_ref, seed_ref, hyper_ref,
     direction_ref, new_stored_ref, new_scales_ref, new_nu_ref) = refs
  else:
    (grad_ref, stored_ref, scales_ref, nu_ref, seed_ref, hyper_ref,
     direction_ref, new_stored_ref, new_scales_ref) = refs
  b1, b2, eps = hyper_ref[_B1], hyper_ref[_B2], hyper_ref[_EPS]
  bias_correction_1 = hyper_ref[_BIAS_CORRECTION_1]
  bias_correction_2 = hyper_ref[_BIAS_CORRECTION_2]
  seed = seed_ref[0]
  lane = ternary.lane_indices(interpret)
  first_chunk = lax.axis_index("steps") * chunks_per_step
  bytes_per_chunk = geometry.chunk // layout.planes

  def step_chunk(i):
    chunk = first_chunk + i
    start = chunk * geometry.chunk
    first_block = chunk * geometry.blocks_per_chunk
    old_scales = [scales_ref[first_block + k] for k in range(geometry.blocks_per_chunk)]

    def stored_codes(row):
      byte = chunk * bytes_per_chunk + row * PLANE_WIDTH
      return planar.split_planes(ternary.load_slice(stored_ref, byte), layout.base, layout.planes)

    def load_grad(offset):
      return ternary.load_slice(grad_ref, start + offset).astype(jnp.float32)

    def moment(offset, codes, grad):
      scale = ternary.slice_scale(old_scales, offset, lane, geometry)
      return _first_moment(ternary.dequantize_codes(codes, scale), grad, b1)

    def moment_at(offset):
      # The plane may be a traced index; Mosaic GPU selects among scalars but
      # not among vectors, so select the plane's place value, not its codes.
      plane = (offset // PLANE_WIDTH) % layout.planes
      place_values = [jnp.uint32(layout.base**p) for p in range(layout.planes)]
      place = ternary.select_scalar(place_values, plane)
      byte = chunk * bytes_per_chunk + (offset // geometry.row) * PLANE_WIDTH
      stored = ternary.load_slice(stored_ref, byte).astype(jnp.uint32)
      return moment(offset, (stored // place) % jnp.uint32(layout.base), load_grad(offset))

    new_scales = ternary.chunk_absmax(_MomentSlices(moment_at), 0, lane, geometry)
    for k, scale in enumerate(new_scales):
      new_scales_ref[first_block + k] = scale

    def step_row(row):
      codes = stored_codes(row)
      new_codes = []
      for plane in range(layout.planes):
        offset = row * geometry.row + plane * PLANE_WIDTH
        grad = load_grad(offset)
        m = moment(offset, codes[plane], grad)
        nu = ternary.load_slice(nu_ref, start + offset)
        if update_nu:
          nu = _second_moment(nu, grad, b2)
          new_nu_ref[pl.ds(start + offset, PLANE_WIDTH)] = nu
        direction = _direction(m, nu, bias_correction_1, bias_correction_2, eps)
        direction_ref[pl.ds(start + offset, PLANE_WIDTH)] = direction.astype(direction_ref.dtype)
        bits = ternary.counter_hash_bits(seed, (start + offset).astype(jnp.uint32) + lane)
        scale = ternary.slice_scale(new_scales, offset, lane, geometry)
        new_codes.append(ternary.ternary_codes(m, scale, bits))
      byte = chunk * bytes_per_chunk + row * PLANE_WIDTH
      new_stored_ref[pl.ds(byte, PLANE_WIDTH)] = planar.combine_planes(new_codes, layout.base)

    ternary.for_each_index(geometry.rows_per_chunk, step_row)

  ternary.for_each_index(chunks_per_step, step_chunk)


def _step_pallas(
    grad: jax.Array,
    stored: jax.Array,
    scales: jax.Array,
    nu: jax.Array,
    seed: jax.Array,
    hyper: jax.Array,
    *,
    block_size: int,
    layout: Any,
    update_nu: bool,
    interpret: bool,
    chunks_per_step: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """The kernel on whole grid steps of chunks, the reference on the rest."""
  size = grad.shape[0]
  geometry = ternary.ChunkGeometry(block_size, layout.planes)
  steps, chunks_per_step = ternary.grid_extent(size, geometry, chunks_per_step)
  if steps == 0:
    return _step_reference(
        grad, stored, scales, nu, seed, hyper,
        block_size=block_size, layout=layout, update_nu=update_nu,
    )
  direction_dtype = grad.dtype
  if grad.dtype not in _KERNEL_GRAD_DTYPES:
    grad = grad.astype(jnp.float32)
  out_type = [
      jax.ShapeDtypeStruct((size,), direction_dtype),
      jax.ShapeDtypeStruct(stored.shape, jnp.uint8),
      jax.ShapeDtypeStruct(scales.shape, jnp.float32),
  ]
  if update_nu:
    out_type.append(jax.ShapeDtypeStruct((size,), jnp.float32))
  kernel = _backend.mosaic_gpu_kernel(
      functools.partial(
          _step_kernel,
          geometry=geometry,
          layout=layout,
          chunks_per_step=chunks_per_step,
          update_nu=update_nu,
          interpret=interpret,
      ),
      out_type=tuple(out_type),
      grid=(steps,),
      grid_names=("steps",),
      interpret=interpret,
  )
  outputs = list(kernel(grad, stored, scales, nu, seed.reshape(1), hyper))
  if not update_nu:
    outputs.append(None)
  done = steps * chunks_per_step * geometry.chunk
  if done < size:
    tail = _step_reference(
        grad[done:],
        stored[done // layout.planes :],
        scales[done // block_size :],
        nu[done:],
        seed,
        hyper,
        block_size=block_size,
        layout=layout,
        update_nu=update_nu,
        index_offset=done,
    )
    # Chunk boundaries are block and packed-row boundaries: the tail's
    # elements, bytes and scales start exactly there.
    starts = (done, done // layout.planes, done // block_size, done)
    outputs = [
        None if whole is None else lax.dynamic_update_slice(whole, part, (at,))
        for whole, part, at in zip(outputs, tail, starts)
    ]
  return tuple(outputs)


# Entry point.


@functools.partial(
    jax.jit, static_argnames=("block_size", "layout", "update_nu", "implementation")
)
def _step(
    grad, stored, scales, nu, key, count, b1, b2, eps,
    *, block_size: int, layout: Any, update_nu: bool, implementation: str,
):
  flat_grad = grad.reshape(-1)
  # The seed ternary_encode draws from its key, so both give the same trits.
  seed = ternary.seed_from_key(key)
  hyper = _hyperparameters(count, b1, b2, eps)
  args = (flat_grad, stored, scales, nu.reshape(-1).astype(jnp.float32), seed, hyper)
  options = dict(block_size=block_size, layout=layout, update_nu=update_nu)
  if implementation == "xla":
    direction, new_stored, new_scales, new_nu = _step_reference(*args, **options)
  else:
    direction, new_stored, new_scales, new_nu = _step_pallas(
        *args, **options, interpret=implementation == "interpret"
    )
  return TernaryAdamStep(
      direction.reshape(grad.shape),
      ternary.TernaryArray(new_stored, new_scales),
      None if new_nu is None else new_nu.reshape(nu.shape),
  )


def _check_rate(name: str, value: Any) -> None:
  if isinstance(value, (int, float)) and not 0 <= value < 1:
    raise ValueError(f"{name} must be in [0, 1); got {value}.")


def ternary_adam_update(
    grad: jax.typing.ArrayLike,
    momentum: ternary.TernaryArray,
    nu: jax.typing.ArrayLike,
    *,
    key: jax.Array,
    count: jax.typing.ArrayLike,
    b1: jax.typing.ArrayLike,
    b2: jax.typing.ArrayLike,
    eps: jax.typing.ArrayLike,
    block_size: int,
    packing: str = "base3",
    update_nu: bool = True,
    implementation: _backend.Implementation = None,
) -> TernaryAdamStep:
  """One Adam step of a tensor whose first moment is stored as trits.

  .. math::
    m = \\beta_1 \\hat m + (1 - \\beta_1) g, \\quad
    \\nu' = \\beta_2 \\nu + (1 - \\beta_2) g^2, \\quad
    u = \\frac{m / (1 - \\beta_1^k)}{\\sqrt{\\nu' / (1 - \\beta_2^k)} + \\epsilon},
    \\quad \\hat m' = \\mathrm{decode}(\\mathrm{encode}(m, \\mathrm{key}))

  where ``\\hat m`` is the decoded ``momentum`` and ``k`` is ``count``.

  Args:
    grad: the gradient, a floating array of any shape.
    momentum: the stored first moment of ``grad.size`` elements, as
      ``ternary_encode`` returns it.
    nu: float32 second moment with ``grad.size`` elements: last step's when
      ``update_nu`` (it is updated here), this step's otherwise.
    key: a JAX PRNG key for the stochastic rounding of the new moment.
    count: the step number ``k >= 1`` of the bias corrections.
    b1: first-moment decay in ``[0, 1)``.
    b2: second-moment decay in ``[0, 1)``.
    eps: added to the root of the second moment, ``>= 0``.
    block_size: elements per scale block: 32, 64 or a multiple of 128.
    packing: ``"base3"`` (5 trits per byte) or ``"2bit"`` (4 per byte).
    update_nu: whether ``nu`` is updated with ``g**2`` here (and returned).
    implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

  Returns:
    A ``TernaryAdamStep``: the direction ``u`` (the gradient's shape and
    dtype), the new ``TernaryArray`` and the new ``nu`` (``None`` when
    ``update_nu`` is false).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_kernels.ternary import ternary_encode
    >>> from pallas_kernels.ternary_adam_update import ternary_adam_update
    >>> grad = jnp.linspace(-1.0, 1.0, 1000)
    >>> momentum = ternary_encode(jnp.zeros(1000), block_size=128)
    >>> step = ternary_adam_update(
    ...     grad, momentum, jnp.zeros(1000), key=jax.random.key(0), count=1,
    ...     b1=0.9, b2=0.999, eps=1e-8, block_size=128)
    >>> bool(jnp.allclose(step.direction, jnp.sign(grad), atol=1e-4))
    True
    >>> step.momentum.packed.shape, step.momentum.scales.shape
    ((200,), (8,))

  References:
    Kingma and Ba, "Adam: A Method for Stochastic Optimization", 2015
    (https://arxiv.org/abs/1412.6980).
  """
  grad = jnp.asarray(grad)
  if not jnp.issubdtype(grad.dtype, jnp.floating):
    raise ValueError(f"grad must have a floating dtype; got {grad.dtype}.")
  ternary.check_block_size(block_size)
  layout = ternary.packing_layout(packing)
  if not isinstance(momentum, ternary.TernaryArray):
    raise ValueError(f"momentum must be a TernaryArray; got {type(momentum).__name__}.")
  stored, scales = (jnp.asarray(a) for a in momentum)
  ternary.check_ternary_array(stored, scales, size=grad.size, block_size=block_size, layout=layout)
  nu = jnp.asarray(nu)
  if nu.size != grad.size or not jnp.issubdtype(nu.dtype, jnp.floating):
    raise ValueError(
        f"nu must be a floating array of grad.size={grad.size} elements; got"
        f" {nu.dtype}{list(nu.shape)}."
    )
  if not isinstance(key, jax.Array):
    raise ValueError(f"key must be a JAX PRNG key; got {type(key).__name__}.")
  _check_rate("b1", b1)
  _check_rate("b2", b2)
  if isinstance(eps, (int, float)) and not eps >= 0:
    raise ValueError(f"eps must be >= 0; got {eps}.")
  implementation = _backend.resolve_implementation(implementation)
  return _step(
      grad, stored, scales, nu, key, count, b1, b2, eps,
      block_size=block_size, layout=layout, update_nu=bool(update_nu),
      implementation=implementation,
  )


def lowering_examples() -> list[_backend.LoweringExample]:
  """The fused step for both packings, both ways of passing ``nu``, and a long bf16 gradient."""
  key = jax.random.key(0)

  def example(name, size, grad_dtype, block_size, packing, update_nu):
    layout = ternary.packing_layout(packing)
    grad = jax.ShapeDtypeStruct((size,), grad_dtype)
    momentum = ternary.TernaryArray(
        jax.ShapeDtypeStruct((planar.packed_size(size, layout.planes),), jnp.uint8),
        jax.ShapeDtypeStruct((-(-size // block_size),), jnp.float32),
    )
    nu = jax.ShapeDtypeStruct((size,), jnp.float32)
    fn = functools.partial(
        ternary_adam_update, key=key, count=3, b1=0.9, b2=0.999, eps=1e-8,
        block_size=block_size, packing=packing, update_nu=update_nu,
        implementation="pallas",
    )
    return _backend.LoweringExample(name, _backend.MOSAIC_GPU_CALL, fn, (grad, momentum, nu))

  size = 2 * 1280 + 100  # Whole chunks and a tail for both packings.
  return [
      example("ternary_adam_update_base3_128", size, jnp.float32, 128, "base3", True),
      example("ternary_adam_update_base3_256_given_nu", size, jnp.float32, 256, "base3", False),
      example("ternary_adam_update_2bit_64", size, jnp.float32, 64, "2bit", True),
      # Blocks over 8 packed rows: loops over rows and over a block's slices.
      example("ternary_adam_update_base3_1024", 6400 + 10, jnp.float32, 1024, "base3", True),
      # Several chunks per grid step.
      example("ternary_adam_update_base3_64_long_bfloat16", 2**24 + 3, jnp.bfloat16, 64, "base3", False),
  ]
