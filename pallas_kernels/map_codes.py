r"""Map-based codes for optimizer moments (8-bit, 4-bit and float8 AdamW).

Each block of ``block_size`` consecutive elements keeps its absmax ``s``
(at least ``1e-12``) and each element the index of the entry of a sorted map
(a table of at most 256 float32 values in [-1, 1]) nearest to ``x / s``
(bitsandbytes' dynamic maps, a linear map: :data:`CODE_MAPS`); it decodes to
``map[code] * s``. ``"float8_e4m3fn"`` instead stores ``x / (s / 448)`` as a
float8 e4m3fn number. On XLA:CPU the nearest entry costs one table read per
element (:func:`nearest_map_code`), and so does decoding, float8 included
(:data:`FLOAT8_VALUES`). Elsewhere float8 codes are converted, and map
codes are decoded and encoded from each element alone, by selects and
comparisons (16-entry maps) or by the map's formula (256-entry dynamic
maps): :func:`map_entries_elementwise`, :func:`nearest_map_code_elementwise`.
Then XLA:GPU writes a step's new codes over the codes they come from.

:func:`map_quantize` and :func:`map_dequantize` code a whole array; the
blockwise :func:`map_scales`, :func:`map_encode` and :func:`map_decode` are
what the fused low-bit AdamW step (``pallas_kernels.lowbit_adamw_update``)
uses. These are XLA ops, the reference and the fast path at once.

References:
  Dettmers et al., `8-bit Optimizers via Block-wise Quantization
  <https://arxiv.org/abs/2110.02861>`_, ICLR 2022.
  Li et al., `Memory Efficient Optimizers with 4-bit States
  <https://arxiv.org/abs/2309.01507>`_, NeurIPS 2023.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import static_args, xla_cpu
from pallas_kernels.map_tables import CODE_MAPS

MAP_ZERO_BLOCK_SCALE = 1e-12
FLOAT8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448.
FLOAT8_CODE = "float8_e4m3fn"


def dynamic_map(*, signed: bool, max_exponent_bits: int, total_bits: int) -> np.ndarray:
  r"""The dynamic (tree) quantization map of Dettmers et al., in float64 rounded to float32.

  For each decade ``i = 0, ..., max_exponent_bits - 1`` the map holds
  ``10^{i - max_exponent_bits + 1}`` times the midpoints of ``n_i + 1``
  points spaced evenly over ``[0.1, 1]``, with ``n_i = 2^{i + r}`` (signed,
  with their negatives) or ``2^{i + r + 1}`` (unsigned), ``r = total_bits - 1
  - max_exponent_bits``, plus 0 and 1, sorted. Without a sign bit every
  entry is non-negative and the small ones finer.

  bitsandbytes (``create_dynamic_map``) computes the map in float32 with
  torch's ``linspace``, whose last bit differs from the exact value for some
  entries: the shipped tables (:data:`CODE_MAPS`) are that computation's
  values; this formula is within 2 float32 ulps of them.

  Args:
    signed: whether the map holds negative entries.
    max_exponent_bits: number of decades (7 for 8 bits, 3 for 4 bits).
    total_bits: bits per code; the map has ``2**total_bits`` entries.

  Returns:
    The sorted map, float32, shape ``(2**total_bits,)``.

  Examples:
    >>> from pallas_kernels import map_codes
    >>> map_codes.dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)[7:10]
    array([0.    , 0.0055, 0.0325], dtype=float32)

  References:
    Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
    2022 (https://arxiv.org/abs/2110.02861).
  """
  precision_bits = total_bits - 1 - max_exponent_bits
  if precision_bits != 0:
    raise ValueError(
      "dynamic_map needs total_bits == max_exponent_bits + 1; got"
      f" total_bits={total_bits}, max_exponent_bits={max_exponent_bits}."
    )
  entries = [0.0, 1.0]
  for i in range(max_exponent_bits):
    items = 2 ** (i + precision_bits + (0 if signed else 1))
    boundaries = np.linspace(0.1, 1.0, items + 1)
    means = 10.0 ** (i - max_exponent_bits + 1) * (boundaries[:-1] + boundaries[1:]) / 2
    entries += list(means) + (list(-means) if signed else [])
  return np.sort(np.array(entries, np.float64)).astype(np.float32)


class MapQuantized(NamedTuple):
  """Map codes and per-block scales of a flat array."""

  codes: jax.Array  # shape=(size,), dtype=uint8 (a map's index) or float8_e4m3fn.
  scales: jax.Array  # shape=(ceil(size / block_size),), dtype=float32.


def _check_code(code: Any) -> None:
  if code != FLOAT8_CODE and code not in CODE_MAPS:
    names = ", ".join(repr(name) for name in (*CODE_MAPS, FLOAT8_CODE))
    raise ValueError(f"code must be one of {names}; got {code!r}.")


def code_dtype(code: str) -> np.dtype:
  """The dtype of ``code``'s codes: float8_e4m3fn, or uint8 for a map."""
  _check_code(code)
  return jnp.dtype(jnp.float8_e4m3fn if code == FLOAT8_CODE else jnp.uint8)


def nearest_map_code_reference(values: jax.Array, table: Any) -> jax.Array:
  """Index of the entry of the sorted ``table`` nearest to each of ``values``.

  The reference's branchless binary search, then its rounding: ``code`` is
  the last entry ``<= x`` (0 below the first), then ``code + 1`` when
  ``x - table[code] >= (table[code + 1] - table[code]) * 0.5``. Ties go up,
  and the comparison is made in float32 as written, so the codes are those
  of bitsandbytes and torchao bit for bit. NaN gets 0. Returns integer
  codes: computed in numpy for float32 numpy ``values`` (how
  :func:`nearest_map_code` builds its tables, outside any trace), else in jnp.
  """
  xp = np if isinstance(values, np.ndarray) else jnp
  table = xp.asarray(table, xp.float32)
  size = table.shape[0]
  code = xp.zeros(xp.shape(values), xp.int32)
  step = size // 2
  while step:
    code = code + xp.where(values >= table[code + step], step, 0)
    step //= 2
  up = xp.minimum(code + 1, size - 1)
  below, above = table[code], table[up]
  return xp.where(values - below >= (above - below) * xp.float32(0.5), up, code)


class _BucketLookup(NamedTuple):
  """:func:`nearest_map_code`'s table for one map (see there)."""

  shift: int  # An ordered key >> shift = its bucket.
  entries: np.ndarray  # uint32 per bucket: its first code << 24, plus 2**24 - its code change's offset.


def _ordered_key(bits: Any) -> Any:
  """float32 bits (uint32, numpy or jnp) as uint32 keys in the order of their values.

  Flips every bit of a negative number and the sign bit of a positive one.
  This maps each aligned run of ``2**k`` bit patterns to an aligned run of
  keys.
  """
  xp = np if isinstance(bits, np.ndarray) else jnp
  return bits ^ xp.where(bits >> 31 == 1, xp.uint32(0xFFFFFFFF), xp.uint32(0x80000000))


def _key_value(keys: np.ndarray) -> np.ndarray:
  """The float32 values of ordered keys (the inverse of :func:`_ordered_key`)."""
  keys = keys.astype(np.uint32)
  positive = keys >> np.uint32(31) == 1
  return np.where(positive, keys ^ np.uint32(0x80000000), ~keys).astype(np.uint32).view(np.float32)


# Every float8 e4m3fn number, as float32, indexed by its bits.
FLOAT8_VALUES = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
FLOAT8_VALUES.flags.writeable = False


def _sorted_entries(code: str) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
  """The sorted entries that :func:`nearest_map_code` indexes for ``code``, and
  the rounding that defines the index of a float32 (in numpy).

  For float8, the magnitudes 0 to 448, whose index is their float8 bits, under
  round to nearest even (a float8 code's sign is a bit of its own).
  """
  if code == FLOAT8_CODE:
    magnitudes = FLOAT8_VALUES[:0x7F]  # Bits 0x00 (0) to 0x7E (448); 0x7F is NaN.
    return magnitudes, lambda v: v.astype(jnp.float8_e4m3fn).view(np.uint8)
  table = CODE_MAPS[code]
  return table, lambda v: nearest_map_code_reference(v, table)


@functools.cache
def _thresholds(code: str) -> np.ndarray:
  """Ordered keys (int64) of the code changes of ``code``: entry ``c`` is the key of the
  smallest float32 whose code (per :func:`_sorted_entries`' rounding) exceeds ``c``.

  Found by bisection between entries ``c`` and ``c + 1`` (codes grow with the value).
  """
  table, rounding = _sorted_entries(code)
  low, high = (_ordered_key(t.view(np.uint32)).astype(np.int64) for t in (table[:-1], table[1:]))
  codes = np.arange(table.size - 1)
  while np.any(high - low > 1):  # Invariant: code(low) <= c < code(high).
    middle = (low + high) // 2
    above = rounding(_key_value(middle)) > codes
    high, low = np.where(above, middle, high), np.where(above, low, middle)
  return high


@functools.cache
def _bucket_lookup(code: str) -> _BucketLookup:
  """The widest buckets of ordered keys that each hold at most one code change.

  A bucket is the keys sharing their top ``32 - shift`` bits; ``shift`` is
  the largest under which no bucket holds two thresholds
  (:func:`_thresholds`), at most 23 so that an offset in a bucket plus
  ``2**24`` cannot carry twice. A bucket without a threshold gets the offset
  ``2**shift``, which no key reaches; NaN keys (beyond infinity) get code 0.
  """
  table, _ = _sorted_entries(code)
  thresholds = np.append(_thresholds(code), 2**32)  # No code change above the last code.
  for shift in range(23, -1, -1):
    starts = np.arange(2 ** (32 - shift), dtype=np.int64) << shift
    first = np.minimum(np.searchsorted(thresholds, starts, side="right"), table.size - 1)
    nan = np.isnan(_key_value(starts))
    first = np.where(nan, 0, first)
    offsets = np.where(nan, 1 << shift, np.minimum(thresholds[first] - starts, 1 << shift))
    if np.all(nan | (thresholds[np.minimum(first + 1, table.size - 1)] >= starts + (1 << shift))):
      return _BucketLookup(shift, ((first << 24) + (1 << 24) - offsets).astype(np.uint32))
  raise AssertionError(f"no bucketing separates the thresholds of {code}")


def nearest_map_code(values: jax.Array, code: str) -> jax.Array:
  """:func:`nearest_map_code_reference` for a map of :data:`CODE_MAPS`, by one table read.

  For ``code="float8_e4m3fn"``, the float8 bits of non-negative values up to
  448 under round to nearest even (:func:`_sorted_entries`).

  The codes grow with the value, so each code change is a threshold. The
  float32 bits as keys in value order (:func:`_ordered_key`) fall in buckets
  of ``2**shift`` keys that hold at most one threshold each
  (:func:`_bucket_lookup`). A bucket's entry is its first code times
  ``2**24`` plus ``2**24`` minus the offset of its threshold, so adding a
  key's offset in the bucket carries into the code exactly at and above the
  threshold: the code is ``(entry + offset) >> 24``. Equal to the
  reference's for every float32 (tests compare every float32 near each code
  change), for one table read instead of a binary search's ``log2(size) +
  2``. Returns int32 codes.
  """
  table, _ = _sorted_entries(code)
  lookup = _bucket_lookup(code)
  # Outside the map the code is its first or last entry's; NaN gets code 0.
  values = jnp.clip(values, table[0], table[-1])
  keys = _ordered_key(lax.bitcast_convert_type(values, jnp.uint32))
  entry = jnp.asarray(lookup.entries)[(keys >> lookup.shift).astype(jnp.int32)]
  offset = keys & jnp.uint32((1 << lookup.shift) - 1)
  return ((entry + offset) >> 24).astype(jnp.int32)


# -- decoding and encoding from each element alone (every platform but XLA:CPU) --
#
# A table read is a gather, which XLA:GPU does not count as elementwise: a
# step whose new codes depend on a gather of the old ones writes them to a
# new buffer and copies them over the old (2 bytes per element and moment).
# Computed from each element alone, they are written in place.

# Maps of at most this many entries are read by selects and encoded by comparisons.
SELECT_MAP_SIZE = 16
# The 256-entry dynamic maps (7 decades), read by their formula.
_DECADES = 7


def _select(index: jax.Array, table: Any) -> jax.Array:
  """``table[index]`` by a balanced tree of ``len(table) - 1`` selects on ``index``'s bits."""
  level, bit = list(table), 0
  while len(level) > 1:
    odd = (index >> bit) & 1 == 1
    level, bit = [jnp.where(odd, b, a) for a, b in zip(level[::2], level[1::2])], bit + 1
  return level[0]


class _DynamicLayout(NamedTuple):
  """A 256-entry dynamic map as a formula (:func:`_dynamic_layout`)."""

  signed: bool
  base: int  # Entries of the first decade.
  # The code of the entry 0; magnitude k >= 0 has code zero_code + 1 + k (and, signed, zero_code - 1 - k).
  zero_code: int
  scales: np.ndarray  # float32 [8]: decade i's entry j is scales[i] * (2 n_i + 18 j + 9), n_i = base 2**i.
  starts: np.ndarray  # float32 [_DECADES - 1]: 10**(t - 7), where decade t >= 1 begins.
  slopes: np.ndarray  # float32 [8]: a magnitude's position k in decade i, about slopes[i] a + intercepts[i].
  intercepts: np.ndarray  # float32 [8].
  corrections: np.ndarray  # uint32 [3, words]: bit planes of 2 + (the entry's bits - the formula's).


@functools.cache
def _dynamic_layout(code: str) -> _DynamicLayout:
  r"""The formula of a 256-entry dynamic map, and its corrections to the shipped table.

  Decade ``i`` of the map's magnitudes holds ``n_i`` entries (``2**i``
  signed, ``2**(i + 1)`` unsigned), the midpoints of ``n_i + 1`` points
  spaced evenly over ``10^{i-7} [1, 10]`` (:func:`dynamic_map`): entry ``j``
  is :math:`10^{i-7} (2 n_i + 18 j + 9) / (2 n_i)`, one float32
  multiplication of a scale by an exact integer. torch's float32 arithmetic
  differs from it by at most 2 float32 steps, added back from three bit
  planes of 32-bit words.
  """
  table = CODE_MAPS[code]
  signed = bool(table[0] < 0)
  base, zero_code = (1, 127) if signed else (2, 0)
  decades = np.arange(_DECADES)
  n = base << decades
  padded = lambda x: np.pad(np.asarray(x, np.float32), (0, 8 - _DECADES))
  scales = padded(10.0 ** (decades - _DECADES) / (2 * n))
  slopes = padded(1 / (18 * scales[:_DECADES].astype(np.float64)))
  intercepts = padded(n - base - (2 * n + 9) / 18)
  starts = (10.0 ** (decades[1:] - _DECADES)).astype(np.float32)
  magnitudes = table[zero_code + 1 : table.size - 1]
  k = np.arange(magnitudes.size)
  decade, count = _dynamic_decade(k + base, base, np)
  formula = scales[decade] * _dynamic_multiple(k + base, count).astype(np.float32)
  difference = magnitudes.view(np.int32).astype(np.int64) - formula.view(np.int32).astype(np.int64) + 2
  assert np.all((difference >= 0) & (difference < 8)), code
  words = np.zeros((3, -(-magnitudes.size // 32)), np.uint64)
  for plane in range(3):
    np.add.at(words[plane], k >> 5, ((difference >> plane) & 1).astype(np.uint64) << (k & 31).astype(np.uint64))
  return _DynamicLayout(signed, base, zero_code, scales, starts, slopes, intercepts, words.astype(np.uint32))


def _dynamic_decade(m: Any, base: int, xp: Any) -> tuple[Any, Any]:
  """The decade of magnitude ``k = m - base`` and its entries ``n``."""
  decade = sum((m >= (base << t)).astype(xp.int32) for t in range(1, _DECADES))
  return decade, base << decade


def _dynamic_multiple(m: Any, count: Any) -> Any:
  """``2 n + 18 j + 9`` for magnitude ``k = m - base``, ``j = m - n`` its place in its decade."""
  return 18 * m - 16 * count + 9


def _dynamic_entries(codes: jax.Array, code: str) -> jax.Array:
  layout = _dynamic_layout(code)
  c = codes.astype(jnp.int32)
  n_magnitudes = CODE_MAPS[code].size - 2 - layout.zero_code
  k = jnp.abs(c - layout.zero_code) - 1 if layout.signed else c - 1
  k = jnp.clip(k, 0, n_magnitudes - 1)  # The codes of 0 and 1 are selected last.
  decade, count = _dynamic_decade(k + layout.base, layout.base, jnp)
  formula = _select(decade, layout.scales) * _dynamic_multiple(k + layout.base, count).astype(jnp.float32)
  shift = (k & 31).astype(jnp.uint32)
  difference = sum(
    ((_select(k >> 5, words) >> shift) & 1).astype(jnp.int32) << plane for plane, words in enumerate(layout.corrections)
  )
  entry = lax.bitcast_convert_type(lax.bitcast_convert_type(formula, jnp.int32) + difference - 2, jnp.float32)
  if layout.signed:
    entry = jnp.where(c < layout.zero_code, -entry, entry)
  entry = jnp.where(c == layout.zero_code, np.float32(0), entry)
  return jnp.where(c == CODE_MAPS[code].size - 1, np.float32(1), entry)


def _dynamic_nearest(values: jax.Array, code: str) -> jax.Array:
  """The reference's code of ``values`` from a guess ``c0`` that is the code of the last
  entry at or below it, or the one above; then its rounding between two entries."""
  layout = _dynamic_layout(code)
  table = CODE_MAPS[code]
  last = table.size - 1
  x = jnp.clip(values, table[0], table[-1])
  magnitude = jnp.abs(x)
  decade = sum((magnitude >= start).astype(jnp.int32) for start in layout.starts)
  # The position among the magnitudes, off by far less than 1/2 within a
  # decade; between decades, between the neighbouring entries' positions.
  position = 1 + magnitude * _select(decade, layout.slopes) + _select(decade, layout.intercepts)
  guess = layout.zero_code + (jnp.sign(x) * position if layout.signed else position)
  c0 = jnp.clip(jnp.floor(guess + 0.5), 0, last).astype(jnp.int32)
  entry = _dynamic_entries(c0, code)
  at_or_above = x >= entry
  other = _dynamic_entries(jnp.where(at_or_above, jnp.minimum(c0 + 1, last), c0 - 1), code)
  below, above = jnp.where(at_or_above, entry, other), jnp.where(at_or_above, other, entry)
  below_code = jnp.where(at_or_above, c0, c0 - 1)
  up = jnp.minimum(below_code + 1, last)
  nearest = jnp.where(x - below >= (above - below) * np.float32(0.5), up, below_code)
  return jnp.where(jnp.isnan(values), 0, nearest)


def map_entries_elementwise(codes: jax.Array, code: str) -> jax.Array:
  """``CODE_MAPS[code][codes]`` as float32, bit for bit, computed from each code alone.

  A map of at most :data:`SELECT_MAP_SIZE` entries by a tree of ``size - 1``
  selects between its entries; a 256-entry dynamic map by its formula, one
  float32 multiplication, corrected to the shipped table's bits
  (:func:`_dynamic_layout`). No table read (see above for why).
  """
  _check_code(code)
  if code == FLOAT8_CODE:
    raise ValueError("code must name a map; float8 codes are converted.")
  if CODE_MAPS[code].size <= SELECT_MAP_SIZE:
    return _select(codes.astype(jnp.int32), CODE_MAPS[code])
  return _dynamic_entries(codes, code)


@functools.cache
def _change_values(code: str) -> np.ndarray:
  """The smallest float32 of each code above the first (:func:`_thresholds`), none of them a zero."""
  values = _key_value(_thresholds(code))
  # A comparison with a zero would not tell -0 from +0, which the keys order.
  assert np.all(values != 0), code
  return values


def nearest_map_code_elementwise(values: jax.Array, code: str) -> jax.Array:
  """:func:`nearest_map_code`, computed from each value alone. Returns int32 codes.

  A map of at most :data:`SELECT_MAP_SIZE` entries: the number of code
  changes at or below the value, each the smallest float32 of its code
  (:func:`_thresholds`), by ``size - 1`` comparisons. A 256-entry dynamic
  map: the last entry at or below the value from a guess by the map's
  formula, checked against two entries computed by it
  (:func:`map_entries_elementwise`), then the reference's rounding between
  them. NaN gets code 0.
  """
  _check_code(code)
  if code == FLOAT8_CODE:
    raise ValueError("code must name a map; float8 codes are converted.")
  if CODE_MAPS[code].size > SELECT_MAP_SIZE:
    return _dynamic_nearest(values, code)
  return sum((values >= change).astype(jnp.int32) for change in _change_values(code))


def _elementwise_off_cpu(x: jax.Array, code: str, by_table: Callable, elementwise: Callable) -> jax.Array:
  """``by_table(x, code)`` on XLA:CPU, which reads tables faster than it computes
  the formulas and writes in place either way; ``elementwise(x, code)`` elsewhere."""
  return lax.platform_dependent(
    x, cpu=functools.partial(by_table, code=code), default=functools.partial(elementwise, code=code)
  )


def _divide(x: jax.Array, divisor: Any) -> jax.Array:
  """``x / divisor`` as a true division, for every element.

  XLA rewrites a division by a broadcast value into a multiplication by its
  reciprocal, which differs from the division in the last bit for about a
  quarter of float32 inputs, and the reference divides. An OR of the
  divisor's bits with a zero computed from each element of ``x`` (``min(bits
  of |x|, 0)``) makes the divisor an array of its own that XLA cannot
  broadcast, and leaves its value unchanged.
  """
  zero = jnp.minimum(lax.bitcast_convert_type(jnp.abs(x), jnp.int32), 0)
  bits = lax.bitcast_convert_type(jnp.broadcast_to(divisor, x.shape).astype(jnp.float32), jnp.int32)
  return x / lax.bitcast_convert_type(bits | zero, jnp.float32)


def map_scales(blocks: jax.Array, *, code: str) -> jax.Array:
  """The scales of float32 ``blocks`` (a block per row of the last axis), shape ``(..., 1)``.

  ``max(max |x|, 1e-12)``; divided by 448 for ``"float8_e4m3fn"``. For the
  maps' codes the floor is the reduction's initial value: the reduction then
  writes the scales themselves, where a floor applied to its result takes a
  pass of its own over the scales on XLA:GPU. fp8's floor and division stay
  on the result: dividing each element before the reduction (the same
  numbers) makes XLA:GPU write small tensors' decoded moments out between
  the two passes.
  """
  (scales,) = map_scales_together([blocks], codes=[code])
  return scales


def map_scales_together(blocks: Sequence[jax.Array], *, codes: Sequence[str]) -> list[jax.Array]:
  """:func:`map_scales` of each of ``blocks`` (arrays of one shape) under its code, in one reduction.

  One variadic reduction reads every input in one pass over memory: XLA
  cannot then fuse one absmax into a later pass that reads the inputs of
  the other again.
  """
  inits = tuple(np.float32(-np.inf if code == FLOAT8_CODE else MAP_ZERO_BLOCK_SCALE) for code in codes)
  absmaxes = xla_cpu.reduce_row(
    tuple(jnp.abs(b) for b in blocks),
    inits,
    lambda a, b: tuple(map(lax.max, a, b)),
    fold_to=xla_cpu.FUSED_REDUCTION,
  )
  return [
    _divide(jnp.maximum(absmax[..., None], MAP_ZERO_BLOCK_SCALE), FLOAT8_MAX)
    if code == FLOAT8_CODE
    else absmax[..., None]
    for absmax, code in zip(absmaxes, codes)
  ]


def _float8_magnitude_code(magnitudes: jax.Array) -> jax.Array:
  """The float8 bits (int32) of non-negative float32 ``magnitudes``: :func:`nearest_map_code`'s.

  The conversion, after saturating at 448 (NaN gets 0); on XLA:CPU, which
  converts to float8 in software, the table read of :func:`nearest_map_code`
  (equal for every float32). The conversion is elementwise, so a GPU
  program can write the codes into the buffer of the codes they replace.
  """

  def converted(magnitudes):
    saturated = jnp.where(jnp.isnan(magnitudes), 0.0, jnp.minimum(magnitudes, FLOAT8_MAX))
    return lax.bitcast_convert_type(saturated.astype(jnp.float8_e4m3fn), jnp.uint8).astype(jnp.int32)

  return lax.platform_dependent(
    magnitudes, cpu=functools.partial(nearest_map_code, code=FLOAT8_CODE), default=converted
  )


def _float8_values(codes: jax.Array) -> jax.Array:
  """float8 e4m3fn ``codes`` as float32: converted, or on XLA:CPU (software float8) read from :data:`FLOAT8_VALUES`."""

  def by_table(codes):
    return jnp.asarray(FLOAT8_VALUES)[lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)]

  return lax.platform_dependent(codes, cpu=by_table, default=lambda codes: codes.astype(jnp.float32))


def map_encode(values: jax.Array, scales: jax.Array, *, code: str) -> jax.Array:
  """Codes of float32 ``values`` under ``scales`` (broadcast to ``values``), in ``code_dtype(code)``.

  The division is a true division, as in the reference (:func:`_divide`).
  float8 codes are the float8 conversion of the ratios (round to nearest
  even), which never exceed 448 under a block's scale; beyond it they
  saturate at +-448 where the conversion gives NaN. Elementwise, so the
  codes keep the layout (and sharding) of ``values``; outside XLA:CPU, map
  codes are computed from each value alone
  (:func:`nearest_map_code_elementwise`), so that a GPU program writes them
  over the codes they come from.
  """
  ratios = _divide(values, scales)
  if code == FLOAT8_CODE:
    # The sign of x / s is x's (s > 0).
    sign = (lax.bitcast_convert_type(values, jnp.uint32) >> 31).astype(jnp.int32) << 7
    codes = (_float8_magnitude_code(jnp.abs(ratios)) | sign).astype(jnp.uint8)
    return lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
  return _elementwise_off_cpu(ratios, code, nearest_map_code, nearest_map_code_elementwise).astype(jnp.uint8)


def map_decode(codes: jax.Array, scales: jax.Array, *, code: str, elementwise: bool = False) -> jax.Array:
  """``map[codes] * scales``, float32; float8 codes converted (:func:`_float8_values`).

  ``elementwise``: outside XLA:CPU, the entries computed from each code alone
  (:func:`map_entries_elementwise`), for a program that writes new codes
  over the ones it decodes; else read from the map (cheaper).
  """
  if code == FLOAT8_CODE:
    return _float8_values(codes) * scales
  if not elementwise:
    return _entries_by_table(codes, code) * scales
  return _elementwise_off_cpu(codes, code, _entries_by_table, map_entries_elementwise) * scales


def _entries_by_table(codes: jax.Array, code: str) -> jax.Array:
  return jnp.asarray(CODE_MAPS[code])[codes.astype(jnp.int32)]


def _map_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """Flat ``x`` as ``(n_blocks, block_size)``, the last block zero padded.

  Zeros leave a block's absmax, hence the short last block's scale, unchanged.
  """
  flat = x.reshape(-1)
  padding = -flat.size % block_size
  return jnp.pad(flat, (0, padding)).reshape(-1, block_size)


def map_quantize(x: jax.Array, *, code: str, block_size: int) -> MapQuantized:
  r"""Quantizes flattened ``x`` to codes of a map (or float8), one absmax scale per block.

  .. math::

    s_b = \max(\max_{i \in b} |x_i|, 10^{-12}), \qquad
    q_i = \arg\min_j |\mathrm{map}_j - x_i / s_b|, \qquad
    \hat{x}_i = \mathrm{map}_{q_i} s_b,

  with the reference's tie-breaking (:func:`nearest_map_code_reference`). For
  ``code="float8_e4m3fn"``: ``s_b`` divided by 448 and ``q_i = e4m3(x_i /
  s_b)``. The last block may be shorter. An XLA (jnp) op: the GPU kernel
  that uses these codes is the fused optimizer step
  (``pallas_kernels.lowbit_adamw_update``).

  Args:
    x: a float array of any shape (computed in float32).
    code: a name in :data:`CODE_MAPS` or ``"float8_e4m3fn"``.
    block_size: elements per scale, ``>= 1``.

  Returns:
    A ``MapQuantized``: ``codes`` shape ``(x.size,)``, ``scales`` shape
    ``(ceil(x.size / block_size),)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import map_codes
    >>> q = map_codes.map_quantize(jnp.array([1.0, -0.5, 0.0, 4.0]), code="dynamic_8bit_signed", block_size=2)
    >>> q.scales
    Array([1., 4.], dtype=float32)
    >>> map_codes.map_dequantize(q, size=4, code="dynamic_8bit_signed", block_size=2)
    Array([ 1.        , -0.50078124,  0.        ,  4.        ], dtype=float32)

  References:
    Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
    2022 (https://arxiv.org/abs/2110.02861).
  """
  _check_code(code)
  block_size = static_args.check_int("block_size", block_size, 1)
  x = jnp.asarray(x)
  size = x.size
  blocks = _map_blocks(x.astype(jnp.float32), block_size)
  scales = map_scales(blocks, code=code)
  return MapQuantized(map_encode(blocks, scales, code=code).reshape(-1)[:size], scales.reshape(-1))


def map_dequantize(q: MapQuantized, *, size: int, code: str, block_size: int) -> jax.Array:
  """Decodes ``map_quantize``'s output into a flat float32 array of ``size`` elements."""
  _check_code(code)
  block_size = static_args.check_int("block_size", block_size, 1)
  size = static_args.check_int("size", size, 0)
  expected = ((size,), (-(-size // block_size),))
  if (q.codes.shape, q.scales.shape) != expected or q.codes.dtype != code_dtype(code):
    raise ValueError(
      f"q does not match size={size}, code={code!r}, block_size={block_size}: expected"
      f" {code_dtype(code)} codes of shape {expected[0]} and scales of shape {expected[1]};"
      f" got {q.codes.dtype}{q.codes.shape} and {q.scales.shape}."
    )
  codes = _map_blocks(q.codes, block_size)
  return map_decode(codes, q.scales[:, None], code=code).reshape(-1)[:size]
