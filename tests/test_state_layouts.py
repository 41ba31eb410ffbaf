"""State layouts for sharding: each of our states declares how its fields lie
relative to their parameters, and ``state_shardings`` follows the
declarations over the shape rules it keeps for states that declare nothing.
The 8-device runs of tests/test_sharding.py check that the partitioner keeps
the resulting layouts through an update."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_memopt
from benchmarks import shapes
from memopt_tools.training import optimizers
from optax_memopt import sharding

MESH = AbstractMesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
PARAMS = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
PARAM_SHARDINGS = {"w": NamedSharding(MESH, P("fsdp", "tp"))}


@pytest.mark.parametrize("name", ["microadam", "adam_mini", "ternary_adam", "adamw_8bit", "adamw_4bit", "adamw_fp8"])
def test_every_leaf_of_our_states_has_a_declared_layout(name):
  config = shapes.MODELS["demo"]
  state = jax.eval_shape(optimizers.get(name).build(1e-3, config).init, shapes.params("demo", abstract=True))
  layouts = sharding.declared_layouts(state)
  assert len(layouts) == len(jax.tree.leaves(state))
  assert None not in layouts


class _FlatCodes(NamedTuple):
  codes: dict
  field_layouts = {"codes": sharding.Layout.FLAT}


def test_a_declared_layout_decides_over_the_shape_rules():
  # (8, 2, 8) reads as the (8, 16) parameter's last axis cut into 2 blocks of 8.
  codes = {"w": jax.ShapeDtypeStruct((8, 2, 8), jnp.uint8)}
  guessed = sharding.state_shardings((codes,), PARAMS, PARAM_SHARDINGS, MESH)[0]["w"]
  declared = sharding.state_shardings((_FlatCodes(codes),), PARAMS, PARAM_SHARDINGS, MESH)[0].codes["w"]
  assert guessed.spec == P("fsdp", "tp", None)
  # Flat: mesh axes, largest first, to the axis with the most elements left per shard.
  assert declared.spec == P("fsdp", None, "tp")


def test_declared_scales_of_codes_in_the_parameters_shape_follow_its_rows():
  class Scaled(NamedTuple):
    codes: dict
    scales: dict
    field_layouts = {"codes": sharding.Layout.PARAM, "scales": sharding.Layout.BLOCK_SCALES}

  state = Scaled(
    {"w": jax.ShapeDtypeStruct((8, 16), jnp.uint8)},
    {"w": jax.ShapeDtypeStruct((8, 2, 1), jnp.float32)},
  )
  laid_out = sharding.state_shardings(state, PARAMS, PARAM_SHARDINGS, MESH)
  assert laid_out.codes["w"] == PARAM_SHARDINGS["w"]
  # Two blocks per row: "tp" divides them, each device holds its columns' scales.
  assert laid_out.scales["w"].spec == P("fsdp", "tp", None)


def test_a_declaration_must_name_every_field():
  class Partial(NamedTuple):
    codes: dict
    scales: dict
    field_layouts = {"codes": sharding.Layout.FLAT}

  with pytest.raises(ValueError, match="Partial.field_layouts"):
    sharding.declared_layouts(Partial({}, {}))


def test_a_leaf_declared_like_its_parameter_must_have_its_shape():
  class Moment(NamedTuple):
    mu: dict
    field_layouts = {"mu": sharding.Layout.PARAM}

  state = Moment({"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)})
  with pytest.raises(ValueError, match="Layout.PARAM"):
    sharding.state_shardings(state, PARAMS, PARAM_SHARDINGS, MESH)


@pytest.mark.parametrize(
  "shape, codes_rows, scales_rows",
  [
    # Three 32-element blocks per row cannot split over tp = 2: codes and scales put it on the rows.
    ((64, 96), ("fsdp", "tp"), ("fsdp", "tp")),
    # One block per row: its codes stay whole rows, its scale is scattered like any row reduction.
    ((256, 32), "fsdp", ("fsdp", "tp")),
  ],
)
def test_ternary_codes_and_scales_where_blocks_do_not_split_over_tp(shape, codes_rows, scales_rows):
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  state = jax.eval_shape(optax_memopt.scale_by_ternary_adam(block_size=32).init, params)
  laid_out = sharding.state_shardings(state, params, PARAM_SHARDINGS, MESH)
  assert laid_out.mu.packed["w"].spec == P(codes_rows, None, None)
  assert laid_out.mu.scales["w"].spec == P(scales_rows, None, None)


def test_ternary_column_statistics_are_whole_over_the_rows_mesh_axes():
  # Every device's rows read every column's statistic: whole over the rows'
  # mesh axes (one all-reduce of the partial column sums, not a scatter and a
  # gather), split over tp with the columns; the row statistics follow the rows.
  params = {"w": jax.ShapeDtypeStruct((64, 128), jnp.float32)}
  state = jax.eval_shape(optax_memopt.scale_by_ternary_adam(block_size=32).init, params)
  laid_out = sharding.state_shardings(state, params, PARAM_SHARDINGS, MESH)
  assert laid_out.nu.col["w"].spec == P("tp")
  assert laid_out.nu.row["w"].spec == P(("fsdp", "tp"))
  fsdp_only = {"w": NamedSharding(MESH, P("fsdp", None))}
  laid_out = sharding.state_shardings(state, params, fsdp_only, MESH)
  assert tuple(laid_out.nu.col["w"].spec) in ((), (None,))
  # Stacked layers: the leading axis keeps its mesh axes.
  stacked = {"w": jax.ShapeDtypeStruct((4, 64, 128), jnp.float32)}
  state = jax.eval_shape(optax_memopt.scale_by_ternary_adam(block_size=32).init, stacked)
  laid_out = sharding.state_shardings(state, stacked, {"w": NamedSharding(MESH, P("tp", "fsdp", None))}, MESH)
  assert laid_out.nu.col["w"].spec == P("tp", None)


def test_adam_mini_head_means_follow_whole_heads_and_are_whole_over_the_rows():
  # 4 query heads of 4 columns: two per tp shard, so their v follows tp; the
  # head means over rows split by fsdp are all-reduced, v whole over fsdp.
  params = {"attention": {"query": {"kernel": jax.ShapeDtypeStruct((8, 16), jnp.float32)}}}
  state = jax.eval_shape(optax_memopt.scale_by_adam_mini(n_heads=4).init, params)
  assert state.nu["attention"]["query"]["kernel"].shape == (1, 4)
  shardings = {"attention": {"query": {"kernel": NamedSharding(MESH, P("fsdp", "tp"))}}}
  laid_out = sharding.state_shardings(state, params, shardings, MESH)
  assert laid_out.nu["attention"]["query"]["kernel"].spec == P(None, "tp")
  # 8 devices on the heads' axis hold half a head each: v whole.
  mesh = AbstractMesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  shardings = {"attention": {"query": {"kernel": NamedSharding(mesh, P(None, "fsdp"))}}}
  laid_out = sharding.state_shardings(state, params, shardings, mesh)
  assert tuple(laid_out.nu["attention"]["query"]["kernel"].spec) in ((), (None, None))
