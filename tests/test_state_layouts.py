"""State layouts for sharding: every state's fields declare how they lie
relative to their parameters (ours in their classes, optax's in
``sharding.FIELD_LAYOUTS``, anyone's by ``sharding.declare_layouts``), and
``state_shardings`` follows the declarations; a state that declares nothing
is taken to hold leaves shaped like their parameters, and one that does not
is an error, not a guess. The 8-device runs of tests/test_sharding.py check
that the partitioner keeps the resulting layouts through an update."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
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


def _wrapped(name):
  """The registry's optimizer in optax's wrappers, whose states declare their layouts too."""
  build = lambda learning_rate: optimizers.get(name).build(learning_rate, shapes.MODELS["demo"])
  return optax.MultiSteps(optax.inject_hyperparams(build)(learning_rate=1e-3), every_k_schedule=2)


@pytest.mark.parametrize("name", sorted(optimizers.OPTIMIZERS))
def test_every_leaf_of_the_registrys_states_has_a_declared_layout(name):
  state = jax.eval_shape(_wrapped(name).init, shapes.params("demo", abstract=True))
  layouts = sharding.declared_layouts(state)
  assert len(layouts) == len(jax.tree.leaves(state))
  assert None not in layouts


class _FlatCodes(NamedTuple):
  codes: dict
  field_layouts = {"codes": sharding.Layout.FLAT}


class _LibraryCodes(NamedTuple):
  """A state class of another library's, which declares nothing."""

  codes: dict


def test_a_leaf_not_shaped_like_its_parameter_needs_a_declared_layout():
  # (8, 2, 8) could be read as the (8, 16) parameter's last axis cut into 2
  # blocks of 8: nothing is guessed from shapes.
  codes = {"w": jax.ShapeDtypeStruct((8, 2, 8), jnp.uint8)}
  for state in ((codes,), _LibraryCodes(codes)):
    with pytest.raises(ValueError, match=r"\(8, 2, 8\), its parameter \(8, 16\).*declare_layouts"):
      sharding.state_shardings(state, PARAMS, PARAM_SHARDINGS, MESH)
  with pytest.raises(ValueError, match=r"\['w'\].*_LibraryCodes.codes declares no layout"):
    sharding.state_shardings(_LibraryCodes(codes), PARAMS, PARAM_SHARDINGS, MESH)
  # Flat: mesh axes, largest first, to the axis with the most elements left per shard.
  declared = sharding.state_shardings((_FlatCodes(codes),), PARAMS, PARAM_SHARDINGS, MESH)[0].codes["w"]
  assert declared.spec == P("fsdp", None, "tp")


def test_a_state_that_declares_nothing_is_laid_out_like_its_parameters():
  state = _LibraryCodes({"w": jax.ShapeDtypeStruct((8, 16), jnp.float32)})
  assert sharding.state_shardings(state, PARAMS, PARAM_SHARDINGS, MESH).codes["w"] == PARAM_SHARDINGS["w"]


def test_declare_layouts_of_a_class_one_cannot_edit(monkeypatch):
  monkeypatch.setattr(sharding, "FIELD_LAYOUTS", dict(sharding.FIELD_LAYOUTS))
  with pytest.raises(ValueError, match="_LibraryCodes.field_layouts"):
    sharding.declare_layouts(_LibraryCodes, {"codes": sharding.Layout.FLAT, "scales": sharding.Layout.FLAT})
  sharding.declare_layouts(_LibraryCodes, {"codes": sharding.Layout.FLAT})
  state = _LibraryCodes({"w": jax.ShapeDtypeStruct((8, 2, 8), jnp.uint8)})
  assert sharding.declared_layouts(state) == [sharding.Layout.FLAT]
  assert sharding.state_shardings(state, PARAMS, PARAM_SHARDINGS, MESH).codes["w"].spec == P("fsdp", None, "tp")


def test_galore_projections_keep_the_parameters_axis_and_its_moments_follow_them():
  # Its base optimizer's state (Adam's) lies in the projected space: GaLore's
  # declaration covers it. (8, 16) is projected on the right: (8, 4) moments
  # and a (16, 4) projector of the columns, cut flat; (16, 8) on the left.
  params = {"wide": jax.ShapeDtypeStruct((8, 16), jnp.float32), "tall": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
  shardings = {"wide": PARAM_SHARDINGS["w"], "tall": PARAM_SHARDINGS["w"]}
  state = jax.eval_shape(optax.contrib.scale_by_galore(rank=4).init, params)
  laid_out = sharding.state_shardings(state, params, shardings, MESH)
  adam = laid_out.base_optimizer_state
  assert adam.mu["wide"].spec == adam.nu["wide"].spec == P("fsdp", None)
  assert laid_out.projector["wide"].spec == P(("fsdp", "tp"), None)
  assert adam.mu["tall"].spec == P(None, "tp")
  assert laid_out.projector["tall"].spec == P("fsdp", None)


def test_adafactor_statistics_are_cut_flat():
  params = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32), "b": jax.ShapeDtypeStruct((16,), jnp.float32)}
  shardings = {"w": PARAM_SHARDINGS["w"], "b": NamedSharding(MESH, P("fsdp"))}
  state = jax.eval_shape(optax.scale_by_factored_rms(min_dim_size_to_factor=4).init, params)
  assert (state.v_row["w"].shape, state.v_col["w"].shape, state.v["w"].shape) == ((8,), (16,), (1,))
  laid_out = sharding.state_shardings(state, params, shardings, MESH)
  assert laid_out.v_row["w"].spec == laid_out.v_col["w"].spec == P(("fsdp", "tp"))
  assert laid_out.v["w"].spec == P(None)
  # Unfactored: v follows its parameter.
  assert laid_out.v["b"] == shardings["b"]


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
  with pytest.raises(ValueError, match="Moment.mu is declared Layout.PARAM"):
    sharding.state_shardings(state, PARAMS, PARAM_SHARDINGS, MESH)
  # Whatever the parameter's sharding.
  replicated = {"w": NamedSharding(MESH, P())}
  with pytest.raises(ValueError, match="Moment.mu is declared Layout.PARAM"):
    sharding.state_shardings(state, PARAMS, replicated, MESH)


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
