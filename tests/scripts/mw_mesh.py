"""Trainer.fit on a replica mesh, for tests/test_replica_mesh.py.

Trains mw_train.py's MLP with ``dt.MultiWorkerMirroredStrategy(devices_per_replica=
--devices-per-replica, layout=--layout)`` (JSON; one process when no DISTRAIN_*
variables are set) for 2 epochs of 4 steps on an ArrayPipeline (shuffled, seeded),
backing up every step with BackupAndRestore (kept at the end). With --kill-at S, process
1 SIGKILLs itself at the end of step S on the first attempt (DISTRAIN_RESTART_COUNT
unset or 0), before that step's backup; ``distrain launch --max-restarts 1`` then
restarts both and the run resumes from step S - 1.

Writes --out/result_<process id>.npz: the final parameters (gathered), the state bytes
this process holds, its largest device's, the step the run started from, the
replica count, and the error for a batch of 12 rows (empty if it was accepted).
"""

import argparse
import json
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup", required=True)
    parser.add_argument("--devices-per-replica", default="1")
    parser.add_argument("--layout", default=None)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()

    import distrain as dt

    dpr = json.loads(args.devices_per_replica)
    layout = None
    if args.layout:
        from jax.sharding import PartitionSpec as P

        layout = {k: P(*v) for k, v in json.loads(args.layout).items()}
    strategy = dt.MultiWorkerMirroredStrategy(
        devices_per_replica=dpr, layout=layout, min_shard_bytes=0
    )

    import jax
    import mw_train
    from jax.experimental import multihost_utils

    pid = jax.process_index()
    first_attempt = os.environ.get("DISTRAIN_RESTART_COUNT", "0") == "0"
    step = mw_train.make_train_step(16)

    def train_step(state, batch):
        state, loss = step(state, batch)
        return state, {"loss": loss}

    class Kill(dt.callbacks.Callback):
        def on_train_batch_end(self, info):
            if first_attempt and pid == 1 and info.step == args.kill_at:
                print(f"killing myself at step {args.kill_at}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    class Start(dt.callbacks.Callback):
        start = None

        def on_train_batch_end(self, info):
            if Start.start is None:
                Start.start = info.step - info.num_steps

    rng = np.random.default_rng(7)
    arrays = {
        "x": rng.normal(size=(64, 8)).astype(np.float32),
        "y": rng.integers(0, 4, size=(64,)).astype(np.int32),
    }
    data = dt.data.ArrayPipeline(arrays, global_batch_size=16, seed=3)
    backup = dt.callbacks.BackupAndRestore(args.backup, save_freq=1, delete_checkpoint=False)
    with strategy.scope():
        trainer = dt.Trainer(strategy, train_step)
        state, _ = trainer.fit(
            mw_train.initial_state(), data, epochs=2, callbacks=[Start(), Kill(), backup]
        )
    here = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
    params = {
        k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
        for k, v in state.params.items()
    }
    # Rows that do not divide over a replica spanning processes: refused, not gathered.
    try:
        strategy.batch_sharding(12)
        refused = ""
    except ValueError as e:
        refused = str(e)
    np.savez(
        os.path.join(args.out, f"result_{pid}.npz"),
        refused=refused,
        state_bytes_here=here,
        bytes_per_device=strategy.memory_report(state)["bytes_per_device"],
        start=Start.start,
        replicas=strategy.num_replicas_in_sync,
        **params,
    )
    print(f"done from step {Start.start}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
