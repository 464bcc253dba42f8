"""examples/nnx_partitioning: a flax NNX model's own annotations lay it out."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt
from examples.nnx_partitioning.train import (
    LOGICAL_AXIS_RULES,
    MESH,
    annotated_strategy,
    build,
    train,
)


def test_the_annotations_lay_out_parameters_and_moments_and_training_equals_mirrored(
    devices, capfd
):
    _, _, specs = build()
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert P("embed", "mlp") in leaves  # flax's logical names, from the model
    strategy = annotated_strategy()
    state, losses = train(strategy, steps=6)
    # The batch rows arrive whole over "tensor", as the step wants them: XLA compiled the
    # step (a new function here) without resharding them (it printed, from C++, "[SPMD]
    # Involuntary full rematerialization" twice when the rows were split over all 8).
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    for name, spec in (("d1", P("fsdp", "tensor")), ("d2", P("tensor", "fsdp"))):
        assert state.params[name]["kernel"].sharding.spec == spec
        assert state.opt_state[0].mu[name]["kernel"].sharding.spec == spec
    assert state.params["d1"]["bias"].sharding.spec == P("tensor")
    want, want_losses = train(dt.MirroredStrategy(), steps=6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_a_logical_name_without_a_rule_is_an_error(devices):
    _, _, specs = build()
    with pytest.raises(ValueError, match=r"names 'mlp', which is neither an axis"):
        dt.MirroredStrategy(
            devices_per_replica=MESH, layout=specs, logical_axis_rules={"embed": "fsdp"}
        )
    assert set(LOGICAL_AXIS_RULES) == {"embed", "mlp"}
