"""``DiLoCoStrategy``'s hierarchical outer step (``outer_sync="hierarchical"``, issue 57):
one copy of the model (or of its encoding) crosses islands per outer step, whatever the
replicas per island, with the values of the flat step (every replica sends it all).

The bytes are read from the compiled program (``benchmarks/islands.py`` counts them);
the values are compared bit for bit after two outer steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain._src.islands.codecs import payload_bytes
from distrain._src.islands.outer_sync import mean_over_islands
from tests.test_islands_strategy import NESTEROV, _data, _params, train_step

# name: (replicas per island, the strategy's extra keywords)
LAYOUTS = {
    "r1_float32": (1, {}),
    "r2_float32_streaming": (2, {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1}),
    "r4_int4": (4, {"outer_dtype": "int4"}),
    "r2_fsdp2_float32": (2, {"devices_per_replica": {"fsdp": 2}, "min_shard_bytes": 0}),
}


def _train(strategy, params, batches):
    """What island 0 puts on the cross-island link per outer step (read from the compiled
    step), and the state after ``batches``."""
    from benchmarks.islands import collectives, cross_island_bytes

    state = strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.adam(0.05)))
    first = strategy.distribute_batch(batches[0])
    hlo = strategy.compile(train_step, (state, first)).as_text()
    per_island = len(strategy.mesh.devices.flat) // strategy.islands
    crossed = cross_island_bytes(
        collectives(hlo, lambda d: d // per_island), lambda d: d // per_island
    )
    for batch in batches:
        state, _ = strategy.run(train_step, args=(state, strategy.distribute_batch(batch)))
    return crossed, state


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_one_copy_crosses_islands_with_the_flat_steps_values(devices, layout):
    """Per outer step, the bytes island 0 puts into the compiled program's cross-island
    collectives are one copy of the parameters (float32) or of their encoding (int4),
    padded to R equal shares, against R copies in the flat step (R replicas per island;
    with fsdp inside a replica, both split each copy over its devices); after 4 steps
    (2 outer steps; with Streaming DiLoCo both fragments' exchanges, one a step late),
    the global parameters, each island's parameters and optimizer state and the counter
    equal the flat step's bit for bit."""
    replicas, extra = LAYOUTS[layout]
    per_replica = extra.get("devices_per_replica", {}).get("fsdp", 1)  # devices
    kwargs = {"sync_every": 2, **extra}
    islands = 8 // (replicas * per_replica)
    rng = np.random.default_rng(3)
    # A leaf of 3 values (its gradient is 0): no copy divides into R equal shares, so
    # each is zero-padded to a multiple of R values (float32) or bytes (encodings).
    params, batches = {**_params(rng), "odd": jnp.ones((3,))}, _data(rng, 4)
    outer_dtype = kwargs.get("outer_dtype", "float32")
    one_copy = sum(payload_bytes(x.shape, outer_dtype) for x in jax.tree.leaves(params))
    unit = 4 if outer_dtype == "float32" else 1
    padded = -(-one_copy // (unit * replicas)) * unit * replicas

    runs = {}
    for outer_sync in ("hierarchical", "flat") if replicas > 1 else ("hierarchical",):
        strategy = dt.experimental.DiLoCoStrategy(
            islands, outer_optimizer=NESTEROV, outer_sync=outer_sync, **kwargs
        )
        assert strategy.outer_sync == outer_sync and strategy.replicas_per_island == replicas
        runs[outer_sync] = _train(strategy, params, batches)
    crossed, state = runs["hierarchical"]
    assert crossed == padded and padded - one_copy < unit * replicas
    assert int(state.step) == 4
    if replicas == 1:
        return  # one replica per island: the flat step, nothing to compare
    crossed_flat, flat = runs["flat"]
    # The flat step's copy, split over fsdp by XLA, is padded to its devices.
    step = unit * per_replica
    assert crossed_flat == replicas * (-(-one_copy // step) * step)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(flat), strict=True):
        np.testing.assert_array_equal(a, b)


def test_outer_sync_errors(devices):
    """An unknown ``outer_sync`` is refused before a device is touched; the
    hierarchical mean outside a replica of ``run`` says where it belongs."""
    with pytest.raises(ValueError, match=r"outer_sync must be one of \['hierarchical', 'flat'\]"):
        dt.experimental.DiLoCoStrategy(2, 4, NESTEROV, outer_sync="tree")
    with pytest.raises(RuntimeError, match="inside a replica of DiLoCoStrategy.run"):
        mean_over_islands({"w": np.ones((1, 4), np.float32)}, replicas=2)
