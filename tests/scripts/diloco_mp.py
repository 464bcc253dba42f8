"""DiLoCoStrategy over processes, for tests/test_islands_strategy.py.

2 islands of the MLP of tests/test_islands_strategy.py (sync_every 3, 7 steps): with
DISTRAIN_* variables for 2 processes x 2 devices, one island per process; without, one
process x 4 devices. Global batches go through experimental_distribute_dataset (each
process reads its rows). Writes --out/result_<process id>.npz: the global parameters,
this process's replicas' components of the islands' parameters, the losses' sums, the
process and replica counts.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import optax

    import distrain as dt

    strategy = dt.experimental.DiLoCoStrategy(
        islands=2, sync_every=3, outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True)
    )
    import jax

    from tests.test_islands_strategy import _data, _params, train_step

    rng = np.random.default_rng(0)
    params = _params(rng)
    batches = _data(rng, 7)
    state = strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.adam(0.05)))
    losses = []
    for batch in strategy.experimental_distribute_dataset(batches):
        state, loss = strategy.run(train_step, args=(state, batch))
        losses.append(float(strategy.reduce("sum", loss)))
    local = strategy.experimental_local_results(state.inner.params["dense"]["kernel"])
    out = {
        "nproc": jax.process_count(),
        "replicas": strategy.num_replicas_in_sync,
        "losses": np.array(losses),
        "global_kernel": np.asarray(state.params["dense"]["kernel"]),
        "island_kernels": np.stack([np.asarray(x) for x in local]),
        "step": int(state.step),
    }
    np.savez(os.path.join(args.out, f"result_{jax.process_index()}.npz"), **out)
    print("done", out["losses"][-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
