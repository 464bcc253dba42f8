"""Logical axis rules: plain mappings (one axis per name, every name used) and ordered
tables as MaxText and flax write them (dt.OrderedAxisRules)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt

# MaxText's base.yml table, shortened: names map to axes this 8-device replica mesh
# ({"fsdp": 4, "tensor": 2}) has, and to axes it lacks ("data", "stage", "expert").
MAXTEXT_LIKE = [
    ("activation_batch", ("data", "fsdp")),
    ("mlp", "tensor"),
    ("mlp", "fsdp"),
    ("heads", "tensor"),
    ("embed", "fsdp"),
    ("embed", "tensor"),
    ("vocab", "tensor"),
    ("layers", "stage"),
    ("exp", "expert"),
]


def _spec(layout, path, shape):
    return layout.state_sharding(shape, path).spec


def test_an_ordered_table_picks_the_first_candidate_that_fits_each_spec(devices):
    strategy = dt.MirroredStrategy(
        devices_per_replica={"fsdp": 4, "tensor": 2},
        layout={
            "up": P("embed", "mlp"),  # embed -> fsdp, mlp -> tensor
            "down": P("mlp", "embed"),  # mlp -> tensor, embed: fsdp
            "wide": P("mlp", "vocab"),  # mlp -> tensor; vocab's only candidate is taken
            "experts": P("exp", "layers", "embed"),  # no expert or stage axis: replicated
        },
        logical_axis_rules=dt.OrderedAxisRules(MAXTEXT_LIKE),
        min_shard_bytes=0,
    )
    layout = strategy.replica_layout
    assert _spec(layout, "up", (16, 32)) == P("fsdp", "tensor")
    assert _spec(layout, "down", (32, 16)) == P("tensor", "fsdp")
    assert _spec(layout, "wide", (32, 16)) == P("tensor", None)
    assert _spec(layout, "experts", (4, 2, 16)) == P(None, None, "fsdp")
    state = strategy.put_replicated(
        {
            k: np.zeros(s, np.float32)
            for k, s in [
                ("up", (16, 32)),
                ("down", (32, 16)),
                ("wide", (32, 16)),
                ("experts", (4, 2, 16)),
            ]
        }
    )
    assert state["up"].sharding.spec == P("fsdp", "tensor")


def test_a_plain_mapping_stays_strict(devices):
    with pytest.raises(ValueError, match=r"names 'mlp' twice.*dt.OrderedAxisRules"):
        dt.MirroredStrategy(
            devices_per_replica={"fsdp": 4, "tensor": 2},
            layout={"up": P("mlp")},
            logical_axis_rules=[("mlp", "tensor"), ("mlp", "fsdp")],
        )
    with pytest.raises(ValueError, match=r"maps 'exp' to \['expert'\], which the replica lacks"):
        dt.MirroredStrategy(
            devices_per_replica={"fsdp": 8},
            layout={"up": P("exp")},
            logical_axis_rules={"exp": "expert"},
        )


def test_rules_that_match_no_leaf_are_still_an_error_with_a_table(devices):
    strategy = dt.MirroredStrategy(
        devices_per_replica={"fsdp": 4, "tensor": 2},
        layout={"mlp/up": P("embed", "mlp")},
        logical_axis_rules=dt.OrderedAxisRules(MAXTEXT_LIKE),
    )
    with pytest.raises(ValueError, match=r"match no leaf"):
        strategy.put_replicated({"attention/q": np.zeros((8, 8), np.float32)})


def test_a_malformed_table_item_is_an_error():
    with pytest.raises(ValueError, match=r"pairs. Received an item 'embed'"):
        dt.OrderedAxisRules(["embed"])


def test_an_ordered_table_lays_out_like_the_mapping_it_resolves_to(devices):
    """The same layout through a table and through the mapping it resolves to."""
    shapes = {"up": (16, 32), "down": (32, 16)}
    kw = {"devices_per_replica": {"fsdp": 4, "tensor": 2}, "min_shard_bytes": 0}
    table = dt.MirroredStrategy(
        layout={"up": P("embed", "mlp"), "down": P("mlp", "embed")},
        logical_axis_rules=dt.OrderedAxisRules(MAXTEXT_LIKE),
        **kw,
    )
    plain = dt.MirroredStrategy(
        layout={"up": P("fsdp", "tensor"), "down": P("tensor", "fsdp")}, **kw
    )
    for name, shape in shapes.items():
        a = table.replica_layout.state_sharding(shape, name)
        b = plain.replica_layout.state_sharding(shape, name)
        assert a.is_equivalent_to(b, len(shape))


def test_one_path_text_for_layouts_and_checkpoints():
    """Layout rules and checkpoint manifests read the same path text: dict keys,
    attribute names and indices joined by "/" (the root is "<root>" in manifests)."""
    import optax

    from distrain._src.checkpoint import _layout as ckpt
    from distrain._src.strategy import layout

    state = dt.TrainState.create(params={"dense": {"kernel": np.ones(2)}}, tx=optax.adam(0.1))
    paths = [layout.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert "params/dense/kernel" in paths and "opt_state/0/mu/dense/kernel" in paths
    for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        assert ckpt.path_str(p) == layout.path_str(p)
    assert ckpt.path_str(()) == "<root>" and layout.path_str(()) == ""
