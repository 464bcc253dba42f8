"""mw_train.py's run with ``shard_state=True``: 2 processes x 4 devices vs 1 x 8.

Writes the per-step losses, the final parameters and the per-device state bytes to
--out/result_<process id>.npz. Used by tests/test_sharded_state.py.
"""

import argparse
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

sys.path.insert(0, str(Path(__file__).parent))

from mw_train import global_batch, initial_state, make_train_step  # noqa: E402

import distrain as dt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard-state", type=int, default=1)
    args = parser.parse_args()
    strategy = dt.MultiWorkerMirroredStrategy(shard_state=bool(args.shard_state), min_shard_bytes=0)
    batch, steps = 16, 4
    state = strategy.put_replicated(initial_state())
    step = make_train_step(batch)
    losses = []
    data = strategy.experimental_distribute_dataset(global_batch(i, batch) for i in range(steps))
    for dist_batch in data:
        state, loss = strategy.run(step, args=(state, dist_batch))
        losses.append(float(strategy.reduce("sum", loss)))
    report = strategy.memory_report(state)
    params = {
        k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
        for k, v in state.params.items()
    }
    np.savez(
        Path(args.out) / f"result_{jax.process_index()}.npz",
        losses=np.array(losses),
        bytes_per_device=report["bytes_per_device"],
        bytes_full_copy=report["bytes_full_copy"],
        replicas=strategy.num_replicas_in_sync,
        **params,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
